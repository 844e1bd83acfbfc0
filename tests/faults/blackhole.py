"""A link that goes silent: a TCP forwarder that, blackholed, moves no byte either way and closes nothing.

What a partition does to TCP (a dropped route, an ``nft`` drop rule): every connection
stays open, no RST, no FIN, and nothing arrives; new connections are accepted and are
just as silent. Bytes sent meanwhile wait (here in the kernel's buffers, as TCP would
retransmit them) and flow again after :meth:`Blackhole.heal`.
``blackhole(after_bytes=N)`` lets N more bytes through toward the clients first: a
batch cut in the middle of its transfer. Threads, not asyncio, as in ``proxy.py``.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time

__all__ = ["Blackhole"]

POLL_S = 0.02


class Blackhole:
    """Forward 127.0.0.1:``port`` to 127.0.0.1:``upstream_port`` until blackholed."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL_S)
        self.port = int(self._listener.getsockname()[1])
        self.silent = False
        self._budget = 0  # bytes still let through toward clients while silent
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._accept_loop, name="blackhole", daemon=True)]
        self._threads[0].start()

    def blackhole(self, after_bytes: int = 0) -> None:
        """Go silent in both directions, after ``after_bytes`` more bytes toward the clients."""
        with self._lock:
            self.silent, self._budget = True, after_bytes

    def heal(self) -> None:
        with self._lock:
            self.silent, self._budget = False, 0

    def close(self) -> None:
        self._stopped.set()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()

    def __enter__(self) -> Blackhole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._link, args=(client,), name="blackhole-link", daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _allowed(self, toward_client: bool, want: int) -> int:
        """How many bytes this read may move now (0: stay silent)."""
        with self._lock:
            if not self.silent:
                return want
            if not toward_client or self._budget <= 0:
                return 0
            allowed = min(want, self._budget)
            self._budget -= allowed
            return allowed

    def _link(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            # A connection made while silent waits, open, for the heal before reaching upstream.
            while self.silent and not self._stopped.is_set():
                time.sleep(POLL_S)
            upstream = socket.create_connection(self.upstream, timeout=5)
            peer = {client: upstream, upstream: client}
            with selectors.DefaultSelector() as selector:
                for sock in peer:
                    sock.setblocking(True)
                    selector.register(sock, selectors.EVENT_READ)
                while not self._stopped.is_set():
                    for key, _ in selector.select(POLL_S):
                        src: socket.socket = key.fileobj  # type: ignore[assignment]
                        allowed = self._allowed(src is upstream, 65536)
                        if not allowed:  # leave the bytes where they are: nothing moves
                            time.sleep(POLL_S)
                            continue
                        data = src.recv(allowed)
                        if not data:
                            return
                        peer[src].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            if upstream is not None:
                upstream.close()
