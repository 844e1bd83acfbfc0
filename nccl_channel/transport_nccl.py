"""The channel over libnccl: links over a :class:`PairCommunicator`, host bytes staged on the GPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from backend.errors import NcclError
from nccl_channel.link import Buffer, Link

__all__ = ["NcclLink", "NcclTransport"]


class NcclLink:
    """A pair over a :class:`PairCommunicator`: host bytes are staged on the device, sent in one group."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self._staging = torch.empty(0, dtype=torch.uint8, device=comm.device)

    @property
    def broken(self) -> bool:
        return bool(self.comm.broken or self.comm.closed)

    def _stage(self, total: int) -> torch.Tensor:
        if self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8, device=self.comm.device)
        return self._staging

    def send(self, buffers: Sequence[Buffer], timeout_s: float) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        try:
            staging = self._stage(sum(len(v) for v in views))
            slices, offset = [], 0
            for view in views:
                if len(view):
                    part = staging[offset : offset + len(view)]
                    part.copy_(torch.frombuffer(view, dtype=torch.uint8))
                    slices.append(part)
                offset += len(view)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one: the caller falls back to TCP
            self.comm.abort()
            raise NcclError(f"staging a batch on {self.comm.device} failed: {exc}") from None
        self.comm.send(slices, timeout_s)

    def recv(self, sizes: Sequence[int], timeout_s: float) -> list[torch.Tensor]:
        try:
            staging = self._stage(sum(sizes))
        except RuntimeError as exc:  # torch.OutOfMemoryError is one: the caller falls back to TCP
            self.comm.abort()
            raise NcclError(f"staging {sum(sizes)} bytes on {self.comm.device} failed: {exc}") from None
        views, offset = [], 0
        for size in sizes:
            views.append(staging[offset : offset + size])
            offset += size
        self.comm.recv([v for v in views if v.numel()], timeout_s)
        return views

    def cancel(self) -> None:
        self.comm.abort_requested = True  # the transfer thread's polling loop stops and aborts

    def abort(self) -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.close()


class NcclTransport:
    """Pairs over libnccl on one CUDA device (``nccl_channel.available()`` must be true)."""

    kind = "nccl"

    def __init__(self, device: str | torch.device = "cuda:0") -> None:
        from nccl_channel.library import load_library

        self.device = torch.device(device)
        self.lib = load_library()

    def prepare(self) -> tuple[bytes, Any]:
        return self.lib.unique_id().to_bytes(), None

    def join(self, unique_id: bytes, rank: int, state: Any, timeout_s: float) -> Link:
        from nccl_channel.communicator import PairCommunicator
        from nccl_channel.library import NcclUniqueId

        comm = PairCommunicator.create(self.lib, NcclUniqueId.from_bytes(unique_id), rank, 2, self.device, timeout_s)
        return NcclLink(comm)

    def discard(self, state: Any) -> None:
        pass
