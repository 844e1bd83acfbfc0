"""Shared-memory arena that holds a node's DRAM tier, so same-host clients read without a socket.

The arena is one file in ``/dev/shm`` (tmpfs), mapped by the node read-write and by
clients on the same host read-only. A same-host GET becomes: the node answers with
each chunk's offset and a *lease* (``backend.node.store.leases``), the client copies from
its mapping straight into LMCache's buffer, verifies the checksum, and releases the
lease. Chunks are immutable, so the only hazard is the node reusing a region while a
client still copies from it; that cannot happen because a region is freed only when
the tier no longer holds it *and* no view of it is left (a lease holds one).

Layout: a 4 KiB header (magic, a random token that the node also publishes in the
registry, the arena size), then the chunk regions. The file is sized up front but
its pages are allocated in steps (``posix_fallocate``), only as regions are first
needed: an idle node costs no memory, and a full ``/dev/shm`` is an allocation that
fails cleanly (the chunk then lives in private memory and is served over TCP) rather
than a SIGBUS on first touch.

How the pages come (in steps as the arena is used, grown ahead by a thread, or all
at start with ``--prefault``) and the free list of page-aligned regions are
``pages.py``'s (:class:`~backend.node.memory.pages.PageSpace`). A node without shared memory
keeps DRAM in a :class:`PrivateArena` (anonymous memory, the same allocator), so freed
regions keep their pages; without ``--prefault`` its pages come from the kernel as
chunks are first written there.

A chunk larger than 2 KiB takes a region of whole pages; a chunk of at most
2 KiB takes a cell of a page shared with chunks of its size class instead
(``cells.py``). Every chunk is counted at what it occupies (:func:`room_of`): its cell,
or its region rounded up to pages; the DRAM tier counts the same, so ``--dram`` bounds
what the arena holds for the tier.

Who may free a region: a buffer from :meth:`Arena.alloc` is *unowned* (freed when its
last view is dropped) until the DRAM tier adopts it (:meth:`Arena.adopt`); from then
on the tier holds it by its offset alone, with no object per chunk, hands out views
of it (:meth:`Arena.view`), and gives it up with :meth:`Arena.disown`, which frees it
at once, or once the last view still out (a reply being sent, a lease) is dropped.
A view's end is seen through a weak reference to the array behind it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import mmap
import os
import secrets
import weakref
from pathlib import Path

import numpy as np

from backend.node.memory.cells import SMALL_MAX_BYTES, Cells, cell_room
from backend.node.memory.pages import ALIGN_BYTES, PageSpace, align, memory_available_bytes
from backend.protocol.reports import ArenaReport
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

__all__ = ["Arena", "PrivateArena", "ShmArena", "remove_stale_arenas", "room_of"]

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python's mmap names it from 3.12


def room_of(nbytes: int) -> int:
    """What a chunk of ``nbytes`` occupies in the arena, and is counted at in the DRAM tier: its cell
    (at most SMALL_MAX_BYTES, ``cells.py``), or its region of whole pages."""
    return cell_room(nbytes) if nbytes <= SMALL_MAX_BYTES else align(nbytes)


class _ViewRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to the array behind a view of a region, naming the region."""

    __slots__ = ("offset",)
    offset: int


