"""Chunk buffers for the DRAM tier, pre-faulted off the event loop.

On the machines we run on, touching fresh memory costs about 1 GB/s (a page fault
per 4 KiB page), while writing memory that is already mapped runs above 10 GB/s.
``bytearray(n)`` faults and zeroes every page on the event loop before the first
byte is received, and that was most of a node's time on the put path. The factory
below hands out *uninitialised* buffers (``numpy.empty``) that a worker thread has
already touched; ``ctypes.memset`` drops the GIL, so the faulting runs on the other
core while the event loop receives. When no ready buffer fits, the caller gets a
fresh one and faults it inline, as before.

The pool of ready buffers is bounded (``budget_bytes``) and only holds sizes that
were asked for recently; it is memory on top of the DRAM tier's capacity.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict, deque

import numpy as np

__all__ = ["BufferFactory", "ChunkBuffer"]

ChunkBuffer = memoryview  # a flat byte view (of a numpy array that it keeps alive)
RECENT_SIZES = 4  # distinct chunk sizes kept warm (full chunks, plus a few partial ones)
BUFFERS_PER_SIZE = 8


class BufferFactory:
    """Hands out uninitialised byte buffers, pre-faulted by a worker thread."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._ready: dict[int, deque[ChunkBuffer]] = {}
        self._ready_bytes = 0
        self._sizes: OrderedDict[int, None] = OrderedDict()  # recently requested, newest last
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self.hits = 0
        self.misses = 0
        self._thread: threading.Thread | None = None
        if budget_bytes > 0:
            self._thread = threading.Thread(target=self._fill, name="kvpool-prefault", daemon=True)
            self._thread.start()

    def take(self, nbytes: int) -> ChunkBuffer:
        """A buffer of exactly ``nbytes`` (contents undefined: the caller overwrites all of it)."""
        with self._lock:
            ready = self._ready.get(nbytes)
            buffer = ready.popleft() if ready else None
            if buffer is not None:
                self._ready_bytes -= nbytes
            self._sizes[nbytes] = None
            self._sizes.move_to_end(nbytes)
            while len(self._sizes) > RECENT_SIZES:
                old, _ = self._sizes.popitem(last=False)
                self._ready_bytes -= old * len(self._ready.pop(old, ()))
        self._wake.set()
        if buffer is not None:
            self.hits += 1
            return buffer
        self.misses += 1
        return np.empty(nbytes, dtype=np.uint8).data

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _next_size(self) -> int | None:
        with self._lock:
            for size in reversed(self._sizes):  # newest first
                have = len(self._ready.get(size, ()))
                if have < BUFFERS_PER_SIZE and self._ready_bytes + size <= self.budget_bytes:
                    return size
        return None

    def _fill(self) -> None:
        while not self._closed:
            size = self._next_size()
            if size is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            array = np.empty(size, dtype=np.uint8)
            ctypes.memset(array.ctypes.data, 0, size)  # faults every page, without the GIL
            with self._lock:
                if size in self._sizes:
                    self._ready.setdefault(size, deque()).append(array.data)
                    self._ready_bytes += size
