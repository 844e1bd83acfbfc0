"""Shared-memory arena that holds a node's DRAM tier, so same-host clients read without a socket.

The arena is one file in ``/dev/shm`` (tmpfs), mapped by the node read-write and by
clients on the same host read-only. A same-host GET becomes: the node answers with
each chunk's offset and a *lease* (``backend.node.leases``), the client copies from
its mapping straight into LMCache's buffer, verifies the checksum, and releases the
lease. Chunks are immutable, so the only hazard is the node reusing a region while a
client still copies from it; that cannot happen because a region is freed only when
the last reference to its buffer is gone, and a lease holds one.

Layout: a 4 KiB header (magic, a random token that the node also publishes in the
registry, the arena size), then the chunk regions. The file is sized up front but
its pages are allocated in steps (``posix_fallocate``), only as regions are first
needed: an idle node costs no memory, and a full ``/dev/shm`` is an allocation that
fails cleanly (the chunk then lives in private memory and is served over TCP) rather
than a SIGBUS on first touch.

Taking pages costs about 1 GB/s here (the kernel zeroes each one), so once the arena
is in use a grower thread keeps ``GROW_AHEAD_BYTES`` of pages ready past the last
allocation, off the event loop (``posix_fallocate`` and a ctypes ``madvise`` both
run without the GIL) and at the lowest CPU priority, so that during a burst of puts
it does not take the core the event loop needs. An allocation that still finds no room grows inline, after
waiting for a step the thread has under way.

A node started with ``--prefault`` (the default) takes every step at start instead
(:meth:`Arena.prefault`, on a worker thread, before the node registers), up to what
the directory and the machine can give; the grower then has nothing left to do. A
prefaulting node without shared memory keeps DRAM in a :class:`PrivateArena`
(anonymous memory, the same allocator), so freed regions keep their pages.

Allocation is first-fit over an offset-ordered free list with coalescing; chunks are
mostly of one size, so the list stays short. A region is returned to the list by a
finalizer on the numpy array behind the chunk's memoryview, which runs when the
last view of it (tier, lease, a reply still being sent) is dropped.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import secrets
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from backend.protocol import ArenaReport
from backend.shm import (
    ARENA_MAGIC,
    ARENA_SUFFIX,
    FILE_PREFIX,
    HEADER,
    HEADER_BYTES,
    MADV_POPULATE_WRITE,
    madvise,
    pid_alive,
    remove_abandoned_stages,
)

__all__ = ["Arena", "PrivateArena", "ShmArena", "remove_stale_arenas"]

logger = logging.getLogger(__name__)

ALIGN_BYTES = 4096  # page-aligned regions: memcpy at full speed, no false sharing
GROW_STEP_BYTES = 64 * 1024 * 1024
GROW_AHEAD_BYTES = 256 * 1024 * 1024  # free room kept ready at the grown end, once the arena is in use
GROWER_NICE = 19  # the grower runs when the node's loop and its clients leave a core idle
GROW_RETRY_S = 5.0  # after /dev/shm refused pages, do not ask again for this long
# A prefault leaves this much of the machine's available memory (MemAvailable) untaken: past it the
# kernel would not refuse pages cleanly but reclaim the page cache and then call the OOM killer.
PREFAULT_KEEP_FREE_BYTES = 512 * 1024 * 1024


def _align(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class Arena:
    """Allocates chunk buffers inside one mapping, taking its pages as needed (or all at once: prefault).

    The backing is a subclass's: :class:`ShmArena` (a shared-memory file clients on this
    host map) or :class:`PrivateArena` (anonymous memory, for a node without one).
    """

    def __init__(self, mapping: mmap.mmap, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self._map = mapping
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self._base_address = int(self._array.ctypes.data)
        self._lock = threading.Lock()
        # Finalizers may run on any thread, and even inside alloc() while the lock is held
        # (a garbage collection triggered there): they only queue the region; the
        # allocator takes it back under its lock.
        self._freed: collections.deque[tuple[int, int]] = collections.deque()
        self._free_starts: list[int] = []  # offset-ordered starts of free regions
        self._free_size: dict[int, int] = {}  # start -> size
        self._free_end: dict[int, int] = {}  # end -> start, to coalesce with the left neighbour
        self._grown = HEADER_BYTES  # pages below this offset exist in /dev/shm
        self._refused_at = 0.0
        self._growing = False  # the grower thread is adding pages at _grown (outside the lock)
        self._grow_done = threading.Condition(self._lock)
        self._wake_grower = threading.Event()
        self._closed = False
        self._grower = threading.Thread(target=self._grow_ahead, name="kvpool-arena-grow", daemon=True)
        self._grower.start()
        self.allocated_bytes = 0
        self.allocations = 0
        self.fallbacks = 0  # allocations the arena could not serve (caller used private memory)

    # -- allocation -------------------------------------------------------------------
    def alloc(self, nbytes: int) -> memoryview | None:
        """A writable buffer of exactly ``nbytes`` inside the arena, or None if there is no room."""
        need = _align(max(nbytes, 1))
        with self._lock:
            self._take_back_freed()
            start = self._first_fit(need)
            if start is None and self._grow(need):
                start = self._first_fit(need)
            if start is None:
                self.fallbacks += 1
                return None
            self._take(start, need)
            self.allocated_bytes += need
            self.allocations += 1
            if self._tail_room() < GROW_AHEAD_BYTES and self._grown < HEADER_BYTES + self.size_bytes:
                self._wake_grower.set()
        array = self._array[start : start + nbytes]
        owner = np.frombuffer(array, dtype=np.uint8)  # a fresh object the finalizer can watch
        finalizer = weakref.finalize(owner, self._free, start, need)
        finalizer.atexit = False
        return owner.data

    def offset_of(self, view: memoryview) -> int | None:
        """Where ``view`` starts in the arena file, or None if it is not an arena buffer."""
        with contextlib.suppress(ValueError, TypeError):
            address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
            offset = address - self._base_address
            if HEADER_BYTES <= offset and offset + len(view) <= HEADER_BYTES + self.size_bytes:
                return offset
        return None

    def _first_fit(self, need: int) -> int | None:
        for start in self._free_starts:
            if self._free_size[start] >= need:
                return start
        return None

    def _take(self, start: int, need: int) -> None:
        size = self._remove_free(start)
        if size > need:
            self._add_free(start + need, size - need)

    def _free(self, start: int, size: int) -> None:
        self._freed.append((start, size))  # deque.append is atomic; no lock here (see __init__)

    def _take_back_freed(self) -> None:
        """Return queued regions to the free list. Caller holds the lock."""
        while self._freed:
            start, size = self._freed.popleft()
            self.allocated_bytes -= size
            self._release_region(start, size)

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
        """Allocate more pages at the end of the grown part; False if none can be had. Caller holds the lock."""
        while self._growing:  # the grower thread's step may be all that is needed
            self._grow_done.wait(timeout=1.0)
        if self._first_fit(need) is not None:
            return True
        end = HEADER_BYTES + self.size_bytes
        if self._grown >= end or time.monotonic() - self._refused_at < GROW_RETRY_S:
            return False
        step = min(max(GROW_STEP_BYTES, _align(need - self._tail_room())), end - self._grown)
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
                or (ahead_only and self._tail_room() >= GROW_AHEAD_BYTES)
                or time.monotonic() - self._refused_at < GROW_RETRY_S
            ):
                return False
            start, step = self._grown, min(GROW_STEP_BYTES, end - self._grown)
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

    def report(self) -> ArenaReport:
        """What STAT carries of the arena."""
        with self._lock:
            self._take_back_freed()
        return ArenaReport(
            path=self._where(),
            size_bytes=self.size_bytes,
            grown_bytes=self.grown_bytes,
            allocated_bytes=self.allocated_bytes,
            fallbacks=self.fallbacks,
        )

    def close(self) -> None:
        """Stop the grower. Buffers still held keep the mapping alive until they are dropped."""
        self._closed = True
        self._wake_grower.set()
        self._grower.join(timeout=5.0)


class ShmArena(Arena):
    """The node side of the same-host path: the arena is one shared-memory file, published to clients."""

    def __init__(self, directory: Path, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise ValueError("arena size must be positive")
        size_bytes = _align(size_bytes)
        self.token = secrets.token_hex(16)
        self.path = Path(directory) / f"{FILE_PREFIX}{os.getpid()}-{self.token[:8]}{ARENA_SUFFIX}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + size_bytes)
            os.posix_fallocate(fd, 0, HEADER_BYTES)
            mapping = mmap.mmap(fd, HEADER_BYTES + size_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        self._fd = fd
        mapping[:HEADER_BYTES] = HEADER.pack(ARENA_MAGIC, self.token.encode(), size_bytes).ljust(HEADER_BYTES, b"\0")
        super().__init__(mapping, size_bytes)

    def _back(self, start: int, step: int) -> None:
        # posix_fallocate first: a full /dev/shm is then an error here, never a SIGBUS on a write.
        os.posix_fallocate(self._fd, start, step)
        # Map the pages now rather than one fault at a time on first write (Linux >= 5.14).
        madvise(self._base_address + start, step, MADV_POPULATE_WRITE)

    def _where(self) -> str:
        return str(self.path)

    def _available_bytes(self) -> int | None:
        with contextlib.suppress(OSError):
            info = os.statvfs(self.path.parent)
            memory = _memory_available_bytes()
            return min(info.f_bavail * info.f_frsize, memory if memory is not None else 1 << 62)
        return None

    def close(self) -> None:
        """Remove the file. Clients that mapped it keep their mapping until they drop it."""
        super().close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self._fd)


class PrivateArena(Arena):
    """DRAM in anonymous memory, for a node without a shared-memory arena that prefaults: chunks are
    read over TCP as before, but freed regions are reused with their pages, which stay mapped."""

    def __init__(self, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise ValueError("arena size must be positive")
        size_bytes = _align(size_bytes)
        mapping = mmap.mmap(-1, HEADER_BYTES + size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        super().__init__(mapping, size_bytes)

    def _back(self, start: int, step: int) -> None:
        if madvise(self._base_address + start, step, MADV_POPULATE_WRITE) != 0:
            code = ctypes.get_errno()
            if code != errno.EINVAL:  # EINVAL: a kernel before 5.14, the pages come at first write
                raise OSError(code, os.strerror(code))

    def _where(self) -> str:
        return "private memory"

    def _available_bytes(self) -> int | None:
        return _memory_available_bytes()


def _memory_available_bytes() -> int | None:
    """What a prefault may take of the machine's memory: MemAvailable (Linux) less PREFAULT_KEEP_FREE_BYTES."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 - PREFAULT_KEEP_FREE_BYTES
    return None


def remove_stale_arenas(directory: Path) -> int:
    """Delete the arenas of nodes whose processes no longer exist (killed without cleanup), and
    the put stages no live client holds (``backend.shm.remove_abandoned_stages``)."""
    removed = remove_abandoned_stages(directory)
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            name = entry.name
            if not (name.startswith(FILE_PREFIX) and name.endswith(ARENA_SUFFIX)):
                continue
            pid_text = name[len(FILE_PREFIX) :].split("-", 1)[0]
            if not pid_text.isdigit() or pid_alive(int(pid_text)):
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed += 1
    return removed
