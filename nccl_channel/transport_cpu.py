"""The channel's contract over a TCP socket: what the tests run without a GPU."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from backend.errors import NcclError
from nccl_channel.link import Buffer, Link

__all__ = ["CpuLink", "CpuTransport"]

SECRET_BYTES = 16
_BATCH_HEAD = struct.Struct("<QQ")  # item count, total bytes


class CpuLink:
    """A pair over one TCP socket: a batch is a small header and the concatenated bytes."""

    def __init__(self, sock: socket.socket, progress: Callable[[int], None] | None = None) -> None:
        self.sock = sock
        self.progress = progress
        self.broken = False
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "(a peer already gone)"

    def _deadline_io(self, deadline: float, what: str, timeout_s: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NcclError(f"CPU channel {what} {self.peer} timed out after {timeout_s:.1f} s")
        self.sock.settimeout(remaining)

    @contextlib.contextmanager
    def _transfer(self, what: str, timeout_s: float) -> Iterator[None]:
        """One transfer (``what``: "send to" / "receive from"): any failure leaves the stream out of
        step, so it aborts the link, and a socket's failure is an NcclError naming the peer."""
        try:
            yield
        except TimeoutError:  # socket.timeout
            self.abort()
            raise NcclError(f"CPU channel {what} {self.peer} timed out after {timeout_s:.1f} s") from None
        except NcclError:
            self.abort()
            raise
        except OSError as exc:
            self.abort()
            raise NcclError(f"{what.split()[0]} failed: {exc or 'timed out'}") from None
        except BaseException:
            self.abort()
            raise

    def send(self, buffers: Sequence[Buffer], timeout_s: float) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        deadline = time.monotonic() + timeout_s
        with self._transfer("send to", timeout_s):
            self._deadline_io(deadline, "send to", timeout_s)
            self.sock.sendall(_BATCH_HEAD.pack(len(views), sum(len(v) for v in views)))
            for view in views:
                self._deadline_io(deadline, "send to", timeout_s)
                self.sock.sendall(view)

    def recv_into(
        self,
        sizes: Sequence[int],
        targets: Sequence[memoryview | None],
        timeout_s: float,
        landed: Callable[[int], None],
    ) -> None:
        """Receive each chunk straight into its target; ``landed(i)`` as each one is in."""
        deadline = time.monotonic() + timeout_s
        head = bytearray(_BATCH_HEAD.size)
        with self._transfer("receive from", timeout_s):  # also when ``landed`` fails: the stream is out of step
            self._recv_exact(memoryview(head), deadline, timeout_s)
            count, declared = _BATCH_HEAD.unpack(head)
            if (count, declared) != (len(sizes), sum(sizes)):
                raise NcclError(f"peer sent {count} items / {declared} bytes, expected {len(sizes)} / {sum(sizes)}")
            for index, (size, target) in enumerate(zip(sizes, targets)):
                if target is not None and len(target) != size:
                    raise NcclError(f"chunk {index}: a target of {len(target)} bytes for {size}")
                into = target if target is not None else memoryview(bytearray(size))
                self._recv_exact(into, deadline, timeout_s)
                if self.progress is not None:
                    self.progress(index)
                landed(index)

    def _recv_exact(self, view: memoryview, deadline: float, timeout_s: float) -> None:
        while view:
            self._deadline_io(deadline, "receive from", timeout_s)
            n = self.sock.recv_into(view)
            if n == 0:
                raise NcclError("the peer closed the channel mid-transfer")
            view = view[n:]

    def cancel(self) -> None:
        with contextlib.suppress(OSError):  # wakes a blocked send or recv; the socket stays open
            self.sock.shutdown(socket.SHUT_RDWR)

    def abort(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def close(self) -> None:
        self.abort()


class CpuTransport:
    """The channel's contract over TCP sockets: what the tests run without a GPU.

    The unique id is the address of a listener that rank 0 opens, plus a secret the
    joining side must present. ``progress`` (optional) is called with each item's
    index as it arrives: a seam for tests that act at a precise point of a transfer.
    """

    kind = "cpu"

    def __init__(self, host: str = "127.0.0.1", progress: Callable[[int], None] | None = None) -> None:
        self.host = host
        self.progress = progress

    def prepare(self) -> tuple[bytes, Any]:
        listener = socket.create_server((self.host, 0), backlog=4)
        secret = os.urandom(SECRET_BYTES)
        host, port = listener.getsockname()[:2]
        unique_id = json.dumps({"host": host, "port": port, "secret": secret.hex()}).encode()
        return unique_id, (listener, secret)

    def join(self, unique_id: bytes, rank: int, state: Any, timeout_s: float) -> Link:
        deadline = time.monotonic() + timeout_s
        if rank == 0:
            listener, secret = state
            return self._accept(listener, secret, deadline, timeout_s)
        try:
            address = json.loads(unique_id)
            host, port, secret = str(address["host"]), int(address["port"]), bytes.fromhex(address["secret"])
        except (ValueError, KeyError, TypeError):
            raise NcclError("CPU transport unique id is malformed") from None
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(secret)
        except OSError as exc:
            raise NcclError(f"cannot join the pair at {host}:{port}: {exc or 'timed out'}") from None
        return CpuLink(sock, self.progress)

    def _accept(self, listener: socket.socket, secret: bytes, deadline: float, timeout_s: float) -> CpuLink:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NcclError(
                    f"the peer did not join the CPU pair at {listener.getsockname()[:2]} within {timeout_s:.1f} s"
                )
            listener.settimeout(remaining)
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                raise NcclError(f"the peer did not join the pair: {exc or 'timed out'}") from None
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            presented = bytearray()
            try:
                while len(presented) < SECRET_BYTES and (piece := sock.recv(SECRET_BYTES - len(presented))):
                    presented += piece
            except OSError:
                presented = bytearray()
            if hmac.compare_digest(bytes(presented), secret):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return CpuLink(sock, self.progress)
            sock.close()  # not our peer: keep waiting for it

    def discard(self, state: Any) -> None:
        listener, _ = state
        listener.close()

    def register_host(self, memory: memoryview) -> None:
        pass  # sockets read any memory at the same speed
