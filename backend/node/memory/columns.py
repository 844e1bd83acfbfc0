"""Per-slot columns: typed arrays in anonymous memory of their own, grown by doubling into a new mapping.

A node's bookkeeping keeps one machine integer per chunk per field (``bookkeeping.py``).
Held in ``array.array`` or a list, a million-chunk column is one 8 MB heap block that is
copied to a larger block each time it grows, and the heap keeps the old blocks' holes,
which smaller objects then pin: resident memory that no structure accounts for. A
column here is a ``memoryview`` cast over an ``mmap`` of its own: growing it maps a new
region, copies, and drops the old one, which goes back to the kernel at once. Pages are
zero until written and cost nothing until then. Indexing a memoryview is as fast as
indexing an ``array.array`` (both return and take plain ints).

Whoever grows a column replaces their reference to it: a caller never keeps a column in
a local across a call that may add a slot.
"""

from __future__ import annotations

import mmap
from array import array
from typing import Literal

__all__ = ["Code", "column", "grown"]

Code = Literal["B", "H", "I", "i", "Q", "q"]
_ITEM_BYTES = {"B": 1, "H": 2, "I": 4, "i": 4, "Q": 8, "q": 8}
MIN_ITEMS = 1024
_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # this process's own, zero until written


def column(code: Code, items: int = MIN_ITEMS, fill: int = 0) -> memoryview[int]:
    """A column of ``items`` (at least MIN_ITEMS) integers of type ``code``, each ``fill``."""
    items = max(items, MIN_ITEMS)
    view = memoryview(mmap.mmap(-1, items * _ITEM_BYTES[code], flags=_PRIVATE)).cast(code)
    if fill:
        view[:] = array(code, [fill]) * items
    return view


def grown(old: memoryview[int], items: int, fill: int = 0) -> memoryview[int]:
    """``old`` with room for at least ``items`` (twice its length, or more): a new column holding its values,
    the rest ``fill``. ``old`` is released once its holders drop it."""
    if items <= len(old):
        return old
    code: Code = old.format  # type: ignore[assignment]
    new = column(code, max(items, 2 * len(old)))
    new[: len(old)] = old
    if fill:
        new[len(old) :] = array(code, [fill]) * (len(new) - len(old))
    return new
