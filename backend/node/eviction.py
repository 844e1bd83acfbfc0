"""Which chunk of a tier leaves first: an eviction order, behind a small interface.

A tier (``dram.py``, ``nvme_tier.py``) tells its order when a chunk enters, leaves or
is read, and walks it from the coldest chunk when it needs room. Chunks that must not
move (pinned by a lease, or landing: a put in flight) are taken out of the walk while
they are pinned and put back when they are not, so the walk never passes over them:
finding a victim costs O(1) however many chunks are pinned (``tiers.py``).

Every operation is O(1) (amortised) and an order keeps no object per chunk: columns
indexed by the chunk's slot (``bookkeeping.ChunkTable``). Two orders, chosen by the
node's ``eviction`` setting (:data:`ORDERS`):

* :class:`LruOrder` (``lru``): least recently used first; a doubly linked list threaded
  through two columns, 8 bytes a chunk.
* :class:`PrefixOrder` (``prefix``): for a prefix cache. LMCache looks a request's chunks
  up in prefix order and stops at the first miss, so chunk *k* is worth something only
  while chunks *0..k-1* are held. A batch's chunks (a put, a get, a lookup's touch:
  keys in prefix order) are touched tail first, so a chain's head is its most recent
  chunk and its tail leaves first; each chunk remembers the chunk before it in the
  batch (its *parent*). When a chunk leaves the tier, the chunks after it (now
  unreachable) are *cut off* and leave before anything still reachable. 24 bytes a
  chunk: the recency list (8) and the chain as a tree (parent, first child, and the
  siblings' list: 16), since a shared head (a system prompt) has many continuations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from typing import Protocol

from backend.node.columns import column, grown

__all__ = ["EvictionOrder", "LruOrder", "PrefixOrder", "ORDERS", "order_named"]

_END = -1  # no slot: the end of a list, a chain's head (no parent)
_OUT = -2  # in ``prev``: the slot is in no list (not in the tier, or pinned)
_CUT = -3  # in ``parent``: the chunk before it left: unreachable, it leaves first


class EvictionOrder(Protocol):
    """The order in which one tier's chunks (by slot) leave it."""

    def __len__(self) -> int: ...

    def add(self, slot: int) -> None:
        """A chunk entered the tier (not pinned)."""

    def remove(self, slot: int) -> None:
        """A chunk left the tier (pinned or not)."""

    def pin(self, slot: int) -> None:
        """A chunk of the tier may not move for now (a lease, a put in flight)."""

    def unpin(self, slot: int) -> None:
        """A pinned chunk may move again (as just read)."""

    def touch(self, slot: int) -> None:
        """A chunk was read."""

    def touch_chain(self, slots: Sequence[int]) -> None:
        """The chunks of one batch were put, read or looked up, in prefix order (pinned ones included)."""

    def coldest(self) -> Iterator[int]:
        """Slots from the first to leave on; valid until the order next changes."""


class _Recency:
    """Doubly linked lists of slots through two columns (``prev``, ``next``); ``_OUT`` marks a slot in none.

    A list is its two ends, kept in a small array: ``ends[2 * n]`` its first (coldest),
    ``ends[2 * n + 1]`` its last (most recent)."""

    def __init__(self, lists: int) -> None:
        self.prev = column("i", fill=_OUT)
        self.next = column("i", fill=_END)
        self.ends = [_END] * (2 * lists)
        self.count = 0

    def listed(self, slot: int) -> bool:
        return slot < len(self.prev) and self.prev[slot] != _OUT

    def append(self, slot: int, which: int) -> None:
        """``slot`` (in no list) becomes the most recent of list ``which``."""
        if slot >= len(self.prev):
            self.prev = grown(self.prev, slot + 1, _OUT)
            self.next = grown(self.next, slot + 1, _END)
        last = self.ends[2 * which + 1]
        self.prev[slot] = last
        self.next[slot] = _END
        if last == _END:
            self.ends[2 * which] = slot
        else:
            self.next[last] = slot
        self.ends[2 * which + 1] = slot
        self.count += 1

    def unlink(self, slot: int, which: int) -> None:
        """Take ``slot`` (in list ``which``) out of it."""
        before, after = self.prev[slot], self.next[slot]
        if before == _END:
            self.ends[2 * which] = after
        else:
            self.next[before] = after
        if after == _END:
            self.ends[2 * which + 1] = before
        else:
            self.prev[after] = before
        self.prev[slot] = _OUT
        self.next[slot] = _END
        self.count -= 1

    def walk(self, which: int) -> Iterator[int]:
        slot = self.ends[2 * which]
        while slot != _END:
            after = self.next[slot]
            yield slot
            slot = after


class LruOrder:
    """Least recently used first. Every operation O(1); 8 bytes per slot."""

    def __init__(self) -> None:
        self._list = _Recency(1)

    def __len__(self) -> int:
        return self._list.count

    def add(self, slot: int) -> None:
        self._list.append(slot, 0)

    def remove(self, slot: int) -> None:
        if self._list.listed(slot):
            self._list.unlink(slot, 0)

    pin = remove

    def unpin(self, slot: int) -> None:
        if not self._list.listed(slot):
            self._list.append(slot, 0)

    def touch(self, slot: int) -> None:
        if self._list.listed(slot) and slot != self._list.ends[1]:
            self._list.unlink(slot, 0)
            self._list.append(slot, 0)

    def touch_chain(self, slots: Sequence[int]) -> None:
        """Each in turn, head first: what a batch's reads one by one did before chains were known."""
        for slot in slots:
            self.touch(slot)

    def coldest(self) -> Iterator[int]:
        return self._list.walk(0)


