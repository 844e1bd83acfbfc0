"""Fault helpers: a TCP proxy that misbehaves on demand, and a skewed wall clock.

A node started with ``--advertise 127.0.0.1:PROXY_PORT`` is reached by every client
through :class:`FaultProxy`, which forwards bytes faithfully until told to

- ``stall``: hold every byte in both directions (the peer sees a silent, open socket),
- ``truncate``: forward ``limit_bytes`` more bytes on each connection, then close it
  (a frame cut in the middle),
- ``reset``: abort every connection with an RST (SO_LINGER 0), now and on accept,

and back to ``pass``. Threads, not asyncio, so the proxy keeps running whatever the
test's own event loop is doing.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["FaultProxy", "FULL", "ROUNDS", "skewed_clock_env", "hostname_env"]

FULL = bool(os.environ.get("KVPOOL_FULL"))  # `make faults`: longer runs, more rounds
ROUNDS = 5 if FULL else 1
MODES = ("pass", "stall", "truncate", "reset")
POLL_S = 0.05


def _abort(sock: socket.socket) -> None:
    """Close with an RST instead of a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """Forward 127.0.0.1:``port`` to ``upstream``; ``set(mode)`` injects a fault.

    One thread per connection owns both of its sockets (a socket closed under another
    thread's ``recv`` can be a new connection's by the time that call runs).
    """

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL_S)
        self.port = int(self._listener.getsockname()[1])
        self.mode = "pass"
        self.limit_bytes = 0
        self._generation = 0
        self._lock = threading.Lock()
        self._links = 0
        self._stopped = threading.Event()
        self.counters = {"accepted": 0, "truncated": 0, "reset": 0}
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    def set(self, mode: str, limit_bytes: int = 0) -> None:
        """Switch mode for every connection, open or new; ``reset`` returns once all are aborted."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        with self._lock:
            self.mode, self.limit_bytes = mode, limit_bytes
            self._generation += 1
        if mode == "reset":
            deadline = time.monotonic() + 5.0
            while self._links and time.monotonic() < deadline:
                time.sleep(POLL_S / 5)

    def close(self) -> None:
        self._stopped.set()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name="fault-proxy", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.counters["accepted"] += 1
            if self.mode == "reset":
                self.counters["reset"] += 1
                _abort(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _abort(client)
                continue
            with self._lock:
                self._links += 1
            self._spawn(self._link, client, upstream)

    def _link(self, client: socket.socket, upstream: socket.socket) -> None:
        """Move bytes both ways as the mode says, until either side closes or the mode ends it."""
        peer = {client: upstream, upstream: client}
        budget_generation, budget_bytes = -1, 0
        abort = False
        with selectors.DefaultSelector() as selector:
            for sock in peer:
                sock.setblocking(True)
                selector.register(sock, selectors.EVENT_READ)
            try:
                while not self._stopped.is_set():
                    with self._lock:
                        mode, generation, limit = self.mode, self._generation, self.limit_bytes
                    if mode == "reset":
                        abort = True
                        self.counters["reset"] += 1
                        return
                    if mode == "stall":  # leave the bytes in the kernel's buffers
                        time.sleep(POLL_S)
                        continue
                    for key, _ in selector.select(POLL_S):
                        src: socket.socket = key.fileobj  # type: ignore[assignment]
                        data = src.recv(65536)
                        if not data:
                            return
                        if mode == "truncate":
                            if budget_generation != generation:
                                budget_generation, budget_bytes = generation, limit
                            allowed = min(len(data), budget_bytes)
                            budget_bytes -= allowed
                            peer[src].sendall(data[:allowed])
                            if allowed < len(data):
                                self.counters["truncated"] += 1
                                return
                        else:
                            peer[src].sendall(data)
            except OSError:
                return
            finally:
                for sock in peer:
                    selector.unregister(sock)
                    if abort:
                        _abort(sock)
                    else:
                        sock.close()
                with self._lock:
                    self._links -= 1


SITECUSTOMIZE = '''\
"""Test fault: shift this process's wall clock (time.time) by KVPOOL_TEST_CLOCK_SKEW_S seconds."""
import os
import time

_SKEW_S = float(os.environ.get("KVPOOL_TEST_CLOCK_SKEW_S", "0"))
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + _SKEW_S
time.time_ns = lambda: _time_ns() + int(_SKEW_S * 1e9)
'''


def skewed_clock_env(directory: Path, skew_s: float) -> dict[str, str]:
    """Environment for a child Python whose ``time.time`` runs ``skew_s`` off the machine's clock.

    A real clock change needs root and moves the whole machine; a ``sitecustomize``
    on the child's PYTHONPATH moves only that process (monotonic clocks untouched).
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "KVPOOL_TEST_CLOCK_SKEW_S": str(skew_s)}


HOSTNAME_SITECUSTOMIZE = '''\
"""Test setting: this process says its host is KVPOOL_TEST_HOSTNAME (nodes register the host they run on)."""
import os
import socket

_NAME = os.environ["KVPOOL_TEST_HOSTNAME"]
socket.gethostname = lambda: _NAME
'''


def hostname_env(directory: Path, hostname: str) -> dict[str, str]:
    """Environment for a child Python that reports ``hostname`` as its host name.

    Placement keeps replicas on distinct hosts; one machine has one host name, so a
    ``sitecustomize`` gives each node process the host it stands for.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(HOSTNAME_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "KVPOOL_TEST_HOSTNAME": hostname}
