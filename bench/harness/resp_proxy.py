"""A loopback proxy in front of a Redis server that counts round trips.

Redis's ``INFO commandstats`` counts commands, not round trips: a pipeline of 1,000
HGETALLs and 1,000 EXISTS sent one after another both show 1,000 calls. The proxy
parses both directions as RESP and counts a round trip each time a client starts a
new request after every request it sent before on that connection was answered.

A pipeline reaches the proxy in several pieces, and Redis may answer the first
piece before the next one arrives; counted naively, that looks like two round
trips. So the proxy holds replies back until the client has sent nothing for
``QUIET_S``: a client that is still sending its pipeline cannot have seen an
answer. That adds ``QUIET_S`` to every round trip, so only the lookups whose round
trips are counted go through it, never the timed traffic.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

__all__ = ["RespCounter", "CountingProxy"]

RECV_BYTES = 1 << 20
QUIET_S = 0.025  # longer than a client's pause between the pieces of one pipeline, on a loaded machine too
CLOSE_TIMEOUT_S = 2.0
_AGGREGATES = {ord("*"): 1, ord("~"): 1, ord(">"): 1, ord("%"): 2, ord("|"): 2}
_BULKS = {ord("$"), ord("!"), ord("=")}


def _skip_value(buf: bytearray, pos: int) -> int | None:
    """The offset just past the RESP value starting at ``pos``; None while it is incomplete."""
    line_end = buf.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind = buf[pos]
    after_line = line_end + 2
    if kind in _BULKS:
        length = int(buf[pos + 1 : line_end])
        if length < 0:
            return after_line
        end = after_line + length + 2
        return end if end <= len(buf) else None
    if kind in _AGGREGATES:
        count = int(buf[pos + 1 : line_end])
        next_pos: int | None = after_line
        for _ in range(max(count, 0) * _AGGREGATES[kind]):
            assert next_pos is not None
            next_pos = _skip_value(buf, next_pos)
            if next_pos is None:
                return None
        return next_pos
    return after_line  # simple types (+ - : _ , # ( ) and inline commands: one line each


class RespCounter:
    """Counts complete top-level RESP values in a byte stream fed in pieces."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self.count = 0

    @property
    def between_values(self) -> bool:
        """True when no value is half-received."""
        return not self._pending

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        self._pending += data
        pos = done = 0
        while pos < len(self._pending):
            end = _skip_value(self._pending, pos)
            if end is None:
                break
            pos = end
            done += 1
        del self._pending[:pos]
        self.count += done
        return done


@dataclass
class _Link:
    """One client connection and its upstream connection to Redis."""

    client: socket.socket
    upstream: socket.socket
    requests: RespCounter = field(default_factory=RespCounter)
    replies: RespCounter = field(default_factory=RespCounter)
    round_trips: int = 0
    forwarded_replies: int = 0
    last_request_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class CountingProxy:
    """Listens on 127.0.0.1 and forwards to ``target_port``, counting requests, replies and round trips."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._closed = False
        self._threads: list[threading.Thread] = []
        accept = threading.Thread(target=self._accept_loop, name="resp-proxy-accept", daemon=True)
        accept.start()
        self._threads.append(accept)

    def counts(self) -> dict[str, int]:
        """Totals over every connection so far: requests, replies, round trips, connections."""
        with self._lock:
            links = list(self._links)
        return {
            "requests": sum(link.requests.count for link in links),
            "replies": sum(link.replies.count for link in links),
            "round_trips": sum(link.round_trips for link in links),
            "connections": len(links),
        }

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, upstream)
            with self._lock:
                self._links.append(link)
            for target in (self._pump_requests, self._pump_replies):
                thread = threading.Thread(target=target, args=(link,), name="resp-proxy-pump", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump_requests(self, link: _Link) -> None:
        try:
            while data := link.client.recv(RECV_BYTES):
                with link.lock:
                    # A request that starts after every earlier one was answered begins a round trip.
                    if link.requests.between_values and link.forwarded_replies == link.requests.count:
                        link.round_trips += 1
                    link.requests.feed(data)
                    link.last_request_at = time.monotonic()
                link.upstream.sendall(data)
        except OSError:
            pass
        finally:
            link.close()

    def _pump_replies(self, link: _Link) -> None:
        try:
            while data := link.upstream.recv(RECV_BYTES):
                link.replies.feed(data)
                while (wait_s := link.last_request_at + QUIET_S - time.monotonic()) > 0:
                    time.sleep(wait_s)
                with link.lock:
                    # Counted before the client can see them, so its next request finds them counted.
                    link.forwarded_replies = link.replies.count
                link.client.sendall(data)
        except OSError:
            pass
        finally:
            link.close()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()
        for thread in self._threads:
            thread.join(CLOSE_TIMEOUT_S)

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
