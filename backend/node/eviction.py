"""Which chunk of a tier leaves first: an eviction order, behind a small interface.

A tier (``dram.py``, ``nvme_tier.py``) tells its order when a chunk enters, leaves or
is read, and walks it from the coldest chunk when it needs room. Chunks that must not
move (pinned by a lease, or landing: a put in flight) are taken out of the order while
they are pinned and put back when they are not, so the walk never passes over them:
finding a victim costs O(1) however many chunks are pinned (``tiers.py``).

Every operation is O(1) and an order keeps no object per chunk: :class:`LruOrder` is a
doubly linked list threaded through two columns indexed by the chunk's slot
(``bookkeeping.ChunkTable``), 8 bytes a chunk. Another policy (one that evicts the tails
of cold prefix chains first, say) implements :class:`EvictionOrder` and is handed to
the tier in place of the LRU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from backend.node.columns import column, grown

__all__ = ["EvictionOrder", "LruOrder"]

_END = -1


class EvictionOrder(Protocol):
    """The order in which one tier's chunks (by slot) leave it."""

    def __len__(self) -> int: ...

    def add(self, slot: int) -> None:
        """A chunk entered the tier, or may move again (it was pinned)."""

    def remove(self, slot: int) -> None:
        """A chunk left the tier, or may not move for now (pinned)."""

    def touch(self, slot: int) -> None:
        """A chunk was read."""

    def coldest(self) -> Iterator[int]:
        """Slots from the first to leave on; valid until the order next changes."""


class LruOrder:
    """Least recently used first. Every operation O(1); 8 bytes per slot."""

    def __init__(self) -> None:
        self._prev = column("i", fill=_END)
        self._next = column("i", fill=_END)
        self._head = _END  # least recently used
        self._tail = _END  # most recently used
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, slot: int) -> None:
        if slot >= len(self._next):
            self._prev = grown(self._prev, slot + 1, _END)
            self._next = grown(self._next, slot + 1, _END)
        tail = self._tail
        self._prev[slot] = tail
        self._next[slot] = _END
        if tail == _END:
            self._head = slot
        else:
            self._next[tail] = slot
        self._tail = slot
        self._count += 1

    def remove(self, slot: int) -> None:
        before, after = self._prev[slot], self._next[slot]
        if before == _END:
            self._head = after
        else:
            self._next[before] = after
        if after == _END:
            self._tail = before
        else:
            self._prev[after] = before
        self._count -= 1

    def touch(self, slot: int) -> None:
        if slot != self._tail:
            self.remove(slot)
            self.add(slot)

    def coldest(self) -> Iterator[int]:
        slot = self._head
        while slot != _END:
            after = self._next[slot]
            yield slot
            slot = after
