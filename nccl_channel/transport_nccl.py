"""The channel over libnccl: links over a :class:`PairCommunicator`, host bytes staged on the GPU."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from backend.errors import NcclError
from nccl_channel.link import Buffer, Link
from nccl_channel.pipeline import RING_DEPTH
from nccl_channel.pipeline import run_ring as drive_ring
from nccl_channel.staging import HostRegistry, StagingRing, is_pinned

__all__ = ["NcclLink", "NcclTransport", "exchange_self"]


class NcclLink:
    """A pair over a :class:`PairCommunicator`: chunk after chunk through a ring of GPU slots.

    The host copy of one chunk overlaps the NCCL transfer of the next
    (``nccl_channel.pipeline``); copies from registered or pinned memory are
    asynchronous, others go through a pinned bounce slot.
    """

    def __init__(self, comm: Any, registry: HostRegistry | None = None, depth: int = RING_DEPTH) -> None:
        self.comm = comm
        self.registry = registry if registry is not None else HostRegistry()
        self.depth = depth
        self._ring: StagingRing | None = None
        self._copies = torch.cuda.Stream(device=comm.device)  # host<->device copies, beside NCCL's stream

    @property
    def broken(self) -> bool:
        return bool(self.comm.broken or self.comm.closed)

    def _ring_for(self, largest: int) -> StagingRing:
        if self._ring is None or self._ring.slot_bytes < largest:
            self._ring = None  # the old ring's memory goes back before the new one is made
            try:
                self._ring = StagingRing(self.comm.device, self.depth, largest)
            except NcclError:
                self.comm.abort()
                raise
        return self._ring

    def _pinned(self, view: memoryview) -> bool:
        return self.registry.contains(view) or is_pinned(view)

    def send(self, buffers: Sequence[Buffer], timeout_s: float) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        started = time.monotonic()
        ring = self._ring_for(max((len(v) for v in views), default=0))

        def issue(index: int) -> Any:
            pointer, copied = self.copy_out(ring, index, views[index])
            return self.comm.issue([(pointer, len(views[index]), "send")], timeout_s, after=copied, started=started)

        self.run_ring(len(views), issue, lambda _index: None, timeout_s, started, "send")

    def copy_out(self, ring: StagingRing, index: int, view: memoryview) -> tuple[int, Any]:
        """Where NCCL sends chunk ``index`` from (its ring slot), and the event its staging copy completes.

        The chunk's slot is free: its previous chunk's send completed (``run_ring`` waited for it).
        """
        slot = ring.device_slots[index % ring.depth][: len(view)]
        with torch.cuda.stream(self._copies):
            if len(view):
                source = torch.frombuffer(view, dtype=torch.uint8)
                if not self._pinned(view):
                    source = ring.bounce(index % ring.depth)[: len(view)].copy_(source)
                slot.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copies)
        return int(slot.data_ptr()), copied

    def recv_into(
        self,
        sizes: Sequence[int],
        targets: Sequence[memoryview | None],
        timeout_s: float,
        landed: Callable[[int], None],
    ) -> None:
        started = time.monotonic()
        ring = self._ring_for(max(sizes, default=0))
        bounced: dict[int, torch.Tensor] = {}

        def issue(index: int) -> Any:
            pointer = self.recv_pointer(ring, index, sizes[index], targets[index])
            arrived = self.comm.issue([(pointer, sizes[index], "recv")], timeout_s, started=started)
            return self.copy_in(ring, index, targets[index], arrived, bounced)

        self.run_ring(
            len(sizes), issue, lambda index: self.land(index, targets, bounced, landed), timeout_s, started, "receive"
        )

    def recv_pointer(self, ring: StagingRing, index: int, size: int, target: memoryview | None) -> int:
        """Where NCCL receives chunk ``index``: its ring slot."""
        if target is not None and len(target) != size:
            self.comm.abort()
            raise NcclError(f"chunk {index}: a target of {len(target)} bytes for {size}")
        return int(ring.device_slots[index % ring.depth].data_ptr())

    def copy_in(
        self, ring: StagingRing, index: int, target: memoryview | None, arrived: Any, bounced: dict[int, torch.Tensor]
    ) -> Any:
        """Queue the copy of chunk ``index`` from its slot to the host once ``arrived``; the event it completes.

        A pinned target gets the bytes straight; any other, through the slot's pinned bounce
        buffer (kept in ``bounced`` until :meth:`land`).
        """
        if target is None or not len(target):
            return arrived
        slot = ring.device_slots[index % ring.depth][: len(target)]
        with torch.cuda.stream(self._copies):
            self._copies.wait_event(arrived)
            if self._pinned(target):
                torch.frombuffer(target, dtype=torch.uint8).copy_(slot, non_blocking=True)
            else:
                bounced[index] = ring.bounce(index % ring.depth)[: len(target)].copy_(slot, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copies)
        return copied

    @staticmethod
    def land(
        index: int,
        targets: Sequence[memoryview | None],
        bounced: dict[int, torch.Tensor],
        landed: Callable[[int], None],
    ) -> None:
        """Chunk ``index`` is on the host: out of its bounce buffer into a pageable target, then ``landed``."""
        bounce, target = bounced.pop(index, None), targets[index]
        if bounce is not None and target is not None:
            torch.frombuffer(target, dtype=torch.uint8).copy_(bounce)
        landed(index)

    def run_ring(
        self,
        count: int,
        issue: Callable[[int], Any],
        land: Callable[[int], None],
        timeout_s: float,
        started: float,
        what: str,
    ) -> None:
        """Drive ``issue``/``land`` through the ring; any failure aborts the communicator and raises NcclError."""
        ring_depth = self.depth

        def wait(event: Any, index: int) -> None:
            self.comm.wait(event, timeout_s, started, f"{what} of chunk {index} of {count}")

        try:
            drive_ring(count, ring_depth, issue, land, wait)
        except NcclError:
            self.comm.abort()  # idempotent: the wait may have aborted already
            raise
        except RuntimeError as exc:  # a CUDA error in a staging copy
            self.comm.abort()
            raise NcclError(f"a staging copy on {self.comm.device} failed: {exc}") from None
        except BaseException:  # ``landed`` failed: the rest of the batch is unread, the pair out of step
            self.comm.abort()
            raise

    def cancel(self) -> None:
        self.comm.abort_requested = True  # the transfer thread's polling loop stops and aborts

    def abort(self) -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.close()


def exchange_self(
    node: NcclLink,
    client: NcclLink,
    buffers: Sequence[Buffer],
    targets: Sequence[memoryview | None],
    timeout_s: float,
    landed: Callable[[int], None],
) -> None:
    """Both ends of the pipelined path on one 1-rank communicator (NCCL sends to itself only inside one group).

    ``node`` stages each chunk as :meth:`NcclLink.send` does, ``client`` lands it as
    :meth:`NcclLink.recv_into` does; each chunk's send and receive go in one group. Both
    links share the communicator. The benchmark and the GPU tests measure the path with it.
    """
    views = [memoryview(b).cast("B") for b in buffers]
    started = time.monotonic()
    largest = max((len(v) for v in views), default=0)
    out_ring, in_ring = node._ring_for(largest), client._ring_for(largest)
    bounced: dict[int, torch.Tensor] = {}

    def issue(index: int) -> Any:
        size, target = len(views[index]), targets[index]
        source, copied = node.copy_out(out_ring, index, views[index])
        into = client.recv_pointer(in_ring, index, size, target)
        arrived = client.comm.issue(
            [(source, size, "send"), (into, size, "recv")], timeout_s, peer=0, after=copied, started=started
        )
        return client.copy_in(in_ring, index, target, arrived, bounced)

    client.run_ring(
        len(views),
        issue,
        lambda index: client.land(index, targets, bounced, landed),
        timeout_s,
        started,
        "self exchange",
    )


class NcclTransport:
    """Pairs over libnccl on one CUDA device (``nccl_channel.available()`` must be true)."""

    kind = "nccl"

    def __init__(self, device: str | torch.device = "cuda:0") -> None:
        from nccl_channel.library import load_library

        self.device = torch.device(device)
        self.registry = HostRegistry()  # shared by this transport's links; see register_host
        self.lib = load_library()

    def prepare(self) -> tuple[bytes, Any]:
        return self.lib.unique_id().to_bytes(), None

    def join(self, unique_id: bytes, rank: int, state: Any, timeout_s: float) -> Link:
        from nccl_channel.communicator import PairCommunicator
        from nccl_channel.library import NcclUniqueId

        comm = PairCommunicator.create(self.lib, NcclUniqueId.from_bytes(unique_id), rank, 2, self.device, timeout_s)
        return NcclLink(comm, self.registry)

    def discard(self, state: Any) -> None:
        pass

    def register_host(self, memory: memoryview) -> None:
        """Page-lock ``memory`` (a whole mapping, once) so chunks in it are copied to the GPU asynchronously."""
        with torch.cuda.device(self.device):
            self.registry.register(memory)

    def close(self) -> None:
        """Unregister host memory; call once every link is closed."""
        self.registry.close()
