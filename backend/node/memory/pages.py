"""The pages behind the DRAM arena: a mapping as page-aligned regions, and its pages taken as needed.

:class:`PageSpace` keeps the free list (first-fit over offset-ordered regions of whole
pages, with coalescing; chunks are mostly of one size, so the list stays short) and
decides when pages are taken. The arena (``arena.py``) is a :class:`PageSpace` that
also knows who holds each region; its backings (a shared-memory file, or private
memory) say how pages are taken (:meth:`PageSpace._back`).

The mapping is sized up front but its pages are allocated in steps, only as regions
are first needed: an idle node costs no memory, and pages refused (a full
``/dev/shm``) are an allocation that fails cleanly rather than a SIGBUS on first touch.

Taking pages costs about 1 GB/s here (the kernel zeroes each one), so once the arena
is in use a grower thread keeps ``GROW_AHEAD_BYTES`` of pages ready past the last
allocation, off the event loop (``posix_fallocate`` and a ctypes ``madvise`` both
run without the GIL) and at the lowest CPU priority, so that during a burst of puts
it does not take the core the event loop needs, in steps of ``GROWER_STEP_BYTES``. An
allocation that still finds no room (on the event loop, which also accepts and answers
every connection) waits for a step the thread has under way, then takes the pages it
lacks inline: never a whole 64 MiB step, never a wait for more than the grower's small one.

A node started with ``--prefault`` (the default) takes every step at start instead
(:meth:`PageSpace.prefault`, on a worker thread, before the node registers), up to what
the directory and the machine can give; the grower then has nothing left to do.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import mmap
import os
import threading
import time

import numpy as np

from backend.node.memory.cells import PAGE_BYTES
from backend.shm import HEADER_BYTES

__all__ = ["ALIGN_BYTES", "GROW_AHEAD_BYTES", "GROWER_STEP_BYTES", "PageSpace", "align", "memory_available_bytes"]

logger = logging.getLogger(__name__)

ALIGN_BYTES = PAGE_BYTES  # page-aligned regions: memcpy at full speed, no false sharing
GROW_STEP_BYTES = 64 * 1024 * 1024  # a prefault's step (on a worker thread, before the node serves)
# The grower's step: what an allocation that finds no room may wait for. The grower runs at the lowest CPU
# priority, so under load a step takes as long as the machine leaves it no core: a small one bounds that wait.
GROWER_STEP_BYTES = 4 * 1024 * 1024
GROW_AHEAD_BYTES = 256 * 1024 * 1024  # free room kept ready at the grown end, once the arena is in use
GROWER_NICE = 19  # the grower runs when the node's loop and its clients leave a core idle
GROW_RETRY_S = 5.0  # after /dev/shm refused pages, do not ask again for this long
# A prefault leaves this much of the machine's available memory (MemAvailable) untaken: past it the
# kernel would not refuse pages cleanly but reclaim the page cache and then call the OOM killer.
PREFAULT_KEEP_FREE_BYTES = 512 * 1024 * 1024


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class PageSpace:
    """The arena's mapping as page-aligned regions: a free list, and pages taken as needed (or all at once).

    The backing is a subclass's (``arena.py``): ``ShmArena`` (a shared-memory file clients on this
    host map) or ``PrivateArena`` (anonymous memory, for a node without one).
    """

    grows_ahead = True  # keep GROW_AHEAD_BYTES of pages ready once in use (False: the kernel gives them lazily)

    def __init__(self, mapping: mmap.mmap, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self._map = mapping
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self._base_address = int(self._array.ctypes.data)
        self._lock = threading.Lock()
        self._free_starts: list[int] = []  # offset-ordered starts of free regions
        self._free_size: dict[int, int] = {}  # start -> size
        self._free_end: dict[int, int] = {}  # end -> start, to coalesce with the left neighbour
        self._grown = HEADER_BYTES  # pages below this offset exist in /dev/shm
        self._refused_at = 0.0
        self._growing = False  # the grower thread is adding pages at _grown (outside the lock)
        self._waiting = 0  # allocations waiting for the grower's step (it then takes no further one until woken)
        self._grow_done = threading.Condition(self._lock)
        self._wake_grower = threading.Event()
        self._closed = False
        self._grower = threading.Thread(target=self._grow_ahead, name="kvpool-arena-grow", daemon=True)
        self._grower.start()

    def _alloc_region(self, need: int) -> int | None:
        """The start of a free region of ``need`` bytes (a multiple of pages), growing if needed. Caller holds
        the lock."""
        start = self._first_fit(need)
        if start is None and self._grow(need):
            start = self._first_fit(need)
        if start is None:
            return None
        self._take(start, need)
        end = HEADER_BYTES + self.size_bytes
        if self.grows_ahead and self._tail_room() < GROW_AHEAD_BYTES and self._grown < end:
            self._wake_grower.set()
        return start

    def _first_fit(self, need: int) -> int | None:
        for start in self._free_starts:
            if self._free_size[start] >= need:
                return start
        return None

    def _take(self, start: int, need: int) -> None:
        size = self._remove_free(start)
        if size > need:
            self._add_free(start + need, size - need)

    def _release_region(self, start: int, size: int) -> None:
        left = self._free_end.get(start)
        if left is not None:  # coalesce with the free region that ends where this starts
            size += self._remove_free(left)
            start = left
        if start + size in self._free_size:
            size += self._remove_free(start + size)
        self._add_free(start, size)

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free_size[start] = size
        self._free_end[start + size] = start

    def _remove_free(self, start: int) -> int:
        self._free_starts.pop(bisect.bisect_left(self._free_starts, start))
        size = self._free_size.pop(start)
        del self._free_end[start + size]
        return size

    def _tail_room(self) -> int:
        """Free bytes touching the grown end (what the next allocations can take without growing)."""
        tail = self._free_end.get(self._grown)
        return self._grown - tail if tail is not None else 0

    def _grow(self, need: int) -> bool:
        """Take the pages an allocation of ``need`` bytes lacks at the end of the grown part; False if none can
        be had. Caller holds the lock.

        The caller is the node's event loop (a put), which also accepts connections and answers every
        request, so it is held as little as can be: it takes only the pages it lacks, not a whole
        GROW_STEP_BYTES step (the kernel zeroes each page: a 64 MiB step held a node's loop 0.12-0.17 s on
        a loaded 2-core machine), and the grower step it may wait for is GROWER_STEP_BYTES.
        """
        self._waiting += 1  # the grower starts no further step meanwhile: this waits for one at most
        try:
            while self._growing:  # the grower thread's step may be all that is needed
                self._grow_done.wait(timeout=1.0)
        finally:
            self._waiting -= 1
        if self._first_fit(need) is not None:
            return True
        end = HEADER_BYTES + self.size_bytes
        if self._grown >= end or time.monotonic() - self._refused_at < GROW_RETRY_S:
            return False
        step = align(need - self._tail_room())
        if not self.grows_ahead:  # pages come at first write (``PrivateArena`` without populate): free to take
            step = max(GROW_STEP_BYTES, step)
        step = min(step, end - self._grown)
        if not self._take_pages(self._grown, step):
            return False
        self._release_region(self._grown, step)
        self._grown += step
        return True

    def _take_pages(self, start: int, step: int) -> bool:
        """Back ``[start, start + step)`` with pages; False (and no retry for a while) if they are refused."""
        try:
            self._back(start, step)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            self._refused_at = time.monotonic()
            logger.warning(
                "%s arena could not grow by %d bytes (%s); new chunks use private memory and are served over TCP",
                self._where(),
                step,
                exc.strerror,
            )
            return False
        return True

    def _back(self, start: int, step: int) -> None:
        """Take the pages of ``[start, start + step)``; OSError (ENOSPC, ENOMEM) if they cannot be had."""
        raise NotImplementedError

    def _where(self) -> str:
        raise NotImplementedError

    def _available_bytes(self) -> int | None:
        """How many more bytes the backing can give, where that is known."""
        return None

    def _grow_ahead(self) -> None:
        """Grower thread: keep GROW_AHEAD_BYTES of pages ready at the grown end, outside the lock."""
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread only, lowest priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GROWER_NICE)
        while True:
            self._wake_grower.wait()
            self._wake_grower.clear()
            while self._grow_step(ahead_only=True):
                pass
            if self._closed:
                return

    def prefault(self) -> int:
        """Take every page of the arena now (blocking: run it off the event loop); returns the bytes taken.

        Takes no more than the backing can give (``_available_bytes``) and stops, with a
        warning, where pages are refused: the rest is then taken as chunks arrive, as
        without a prefault, and chunks that find no room live in private memory.
        """
        end = HEADER_BYTES + self.size_bytes
        limit = end
        available = self._available_bytes()
        if available is not None and self._grown + available < end:
            limit = self._grown + max(available, 0) // ALIGN_BYTES * ALIGN_BYTES
            logger.warning(
                "%s arena: %d bytes to take at start, but only %d can be had there; taking those, "
                "the rest as chunks arrive",
                self._where(),
                end - self._grown,
                max(available, 0),
            )
        before = self._grown
        while self._grow_step(ahead_only=False, until=limit):
            pass
        return self._grown - before

    def _grow_step(self, *, ahead_only: bool, until: int = 0) -> bool:
        """Take one step of pages at the grown end, outside the lock; False when there is nothing to take
        (grown up to ``until``, by default the arena's end; enough room ahead with ``ahead_only``; closed;
        or pages refused lately)."""
        end = min(until, HEADER_BYTES + self.size_bytes) if until else HEADER_BYTES + self.size_bytes
        with self._lock:
            while self._growing and not ahead_only:  # prefault: let the grower's step finish first
                self._grow_done.wait(timeout=1.0)
            if (
                self._closed
                or self._growing
                or self._grown >= end
                or (ahead_only and (self._tail_room() >= GROW_AHEAD_BYTES or self._waiting > 0))
                or time.monotonic() - self._refused_at < GROW_RETRY_S
            ):
                return False
            start, step = self._grown, min(GROWER_STEP_BYTES if ahead_only else GROW_STEP_BYTES, end - self._grown)
            self._growing = True
        grown = False
        try:
            grown = self._take_pages(start, step)
        except OSError as exc:
            logger.warning("%s arena: growing failed: %s", self._where(), exc)
        finally:
            with self._lock:
                if grown:
                    self._release_region(start, step)
                    self._grown += step
                self._growing = False
                self._grow_done.notify_all()
        return grown

    @property
    def grown_bytes(self) -> int:
        return self._grown - HEADER_BYTES

    def close(self) -> None:
        """Stop the grower, after the step of pages under way if any (a prefault's, on a worker thread, when a
        start is abandoned): what backs the pages may be closed next. Buffers still held keep the mapping
        alive until they are dropped."""
        with self._lock:
            self._closed = True
            while self._growing:
                self._grow_done.wait(timeout=1.0)
        self._wake_grower.set()
        self._grower.join(timeout=5.0)


def memory_available_bytes() -> int | None:
    """What a prefault may take of the machine's memory: MemAvailable (Linux) less PREFAULT_KEEP_FREE_BYTES."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 - PREFAULT_KEEP_FREE_BYTES
    return None