_REACHABLE, _CUT_OFF = 0, 1  # PrefixOrder's two lists: cut-off chunks are walked first


class PrefixOrder:
    """Tails of cold prefix chains first, and chunks whose prefix left before anything still reachable.

    Every operation O(1), amortised: a chunk is cut off once per link a batch made to
    it. 24 bytes per slot: ``prev``/``next`` (recency), ``parent``, ``child`` (its first),
    ``sibling_prev``/``sibling_next`` (the other children of its parent).

    Chains are what this tier saw: a chunk's parent is the chunk before it in a batch
    that this tier held. A chain whose chunks sit on several nodes is cut at each node's
    edge; each node keeps the order of the part it holds (the keys of a batch that land
    on it are still in prefix order), and a chunk cut off by another node's eviction is
    not told here: it goes by recency, a tail's, which is older than its head's.
    """

    def __init__(self) -> None:
        self._lists = _Recency(2)
        self._parent = column("i", fill=_END)
        self._child = column("i", fill=_END)
        self._sibling_prev = column("i", fill=_END)
        self._sibling_next = column("i", fill=_END)

    def __len__(self) -> int:
        return self._lists.count

    def _which(self, slot: int) -> int:
        return _CUT_OFF if self._parent[slot] == _CUT else _REACHABLE

    def _grow(self, slot: int) -> None:
        if slot >= len(self._parent):
            self._parent = grown(self._parent, slot + 1, _END)
            self._child = grown(self._child, slot + 1, _END)
            self._sibling_prev = grown(self._sibling_prev, slot + 1, _END)
            self._sibling_next = grown(self._sibling_next, slot + 1, _END)

    def add(self, slot: int) -> None:
        self._grow(slot)
        self._lists.append(slot, self._which(slot))

    def remove(self, slot: int) -> None:
        """Left the tier: its children are cut off now, and it is no child of its parent any more."""
        lists = self._lists
        if lists.listed(slot):
            lists.unlink(slot, self._which(slot))
        if slot >= len(self._parent):
            return
        child = self._child[slot]
        while child != _END:
            after = self._sibling_next[child]
            self._set_parent(child, _CUT)
            child = after
        self._detach(slot)
        self._parent[slot] = _END

    def pin(self, slot: int) -> None:
        if self._lists.listed(slot):
            self._lists.unlink(slot, self._which(slot))

    def unpin(self, slot: int) -> None:
        if not self._lists.listed(slot):
            self.add(slot)

    def touch(self, slot: int) -> None:
        lists = self._lists
        if lists.listed(slot):
            which = self._which(slot)
            lists.unlink(slot, which)
            lists.append(slot, which)

    def touch_chain(self, slots: Sequence[int]) -> None:
        """Link each chunk to the one before it, then touch them tail first: the head is the most recent.

        The first chunk keeps the parent it had (a batch may begin in the middle of a chain)."""
        for before, slot in pairwise(slots):
            if slot != before:
                self._grow(max(slot, before))
                if self._parent[slot] != before:
                    self._set_parent(slot, before)
        for slot in reversed(slots):
            self.touch(slot)

    def coldest(self) -> Iterator[int]:
        yield from self._lists.walk(_CUT_OFF)
        yield from self._lists.walk(_REACHABLE)

    def _set_parent(self, slot: int, parent: int) -> None:
        """Make ``parent`` (a slot, or ``_CUT``) the chunk before ``slot``; a listed slot moves list if its
        reachability changed, keeping its place at the recent end."""
        lists = self._lists
        listed = lists.listed(slot)
        if listed:
            lists.unlink(slot, self._which(slot))
        self._detach(slot)
        self._parent[slot] = parent
        if parent >= 0:
            first = self._child[parent]
            self._sibling_next[slot] = first
            if first != _END:
                self._sibling_prev[first] = slot
            self._child[parent] = slot
        if listed:
            lists.append(slot, self._which(slot))

    def _detach(self, slot: int) -> None:
        """Take ``slot`` out of its parent's children (if it has a parent)."""
        parent = self._parent[slot]
        if parent < 0:
            return
        before, after = self._sibling_prev[slot], self._sibling_next[slot]
        if before == _END:
            self._child[parent] = after
        else:
            self._sibling_next[before] = after
        if after != _END:
            self._sibling_prev[after] = before
        self._sibling_prev[slot] = _END
        self._sibling_next[slot] = _END
        self._parent[slot] = _END


ORDERS: dict[str, Callable[[], EvictionOrder]] = {"lru": LruOrder, "prefix": PrefixOrder}  # the ``eviction`` setting


def order_named(name: str) -> EvictionOrder:
    """A new order of the policy ``name`` (a key of :data:`ORDERS`)."""
    return ORDERS[name]()
