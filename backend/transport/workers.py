"""Bulk transfers of a ``FrameSocket`` on worker threads, a turn at a time.

A socket given an executor moves any transfer of ``BULK_BYTES`` or more on a worker thread
(``recv_into``/``sendmsg`` release the GIL, so the kernel's copies run on the other core
while the loop keeps serving). A thread moves bytes while the socket has them and waits for
more at most ``THREAD_WAIT_S`` in all per turn; then it hands the rest of the transfer back
to the event loop, which waits for the socket without a thread and gives the transfer a
thread again (at the back of the executor's queue) once bytes can move. So a silent or slow
peer holds no thread while it is quiet, and a few of them cannot take every thread from the
node's other connections. Closing the socket while a thread is in a transfer shuts it down
at once, which wakes the thread, and the descriptor is closed only when the thread has
returned, so its number is never reused under it.

This part sees its socket only through :class:`TransferEnd`: it never imports ``FrameSocket``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import select
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

from backend.errors import NodeUnavailable
from backend.iov import IOV_MAX, advance

__all__ = ["BULK_BYTES", "THREAD_WAIT_S", "DISCARD_PIECE_BYTES", "TransferEnd", "ThreadedTransfers"]

T = TypeVar("T")

# A transfer at least this large goes through the socket's executor, when it has one:
# below it, the hop to a thread costs more than the copy it moves off the loop.
BULK_BYTES = 1024 * 1024
# A worker thread waits on its socket at most this long in all per turn, then hands the transfer back
# to the event loop. Long enough that a stream a little slower than the copy keeps its thread (the
# waits between segments are microseconds), short enough that peers dribbling a byte now and then
# hold a thread only for this long each time before the next transfer in the queue gets it.
THREAD_WAIT_S = 0.005
# Bytes nobody wants are read in pieces this large: a peer that stalls in the middle
# of a dropped payload holds only this much (1 MiB each let 64 such peers cost 64 MiB).
DISCARD_PIECE_BYTES = 64 * 1024


class TransferEnd(Protocol):
    """What the worker-thread transfers use of the ``FrameSocket`` they serve."""

    sock: socket.socket
    loop: asyncio.AbstractEventLoop
    peer: str
    closed: bool
    progress_at: float  # time.monotonic() of the last byte moved: a worker stamps it too

    async def wait_ready(self, writable: bool) -> None:
        """Wait on the event loop until the socket can be read (or written)."""
        ...

    def close_fd(self) -> None:
        """Close the descriptor itself (once no thread is in a transfer on it)."""
        ...


class ThreadedTransfers:
    """The transfers of one ``FrameSocket`` that run on worker threads, a turn at a time.

    A turn (:meth:`run`) moves bytes on a worker thread while the socket has them, waiting
    for it at most ``THREAD_WAIT_S`` in all; a transfer left unfinished then waits for the
    socket on the event loop (no thread held) and takes its next turn once bytes can move.
    While any thread is in a turn the socket's descriptor stays open: ``FrameSocket.close``
    only shuts it down, which wakes the thread, and the descriptor is closed when the last
    thread has returned, so its number is never reused under a thread.
    """

    def __init__(self, owner: TransferEnd, executor: Executor) -> None:
        self.owner = owner
        self.executor = executor
        self.busy = 0  # threads in a turn on this socket
        self._fd = owner.sock.fileno()
        # One flag per turn handed to the executor, set by its thread when it starts: the
        # loop adds and removes them, a worker only stores True (atomic under the GIL).
        self._started: dict[int, list[bool]] = {}

    def queued(self) -> bool:
        """A turn of this socket is waiting for a worker thread."""
        return not all(flag[0] for flag in list(self._started.values()))

    async def recv_many(self, targets: Sequence[memoryview | int], digest: Callable[[Any], int] | None) -> list[int]:
        """``FrameSocket.recv_many``, in turns on worker threads."""
        receiving = _Receiving(self, targets, digest)
        await self._turns(receiving.turn, writable=False, stop=socket.SHUT_RD)
        return receiving.out

    async def send(self, pending: list[memoryview]) -> None:
        """Send every buffer, in order, in turns on worker threads."""
        sending = _Sending(self, pending)
        await self._turns(sending.turn, writable=True, stop=socket.SHUT_RDWR)

    async def _turns(self, turn: Callable[[], bool], *, writable: bool, stop: int) -> None:
        """Run ``turn`` on a worker thread until it reports the transfer done, waiting on the loop between turns.

        Cancelled while it waits on the loop, the stream is cut off as in :meth:`run`.
        """
        while not await self.run(turn, stop=stop):
            try:
                await self.owner.wait_ready(writable)
            except asyncio.CancelledError:
                with contextlib.suppress(OSError):
                    self.owner.sock.shutdown(stop)
                raise

    async def run(self, fn: Callable[..., T], *args: Any, stop: int = socket.SHUT_RDWR) -> T:
        """Run a blocking transfer on the executor; the loop stays free meanwhile.

        Cancelled mid-transfer, the stream is unusable: ``shutdown(stop)`` wakes the
        thread, and this waits for it, so that the caller never hands back a buffer the
        thread is still filling. The caller then closes the connection.
        """
        owner = self.owner
        if owner.closed:
            raise NodeUnavailable(f"connection to {owner.peer} is closed")
        flag = [False]
        self._started[id(flag)] = flag

        def started() -> T:
            flag[0] = True
            return fn(*args)

        future = owner.loop.run_in_executor(self.executor, started)
        self.busy += 1
        future.add_done_callback(lambda _: self._started.pop(id(flag), None))
        future.add_done_callback(self._returned)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            try:
                owner.sock.shutdown(stop)
            except OSError:
                pass
            await asyncio.wait([future])
            raise

    def _returned(self, future: asyncio.Future[Any]) -> None:
        self.busy -= 1
        if not future.cancelled():
            future.exception()  # the caller saw it, or was cancelled and closed the stream
        if self.owner.closed and not self.busy:
            self.owner.close_fd()

    def recv_some(self, view: memoryview, clock: _TurnClock) -> int:
        """In a worker thread: receive into ``view``; the bytes received, 0 once the turn may wait no longer."""
        sock, peer = self.owner.sock, self.owner.peer
        while True:
            try:
                n = sock.recv_into(view)
            except BlockingIOError:
                if not clock.ready(select.POLLIN):
                    return 0
                continue
            except OSError as exc:
                raise NodeUnavailable(f"receive from {peer} failed: {exc}") from None
            if n == 0:
                raise NodeUnavailable(f"{peer} closed the connection")
            self.owner.progress_at = time.monotonic()  # one float store: atomic under the GIL
            return n

    def send_some(self, pending: list[memoryview], clock: _TurnClock) -> int:
        """In a worker thread: send from ``pending``; the bytes sent, 0 once the turn may wait no longer."""
        sock, peer = self.owner.sock, self.owner.peer
        while True:
            try:
                sent = sock.sendmsg(pending[:IOV_MAX])
            except BlockingIOError:
                if not clock.ready(select.POLLOUT):
                    return 0
                continue
            except OSError as exc:
                raise NodeUnavailable(f"send to {peer} failed: {exc}") from None
            self.owner.progress_at = time.monotonic()
            return sent

    def check_open(self) -> None:
        """In a worker thread: NodeUnavailable once the socket was closed."""
        if self.owner.closed:
            raise NodeUnavailable(f"connection to {self.owner.peer} closed")


class _TurnClock:
    """How long one worker turn may still wait on its socket (``THREAD_WAIT_S`` in all)."""

    def __init__(self, transfers: ThreadedTransfers) -> None:
        self.transfers = transfers
        self.left_s = THREAD_WAIT_S

    def ready(self, events: int) -> bool:
        """Wait until the socket is ready for ``events``; False once the turn's waiting time is spent."""
        if self.left_s <= 0:
            return False
        poller = select.poll()
        poller.register(self.transfers._fd, events)
        started = time.monotonic()
        ready = bool(poller.poll(math.ceil(self.left_s * 1000)))
        self.left_s -= time.monotonic() - started
        self.transfers.check_open()
        return ready


