"""Host memory the GPU copies from and into at full speed: registered regions, pinned bounce slots.

A copy between the GPU and pageable host memory runs at 8-15 GB/s and blocks the
CPU; from page-locked (pinned) memory it runs at PCIe speed (50+ GB/s on an H200)
and is asynchronous. A node's chunks live in its DRAM arena (one mmap): registering
that mapping once with ``cudaHostRegister`` makes every chunk in it pinned;
:class:`HostRegistry` keeps the registered ranges and unregisters them on close.
Chunks anywhere else go through a pinned bounce slot of the :class:`StagingRing`
(one CPU copy, overlapped with the GPU work of the chunks around it).
"""

from __future__ import annotations

import bisect
import logging
import threading

import torch

from backend.errors import NcclError

__all__ = ["HostRegistry", "StagingRing", "address_of", "is_pinned"]

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: page-locked; device-visible at the same address (UVA)


def address_of(view: memoryview) -> int:
    """The address of a host buffer's first byte."""
    return int(torch.frombuffer(view, dtype=torch.uint8).data_ptr()) if len(view) else 0


def is_pinned(view: memoryview) -> bool:
    """Whether CUDA knows ``view`` as page-locked (allocated pinned, or registered)."""
    return bool(len(view)) and bool(torch.frombuffer(view, dtype=torch.uint8).is_pinned())


class HostRegistry:
    """Host ranges registered with CUDA, each once; :meth:`contains` says whether a buffer lies in one."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}
        self._keep: dict[int, memoryview] = {}  # a registered mapping must outlive its registration
        self._lock = threading.Lock()

    def register(self, memory: memoryview) -> bool:
        """Register ``memory`` (a whole mapping) once; False, logged, if CUDA refuses (copies then bounce)."""
        view = memoryview(memory).cast("B")
        start, nbytes = address_of(view), len(view)
        with self._lock:
            if not nbytes or self._find(start, nbytes):
                return True
            error = torch.cuda.cudart().cudaHostRegister(start, nbytes, CUDA_HOST_REGISTER_DEFAULT)
            if int(error) != 0:
                logger.warning(
                    "channel: cudaHostRegister of %d bytes failed (cudaError %d); staging through "
                    "pinned bounce buffers instead",
                    nbytes,
                    int(error),
                )
                return False
            bisect.insort(self._starts, start)
            self._ends[start] = start + nbytes
            self._keep[start] = view
        return True

    def _find(self, address: int, nbytes: int) -> bool:
        at = bisect.bisect_right(self._starts, address) - 1
        return at >= 0 and address + nbytes <= self._ends[self._starts[at]]

    def contains(self, view: memoryview) -> bool:
        with self._lock:
            return bool(len(view)) and self._find(address_of(view), len(view))

    def close(self) -> None:
        """Unregister every range (once no copy uses them: the caller's links are closed)."""
        with self._lock:
            for start in self._starts:
                error = torch.cuda.cudart().cudaHostUnregister(start)
                if int(error) != 0:
                    logger.warning("channel: cudaHostUnregister failed (cudaError %d)", int(error))
            self._starts.clear()
            self._ends.clear()
            self._keep.clear()


class StagingRing:
    """``depth`` slots of ``slot_bytes`` on the device, each with a pinned host bounce buffer made on first use."""

    def __init__(self, device: torch.device, depth: int, slot_bytes: int) -> None:
        try:
            self.device_slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(depth)]
        except RuntimeError as exc:  # torch.OutOfMemoryError is one: the caller falls back to TCP
            raise NcclError(f"a staging ring of {depth} x {slot_bytes} bytes on {device} failed: {exc}") from None
        self.depth = depth
        self.slot_bytes = slot_bytes
        self._bounce: list[torch.Tensor | None] = [None] * depth

    def bounce(self, slot: int) -> torch.Tensor:
        buffer = self._bounce[slot]
        if buffer is None:
            try:
                buffer = self._bounce[slot] = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                raise NcclError(f"a pinned bounce buffer of {self.slot_bytes} bytes failed: {exc}") from None
        return buffer
