"""``FrameSocket``: one connection speaking kvpool frames, zero-copy, on the event loop.

Bytes are received with ``recv_into`` straight into the caller's buffer and sent with
``sendmsg`` over memoryviews; nothing on this path concatenates payloads. While data
is available the loops run without yielding to the event loop, which is what makes
a single connection approach the loopback ceiling. Transfers of ``BULK_BYTES`` or more
on a socket given an executor run on worker threads (``backend.transport.workers``).
Every call that moves bytes stamps ``progress_at``: a silent peer is told from a slow
one by that stamp (``backend.client.connection``), at the cost of one clock read per call.

With TLS the same socket is wrapped by :mod:`ssl` (non-blocking, handshake driven
by the event loop); ``recv_into`` still lands in the caller's buffer, and sends go
one buffer at a time since an SSL socket has no ``sendmsg``. TLS transfers stay on
the loop: one SSL object must not be read and written from two threads at once.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from backend.errors import NodeUnavailable
from backend.iov import IOV_MAX, Buffer, advance, to_write
from backend.protocol import DEFAULT_LIMITS, Limits
from backend.protocol.frame import HEADER, Header, decode_header, verify_meta
from backend.transport.workers import BULK_BYTES, DISCARD_PIECE_BYTES, ThreadedTransfers

__all__ = ["FrameSocket", "tune_socket"]

SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
# A meta section up to this size is received into one buffer allocated up front;
# a larger one grows (doubling) as its bytes arrive.
EAGER_META_BYTES = 256 * 1024
# One SSL_write at most; a write that would block is retried with the same slice, as OpenSSL requires.
_TLS_WRITE_BYTES = 1024 * 1024
_TLS_SMALL_BYTES = 16 * 1024  # buffers below this are copied together before a TLS send


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay, large kernel buffers."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Find peers that vanished without a FIN (power loss, partition) within ~1 min.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


class FrameSocket:
    """One TCP connection speaking kvpool frames; owned by a single event loop."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, peer: str, bulk: Executor | None = None
    ) -> None:
        tune_socket(sock)
        self.sock = sock
        self.loop = loop
        self.peer = peer
        self.closed = False
        # time.monotonic() of the last byte received or sent (a recv or send call that moved
        # bytes, on the loop or on a worker thread): what tells a silent peer from a slow one.
        self.progress_at = time.monotonic()
        self.send_lock = asyncio.Lock()
        self._waiters: dict[bool, asyncio.Future[None]] = {}  # writable? -> waiting future
        self._header_buf = bytearray(HEADER.size)
        self._threads = ThreadedTransfers(self, bulk) if bulk is not None else None  # bulk transfers

    @property
    def tls(self) -> bool:
        return isinstance(self.sock, ssl.SSLSocket)

    def held_up_here(self) -> bool:
        """Whether a silence on this connection is this side's: bytes have arrived that nobody
        has read yet, or a transfer waits for a worker thread (busy with other sockets). A
        peer is silent only when neither holds. One poll; called when a silence is suspected."""
        if self.closed:
            return False
        if self._threads is not None and self._threads.queued():
            return True
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def _threaded(self, nbytes: int) -> bool:
        return self._threads is not None and nbytes >= BULK_BYTES and not self.tls

    @classmethod
    async def connect(
        cls, host: str, port: int, timeout_s: float, tls: ssl.SSLContext | None = None, bulk: Executor | None = None
    ) -> FrameSocket:
        """Connect, and with ``tls`` complete the handshake (verifying ``host``), all within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, kind, proto, _, address = infos[0]
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, address)
                except BaseException:
                    sock.close()
                    raise
        except TimeoutError:
            # (asyncio's TimeoutError has no text: say what happened)
            raise NodeUnavailable(
                f"cannot connect to {host}:{port}: no answer within {timeout_s * 1000:.0f} ms (its accept queue is "
                "full: a node under a connection flood, or one that stopped accepting; or the host is unreachable)"
            ) from None
        except OSError as exc:
            raise NodeUnavailable(f"cannot connect to {host}:{port}: {exc}") from None
        conn = cls(sock, loop, f"{host}:{port}", bulk)
        if tls is None:
            return conn
        try:
            async with asyncio.timeout(timeout_s):
                await conn.start_tls(tls, server_hostname=host)
        except TimeoutError:
            conn.close()
            raise NodeUnavailable(f"TLS handshake with {host}:{port} timed out") from None
        except BaseException:
            conn.close()
            raise
        return conn

    async def peek_byte(self) -> int:
        """The first byte waiting on the socket, left there (tells a TLS ClientHello from a frame)."""
        while True:
            try:
                data = self.sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                await self.wait_ready(writable=False)
                continue
            except OSError as exc:
                raise NodeUnavailable(f"receive from {self.peer} failed: {exc}") from None
            if not data:
                raise NodeUnavailable(f"{self.peer} closed the connection")
            return data[0]

    async def start_tls(self, context: ssl.SSLContext, *, server_hostname: str | None = None) -> None:
        """Wrap this connection in TLS and complete the handshake; server side when no ``server_hostname``.

        Raises NodeUnavailable naming the peer and the likely cause; the caller bounds the time.
        """
        try:
            self.sock = context.wrap_socket(
                self.sock,
                server_side=server_hostname is None,
                server_hostname=server_hostname,
                do_handshake_on_connect=False,
            )
        except OSError as exc:  # the peer left already
            raise NodeUnavailable(f"TLS with {self.peer} failed: {exc}") from None
        assert isinstance(self.sock, ssl.SSLSocket)
        while True:
            try:
                self.sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self.wait_ready(writable=False)
            except ssl.SSLWantWriteError:
                await self.wait_ready(writable=True)
            except ssl.SSLCertVerificationError as exc:
                raise NodeUnavailable(
                    f"TLS handshake with {self.peer} failed: certificate verify failed: {exc.verify_message or exc} "
                    "(is tls_ca the CA that signed the node's certificate, and does the certificate name the host "
                    "the node advertises?)"
                ) from None
            except (ssl.SSLError, OSError) as exc:
                raise NodeUnavailable(
                    f"TLS handshake with {self.peer} failed: {exc} (do both ends use TLS? a node serves TLS with "
                    "--tls-cert/--tls-key, a client asks for it with tls=on)"
                ) from None

    def close(self) -> None:
        """Close now; a coroutine waiting on this socket is woken with NodeUnavailable."""
        if self.closed:
            return
        self.closed = True
        if self._waiters:
            # Unregister before closing: the fd number is reused by the next socket.
            fd = self.sock.fileno()
            self.loop.remove_reader(fd)
            self.loop.remove_writer(fd)
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_exception(NodeUnavailable(f"connection to {self.peer} closed"))
            self._waiters.clear()
        if self._threads is not None and self._threads.busy:
            # A worker thread is in a transfer: wake it now, close the fd once it has returned.
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self.close_fd()

    def close_fd(self) -> None:
        """Close the descriptor itself: ``close`` calls it, or the last worker thread to leave a transfer."""
        try:
            self.sock.close()
        except OSError:
            pass

    async def wait_ready(self, writable: bool) -> None:
        """Wait on the event loop until the socket can be read (or written); NodeUnavailable once closed."""
        if self.closed:
            raise NodeUnavailable(f"connection to {self.peer} is closed")
        fut: asyncio.Future[None] = self.loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        fd = self.sock.fileno()
        if writable:
            self.loop.add_writer(fd, ready)
        else:
            self.loop.add_reader(fd, ready)
        self._waiters[writable] = fut
        try:
            await fut
        finally:
            if not self.closed:
                self._waiters.pop(writable, None)
                if writable:
                    self.loop.remove_writer(fd)
                else:
                    self.loop.remove_reader(fd)

    async def recv_into(self, buf: Buffer) -> None:
        """Fill ``buf`` exactly; raises NodeUnavailable if the peer closes first."""
        view = memoryview(buf).cast("B")
        while view:
            try:
                n = self.sock.recv_into(view)
            except (BlockingIOError, ssl.SSLWantReadError):
                await self.wait_ready(writable=False)
                continue
            except ssl.SSLWantWriteError:
                # TLS wants to write while reading (rare); the writer slot may be the sender's, so poll.
                await asyncio.sleep(0)
                continue
            except OSError as exc:
                raise NodeUnavailable(f"receive from {self.peer} failed: {exc}") from None
            if n == 0:
                raise NodeUnavailable(f"{self.peer} closed the connection")
            self.progress_at = time.monotonic()
            view = view[n:]

    async def recv_many(self, targets: Sequence[Buffer | int], digest: Callable[[Any], int] | None = None) -> list[int]:
        """Receive the next bytes into each buffer in turn (an int: drop that many bytes).

        Returns ``digest(buffer)`` per buffer (0 for drops and without ``digest``),
        computed where the bytes were received: on a worker thread for a bulk
        transfer, while they are still in the CPU's cache.
        """
        views: list[memoryview | int] = [t if isinstance(t, int) else memoryview(t).cast("B") for t in targets]
        total = sum(t if isinstance(t, int) else len(t) for t in views)
        if self._threaded(total):
            assert self._threads is not None
            return await self._threads.recv_many(views, digest)
        out = []
        for target in views:
            if isinstance(target, int):
                await self.discard(target)
                out.append(0)
            else:
                await self.recv_into(target)
                out.append(digest(target) if digest is not None else 0)
        return out

    async def discard(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` (a payload nobody wants) in bounded pieces."""
        scratch = bytearray(min(nbytes, DISCARD_PIECE_BYTES))
        while nbytes:
            piece = memoryview(scratch)[: min(nbytes, len(scratch))]
            await self.recv_into(piece)
            nbytes -= len(piece)

    async def recv_header(self, limits: Limits = DEFAULT_LIMITS) -> Header:
        """Receive and bound-check one frame header."""
        await self.recv_into(self._header_buf)
        return decode_header(self._header_buf, limits)

    async def recv_meta(self, header: Header) -> bytearray:
        """Receive a frame's meta section (already bounded by its header) and verify it.

        A large meta grows with the bytes that actually arrive, so a peer that
        declares ``max_meta_bytes`` and stalls costs only what it sent, however
        many such connections it opens.
        """
        if header.meta_len <= EAGER_META_BYTES:
            meta = bytearray(header.meta_len)
            await self.recv_into(meta)
        else:
            meta = bytearray()
            while len(meta) < header.meta_len:
                piece = bytearray(min(header.meta_len - len(meta), max(len(meta), EAGER_META_BYTES)))
                await self.recv_into(piece)
                meta += piece
        verify_meta(header, meta)
        return meta

    async def recv_frame_head(self, limits: Limits = DEFAULT_LIMITS) -> tuple[Header, bytearray]:
        """Receive a header and its meta section (verified); the data stays on the socket."""
        header = await self.recv_header(limits)
        return header, await self.recv_meta(header)

    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Send all buffers in order as one uninterrupted byte stream."""
        async with self.send_lock:
            pending = to_write(buffers)
            if self._threaded(sum(len(b) for b in pending)):
                assert self._threads is not None
                try:
                    await self._threads.send(pending)
                except BaseException:
                    self.close()  # a frame cut short leaves the stream unusable
                    raise
                return
            if self.tls:
                pending = _coalesce_small(pending)
            while pending:
                try:
                    if self.tls:
                        sent = self.sock.send(pending[0][:_TLS_WRITE_BYTES])
                    else:
                        sent = self.sock.sendmsg(pending[:IOV_MAX])
                except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    # (An SSL write that wants to read waits for the reader task to do it; the reader
                    # slot is that task's, so this waits on writability, which is soon.)
                    try:
                        await self.wait_ready(writable=True)
                    except BaseException:
                        # A frame cut short leaves the stream unusable: never reuse it.
                        self.close()
                        raise
                    continue
                except OSError as exc:
                    self.close()
                    raise NodeUnavailable(f"send to {self.peer} failed: {exc}") from None
                self.progress_at = time.monotonic()
                advance(pending, sent)


def _coalesce_small(buffers: list[memoryview]) -> list[memoryview]:
    """Join runs of small buffers (a header and its meta) so TLS sends them as one record, not several."""
    out: list[memoryview] = []
    run: list[memoryview] = []
    for buf in buffers:
        if len(buf) < _TLS_SMALL_BYTES:
            run.append(buf)
            continue
        if run:
            out.append(memoryview(b"".join(run)))
            run = []
        out.append(buf)
    if run:
        out.append(memoryview(b"".join(run)))
    return out
