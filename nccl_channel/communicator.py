"""PairCommunicator: a 2-rank NCCL communicator that moves contiguous torch tensors.

One communicator per (client, server) pair, with its own CUDA stream. Creation and
every transfer are bounded: the communicator is created non-blocking and polled
with ``ncclCommGetAsyncError``; a transfer is issued inside one NCCL group and its
completion is polled with a CUDA event (``nccl_channel.waits``: a short spin, then
pauses from 20 µs growing slowly, so a finished transfer is seen within microseconds). When the deadline passes, the communicator
is aborted (``ncclCommAbort`` stops its kernels) and :class:`NcclError` is raised, so
the caller can fall back to TCP instead of hanging. Another thread never calls NCCL
on a communicator in use: it sets ``abort_requested`` and the polling loop, in the
transfer's own thread, stops and aborts. Close explicitly; nothing is torn down in
``__del__`` (a destroy there could block on a peer at interpreter exit).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from backend.errors import NcclError
from nccl_channel.library import NCCL_IN_PROGRESS, NCCL_SUCCESS, NcclLibrary, NcclUniqueId
from nccl_channel.waits import never, wait_until

__all__ = ["PairCommunicator"]

logger = logging.getLogger(__name__)


def _contiguous_bytes(tensor: torch.Tensor, what: str) -> int:
    if not tensor.is_cuda:
        raise NcclError(f"{what}: NCCL moves CUDA tensors, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise NcclError(f"{what}: the tensor is not contiguous")
    return int(tensor.numel() * tensor.element_size())


class PairCommunicator:
    """A communicator of ``world_size`` ranks (2 for a pair; 1 for a self test) on one device."""

    def __init__(self, lib: NcclLibrary, comm: Any, rank: int, world_size: int, device: torch.device) -> None:
        self.lib = lib
        self.comm = comm
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.broken = False
        self.closed = False
        self.abort_requested = False  # set from any thread; the transfer's polling loop aborts

    @property
    def peer(self) -> int:
        return (self.rank + 1) % self.world_size

    @classmethod
    def create(
        cls,
        lib: NcclLibrary,
        uid: NcclUniqueId,
        rank: int,
        world_size: int,
        device: torch.device | str,
        timeout_s: float,
    ) -> PairCommunicator:
        """Join a communicator; every rank calls this with the same ``uid``. Aborted at the deadline."""
        dev = torch.device(device)
        if dev.type != "cuda":
            raise NcclError(f"NCCL needs a CUDA device, got {dev}")
        with torch.cuda.device(dev):
            comm, result = lib.comm_init_rank_config(world_size, uid, rank)
            try:
                _wait_ready(lib, comm, result, timeout_s, f"creating rank {rank} of {world_size}")
            except NcclError:
                _abort_quietly(lib, comm)
                raise
        return cls(lib, comm, rank, world_size, dev)

    def send(self, tensors: Sequence[torch.Tensor], timeout_s: float, peer: int | None = None) -> None:
        """Send every tensor to ``peer`` inside one NCCL group and wait for completion."""
        self._run([(t, "send") for t in tensors], timeout_s, peer)

    def recv(self, tensors: Sequence[torch.Tensor], timeout_s: float, peer: int | None = None) -> None:
        """Receive into every tensor from ``peer`` inside one NCCL group and wait for completion."""
        self._run([(t, "recv") for t in tensors], timeout_s, peer)

    def exchange(
        self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], timeout_s: float, peer: int | None = None
    ) -> None:
        """Sends and receives in one group (with ``world_size == 1`` this is a self copy)."""
        self._run([*((t, "send") for t in sends), *((t, "recv") for t in recvs)], timeout_s, peer)

    def _run(self, ops: list[tuple[torch.Tensor, str]], timeout_s: float, peer: int | None) -> None:
        started = time.monotonic()
        sizes = [_contiguous_bytes(t, f"{kind} {i}") for i, (t, kind) in enumerate(ops)]
        # The stream must see the producer's writes (staging copies on the current stream).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        raw = [(int(t.data_ptr()), nbytes, kind) for (t, kind), nbytes in zip(ops, sizes)]
        done = self.issue(raw, timeout_s, peer, started=started)
        self.wait(done, timeout_s, started, f"rank {self.rank}: a group of {len(ops)} transfers")
        for tensor, _ in ops:
            tensor.record_stream(self.stream)

    def issue(
        self,
        ops: Sequence[tuple[int, int, str]],
        timeout_s: float,
        peer: int | None = None,
        after: torch.cuda.Event | None = None,
        started: float | None = None,
    ) -> torch.cuda.Event:
        """Queue one group of ``(pointer, nbytes, "send"|"recv")`` on this communicator's stream; no waiting
        for the bytes. Returns an event that completes with the group. ``after``: an event the group waits
        for (a staging copy on another stream). The caller keeps the buffers alive until the event completes.
        """
        if self.closed or self.broken:
            raise NcclError("the communicator was closed or aborted")
        target = self.peer if peer is None else peer
        started = time.monotonic() if started is None else started
        if after is not None:
            self.stream.wait_event(after)
        stream_handle = int(self.stream.cuda_stream)
        what = f"rank {self.rank}: a group of {len(ops)} transfers with peer rank {target}"
        try:
            with torch.cuda.device(self.device):
                self.lib.group_start()
                try:
                    for pointer, nbytes, kind in ops:
                        if nbytes:
                            issue = self.lib.send if kind == "send" else self.lib.recv
                            issue(pointer, nbytes, target, self.comm, stream_handle)
                finally:
                    result = self.lib.group_end()
                _wait_ready(self.lib, self.comm, result, timeout_s, what, started, self._abort_requested)
                done = torch.cuda.Event()
                done.record(self.stream)
        except NcclError:
            self.abort()
            raise
        return done

    def wait(self, event: torch.cuda.Event, timeout_s: float, started: float, what: str) -> None:
        """Wait for ``event`` (spin, then short growing pauses); aborts the communicator at ``started + timeout_s``
        or when ``abort_requested`` is set, and raises NcclError."""
        wait_until(
            event.query,
            deadline=started + timeout_s,
            timeout_s=timeout_s,
            what=f"rank {self.rank}: {what}",
            stop=self._abort_requested,
            abort=self.abort,
        )

    def _abort_requested(self) -> bool:
        return self.abort_requested

    def abort(self) -> None:
        """Stop everything in flight and free the communicator; never blocks on the peer."""
        if self.closed:
            return
        self.broken = True
        self.closed = True
        try:
            self.lib.comm_abort(self.comm)
        except NcclError as exc:
            logger.warning("nccl: abort failed: %s", exc)

    def close(self) -> None:
        """Free the communicator once its work is done (abort if it is broken)."""
        if self.closed:
            return
        if self.broken:
            self.abort()
            return
        self.closed = True
        try:
            self.lib.comm_destroy(self.comm)
        except NcclError as exc:
            logger.warning("nccl: destroy failed: %s", exc)


def _wait_ready(
    lib: NcclLibrary,
    comm: Any,
    result: int,
    timeout_s: float,
    what: str,
    started: float | None = None,
    stop: Callable[[], bool] = never,
) -> None:
    """Wait until a non-blocking communicator is ready; NcclError at the deadline or on ``stop()`` (the caller aborts)."""
    state = result

    def ready() -> bool:
        nonlocal state
        if state == NCCL_IN_PROGRESS:
            state = lib.comm_async_error(comm)
        return state != NCCL_IN_PROGRESS

    deadline = (time.monotonic() if started is None else started) + timeout_s
    wait_until(ready, deadline=deadline, timeout_s=timeout_s, what=what, stop=stop)
    if state != NCCL_SUCCESS:
        raise NcclError(f"{what} failed", state, lib.error_string(state))


def _abort_quietly(lib: NcclLibrary, comm: Any) -> None:
    try:
        lib.comm_abort(comm)
    except NcclError as exc:
        logger.warning("nccl: abort failed: %s", exc)


def _wait_event(event: torch.cuda.Event, timeout_s: float, what: str, started: float, stop: Callable[[], bool]) -> None:
    """Wait for ``event`` (spin, then short growing pauses: nccl_channel.waits); NcclError at the deadline."""
    wait_until(event.query, deadline=started + timeout_s, timeout_s=timeout_s, what=what, stop=stop)