class _Receiving:
    """One ``recv_many`` on worker threads: where it stands between turns."""

    def __init__(
        self, transfers: ThreadedTransfers, targets: Sequence[memoryview | int], digest: Callable[[Any], int] | None
    ) -> None:
        self.transfers = transfers
        self.targets = targets
        self.digest = digest
        self.out: list[int] = []  # per target done: its digest (0 for drops and without digest)
        self.offset = 0  # bytes of the current target received
        self._scratch: memoryview | None = None

    def turn(self) -> bool:
        """In a worker thread: receive until every target is full (True) or the turn may wait no longer."""
        clock = _TurnClock(self.transfers)
        while len(self.out) < len(self.targets):
            target = self.targets[len(self.out)]
            size = target if isinstance(target, int) else len(target)
            while self.offset < size:
                if isinstance(target, int):  # dropped bytes land in a bounded scratch buffer
                    self._scratch = self._scratch or memoryview(bytearray(min(size, DISCARD_PIECE_BYTES)))
                    piece = self._scratch[: min(size - self.offset, len(self._scratch))]
                else:
                    piece = target[self.offset :]
                n = self.transfers.recv_some(piece, clock)
                if not n:
                    return False
                self.offset += n
            if isinstance(target, int) or self.digest is None:
                self.out.append(0)
            else:
                self.out.append(self.digest(target))  # hashed here, while the bytes are in this core's cache
            self.offset = 0
        return True


class _Sending:
    """One bulk send on worker threads: what is left of it between turns."""

    def __init__(self, transfers: ThreadedTransfers, pending: list[memoryview]) -> None:
        self.transfers = transfers
        self.pending = pending

    def turn(self) -> bool:
        """In a worker thread: send until nothing is left (True) or the turn may wait no longer."""
        clock = _TurnClock(self.transfers)
        while self.pending:
            sent = self.transfers.send_some(self.pending, clock)
            if not sent:
                return False
            advance(self.pending, sent)
        return True