class Arena(PageSpace):
    """Chunk buffers inside one mapping: who holds each region (the DRAM tier, views of it), and small cells."""

    def __init__(self, mapping: mmap.mmap, size_bytes: int) -> None:
        super().__init__(mapping, size_bytes)
        self._cells = Cells(
            (HEADER_BYTES + size_bytes) // ALIGN_BYTES,
            take_page=lambda: self._alloc_region(ALIGN_BYTES),
            give_page=lambda start: self._release_region(start, ALIGN_BYTES),
        )
        # Views may be dropped on any thread, and even inside alloc() while the lock is held (a
        # garbage collection triggered there): their weak references' callback only queues the
        # reference; the allocator counts it off under its lock.
        self._gone: collections.deque[_ViewRef] = collections.deque()
        self._watched: dict[int, _ViewRef] = {}  # id -> a weak reference to each live view's array
        self._views: dict[int, int] = {}  # offset -> views of that region still alive (only regions with some)
        self._unowned: dict[
            int, int
        ] = {}  # offset -> nbytes: regions the tier does not hold (freed with their last view)
        self.allocated_bytes = 0
        self.allocations = 0
        self.fallbacks = 0  # allocations the arena could not serve (caller used private memory)

    # -- allocation -------------------------------------------------------------------
    def alloc(self, nbytes: int) -> memoryview | None:
        """A writable buffer of exactly ``nbytes`` inside the arena, or None if there is no room.

        The region is freed when the buffer (and every view of it) is dropped, unless the DRAM
        tier adopts it first (:meth:`adopt`).
        """
        with self._lock:
            self._count_gone_views()
            if nbytes <= SMALL_MAX_BYTES:
                start = self._cells.alloc(nbytes)
            else:
                start = self._alloc_region(align(nbytes))
            if start is None:
                self.fallbacks += 1
                return None
            self.allocated_bytes += room_of(nbytes)
            self.allocations += 1
            self._unowned[start] = nbytes
            return self._view(start, nbytes)

    def adopt(self, buffer: memoryview) -> int | None:
        """The DRAM tier keeps ``buffer``'s region (from :meth:`alloc`) by its offset, returned; None when
        ``buffer`` is not a whole region of this arena that nothing holds yet (the tier then keeps the buffer)."""
        offset = self.offset_of(buffer)
        if offset is None:
            return None
        with self._lock:
            if self._unowned.get(offset) != len(buffer):
                return None
            del self._unowned[offset]
        return offset

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A view of the adopted region at ``offset``: the region outlives the tier's hold while the view lives.

        The views' records are only ever touched on the node's event loop (the lock guards the free
        lists, which the grower thread shares): the lock is taken only to count off dropped views, which
        a node that only serves reads must do too.
        """
        if self._gone:
            with self._lock:
                self._count_gone_views()
        return self._view(offset, nbytes)

    def disown(self, offset: int, nbytes: int) -> None:
        """The tier no longer holds the region at ``offset``: freed now, or when its last view is dropped."""
        with self._lock:
            self._count_gone_views()
            if offset in self._views:
                self._unowned[offset] = nbytes
            else:
                self._free_region(offset, nbytes)

    def offset_of(self, view: memoryview) -> int | None:
        """Where ``view`` starts in the arena file, or None if it is not an arena buffer."""
        with contextlib.suppress(ValueError, TypeError):
            offset = _address_of(view) - self._base_address
            if HEADER_BYTES <= offset and offset + len(view) <= HEADER_BYTES + self.size_bytes:
                return offset
        return None

    def _view(self, offset: int, nbytes: int) -> memoryview:
        """A new view of a region, counted until it is dropped. Event loop only."""
        owner = self._array[offset : offset + nbytes]  # a fresh array: its end is the view's end
        ref = _ViewRef(owner, self._gone.append)
        ref.offset = offset
        self._watched[id(ref)] = ref
        self._views[offset] = self._views.get(offset, 0) + 1
        return owner.data

    def _count_gone_views(self) -> None:
        """Count off the views dropped since; free the unowned regions they were the last of. Caller holds the lock."""
        while self._gone:
            ref = self._gone.popleft()
            del self._watched[id(ref)]
            offset = ref.offset
            left = self._views[offset] - 1
            if left:
                self._views[offset] = left
                continue
            del self._views[offset]
            nbytes = self._unowned.pop(offset, None)
            if nbytes is not None:
                self._free_region(offset, nbytes)

    def _free_region(self, offset: int, nbytes: int) -> None:
        self.allocated_bytes -= room_of(nbytes)
        if self._cells.owns(offset):
            self._cells.free(offset)
        else:
            self._release_region(offset, align(nbytes))

    def report(self) -> ArenaReport:
        """What STAT carries of the arena."""
        with self._lock:
            self._count_gone_views()
        return ArenaReport(
            path=self._where(),
            size_bytes=self.size_bytes,
            grown_bytes=self.grown_bytes,
            allocated_bytes=self.allocated_bytes,
            fallbacks=self.fallbacks,
        )


class ShmArena(Arena):
    """The node side of the same-host path: the arena is one shared-memory file, published to clients."""

    def __init__(self, directory: Path, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise ValueError("arena size must be positive")
        size_bytes = align(size_bytes)
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
            memory = memory_available_bytes()
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
    """DRAM in anonymous memory, for a node without a shared-memory arena: chunks are read over TCP, and
    freed regions are reused with their pages, which stay mapped.

    With ``populate`` (a node that prefaults) pages are taken in steps as in a shared arena;
    without, the whole range is reserved (no memory yet) and the kernel gives each page when
    a chunk is first written there, as it would for a private buffer.
    """

    def __init__(self, size_bytes: int, *, populate: bool = True) -> None:
        if size_bytes <= 0:
            raise ValueError("arena size must be positive")
        size_bytes = align(size_bytes)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (0 if populate else MAP_NORESERVE)
        mapping = mmap.mmap(-1, HEADER_BYTES + size_bytes, flags=flags)
        self.populate = populate
        self.grows_ahead = populate
        super().__init__(mapping, size_bytes)

    def _back(self, start: int, step: int) -> None:
        if not self.populate:
            return  # the pages come at first write
        if madvise(self._base_address + start, step, MADV_POPULATE_WRITE) != 0:
            code = ctypes.get_errno()
            if code != errno.EINVAL:  # EINVAL: a kernel before 5.14, the pages come at first write
                raise OSError(code, os.strerror(code))

    def _where(self) -> str:
        return "private memory"

    def _available_bytes(self) -> int | None:
        return memory_available_bytes()


def _address_of(view: memoryview) -> int:
    """Where ``view``'s bytes start in memory (ValueError or TypeError if it has none to give)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))  # writable and not empty: the quick way
    except (TypeError, ValueError):
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


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
