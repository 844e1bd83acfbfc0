"""Small chunks packed in the arena: 4 KiB pages cut into equal cells, one size class per page.

The arena hands out page-aligned regions, so a chunk of a few bytes would take a whole
4 KiB page: a tier of tiny chunks (LMCache's layerwise keys, tests that fill a node fast)
would fill the arena at 1/64 of its size and spill the rest into private buffers that
cost more bookkeeping than the chunk. So a chunk of at most :data:`SMALL_MAX_BYTES` takes
a *cell* instead: each page of small chunks holds cells of one size (64 B to 2 KiB, all
multiples of 64, so no two cells share a cache line), and a chunk is counted at the
page's size divided by its cells (:func:`cell_room`), which is what it really keeps from
other chunks.

Every operation is O(1): a page's free cells are one 64-bit mask, the pages of a class
with a free cell are a doubly linked list threaded through per-page arrays, and a page
whose cells are all free goes back to the arena at once. The per-page arrays live in
anonymous memory the kernel gives only where it is written: 17 bytes per arena page
(0.4 % of the arena) at most, and nothing for pages that never held a small chunk.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Literal

__all__ = ["CELL_BYTES", "PAGE_BYTES", "SMALL_MAX_BYTES", "Cells", "cell_room"]

PAGE_BYTES = 4096
CELL_BYTES = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 1024, 1344, 2048)
SMALL_MAX_BYTES = CELL_BYTES[-1]
_UNIT = 64
_CELLS_PER_PAGE = tuple(PAGE_BYTES // size for size in CELL_BYTES)
_FULL_MASK = tuple((1 << cells) - 1 for cells in _CELLS_PER_PAGE)
_ROOM = tuple(PAGE_BYTES // cells for cells in _CELLS_PER_PAGE)
# The class of a chunk by its size in 64-byte units (0 bytes takes the smallest cell).
_CLASS_BY_UNITS = tuple(
    next(c for c, size in enumerate(CELL_BYTES) if size >= max(units, 1) * _UNIT)
    for units in range(SMALL_MAX_BYTES // _UNIT + 1)
)
_NONE = 0  # page 0 is the arena's header, never a page of cells: 0 ends a list


def _class_of(nbytes: int) -> int:
    return _CLASS_BY_UNITS[(nbytes + _UNIT - 1) // _UNIT]


def cell_room(nbytes: int) -> int:
    """What a chunk of ``nbytes`` (at most SMALL_MAX_BYTES) occupies: its page's size over the page's cells."""
    return _ROOM[_class_of(nbytes)]


def _lazy_array(count: int, code: Literal["B", "I", "Q"], itemsize: int) -> memoryview[int]:
    """A zeroed array of ``count`` items whose pages the kernel gives only when written."""
    return memoryview(mmap.mmap(-1, max(count, 1) * itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)).cast(code)


class Cells:
    """The arena's pages of small-chunk cells. The caller (the arena) holds its lock around every call."""

    def __init__(self, pages: int, take_page: Callable[[], int | None], give_page: Callable[[int], None]) -> None:
        self._take_page = take_page  # a free page's offset from the arena, or None
        self._give_page = give_page
        self._class = _lazy_array(pages, "B", 1)  # per page: its size class + 1; 0: not a page of cells
        self._free = _lazy_array(pages, "Q", 8)  # per page: a bit per free cell
        self._prev = _lazy_array(pages, "I", 4)  # per page: neighbours in its class's list of pages
        self._next = _lazy_array(pages, "I", 4)  # with a free cell (_NONE ends it)
        self._partial = [_NONE] * len(CELL_BYTES)  # per class: the first page with a free cell
        self.pages = 0  # pages holding cells now

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free cell for ``nbytes``, or None if the arena has no page for a new one."""
        c = _class_of(nbytes)
        page = self._partial[c]
        if page == _NONE:
            offset = self._take_page()
            if offset is None:
                return None
            page = offset // PAGE_BYTES
            self._class[page] = c + 1
            self._free[page] = _FULL_MASK[c]
            self._link(c, page)
            self.pages += 1
        mask = self._free[page]
        cell = (mask & -mask).bit_length() - 1
        mask &= mask - 1
        self._free[page] = mask
        if not mask:
            self._unlink(c, page)  # full: no longer offered
        return page * PAGE_BYTES + cell * CELL_BYTES[c]

    def owns(self, offset: int) -> bool:
        """Whether ``offset`` is in a page of cells (else it is a region of whole pages)."""
        return self._class[offset // PAGE_BYTES] != 0

    def free(self, offset: int) -> None:
        """Give back the cell at ``offset``; its page goes back to the arena once all its cells are free."""
        page, within = divmod(offset, PAGE_BYTES)
        c = self._class[page] - 1
        mask = self._free[page]
        if not mask:
            self._link(c, page)  # was full: offered again
        mask |= 1 << (within // CELL_BYTES[c])
        if mask == _FULL_MASK[c]:
            self._unlink(c, page)
            self._class[page] = 0
            self._free[page] = 0
            self.pages -= 1
            self._give_page(page * PAGE_BYTES)
        else:
            self._free[page] = mask

    def _link(self, c: int, page: int) -> None:
        head = self._partial[c]
        self._prev[page] = _NONE
        self._next[page] = head
        if head != _NONE:
            self._prev[head] = page
        self._partial[c] = page

    def _unlink(self, c: int, page: int) -> None:
        before, after = self._prev[page], self._next[page]
        if before != _NONE:
            self._next[before] = after
        else:
            self._partial[c] = after
        if after != _NONE:
            self._prev[after] = before
        self._prev[page] = self._next[page] = _NONE
