"""Which chunk of a tier leaves first: an eviction order, behind a small interface.

A tier (``dram.py``, ``nvme_tier.py``) tells its order when a chunk enters, leaves or
is read, and walks it from the coldest chunk when it needs room. Chunks that must not
move (pinned by a lease, or landing: a put in flight) are taken out of the walk while
they are pinned and put back when they are not, so the walk never passes over them:
finding a victim costs O(1) however many chunks are pinned (``tiers.py``).

Every operation is O(1) (amortised) and an order keeps no object per chunk: columns
indexed by the chunk's slot (``bookkeeping.ChunkTable``). Three orders, chosen by the
node's ``eviction`` setting (:data:`ORDERS`):

* :class:`LruOrder` (``lru``): least recently used first; a doubly linked list threaded
  through two columns, 8 bytes a chunk.
* :class:`PrefixRecencyOrder` (``prefix-recency``): for a prefix cache. LMCache looks a request's chunks
  up in prefix order and stops at the first miss, so chunk *k* is worth something only
  while chunks *0..k-1* are held. A batch's chunks (a put, a get, a lookup's touch:
  keys in prefix order) are touched tail first, so a chain's head is its most recent
  chunk and its tail leaves first; each chunk remembers the chunk before it in the
  batch (its *parent*). When a chunk leaves the tier, the chunks after it (now
  unreachable) are *cut off* and leave before anything still reachable. 24 bytes a
  chunk: the recency list (8) and the chain as a tree (parent, first child, and the
  siblings' list: 16), since a shared head (a system prompt) has many continuations.
* :class:`PrefixOrder` (``prefix``): ``prefix-recency``'s chains, and the most-read
  chains stay: fewest reads first (counts aged), and a newcomer that would evict a chunk
  read as often is refused (:meth:`EvictionOrder.admits`; the put answers it "no room").
  26 bytes a chunk, and 16 KiB a tier for the counts of refused keys.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from itertools import pairwise
from typing import Protocol

from backend.node.memory.columns import column, grown

__all__ = ["EvictionOrder", "LruOrder", "PrefixOrder", "PrefixRecencyOrder", "ORDERS", "order_named"]

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

    def touch_chain(self, slots: Sequence[int], read: bool = True) -> None:
        """The chunks of one batch were read or looked up (``read``), or put, in prefix order (pinned ones
        included)."""

    def coldest(self) -> Iterator[int]:
        """Slots from the first to leave on; valid until the order next changes."""

    def admits(self, key: Hashable) -> bool:
        """Whether a chunk ``key`` not held may evict the coldest chunk to come in (False: the order refuses it).
        The key is only hashed (the node passes its key string, the simulator its int)."""


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

    def touch_chain(self, slots: Sequence[int], read: bool = True) -> None:
        """Each in turn, head first: what a batch's reads one by one did before chains were known."""
        for slot in slots:
            self.touch(slot)

    def coldest(self) -> Iterator[int]:
        return self._list.walk(0)

    def admits(self, key: Hashable) -> bool:
        return True


_REACHABLE, _CUT_OFF = 0, 1  # PrefixRecencyOrder's two lists: cut-off chunks are walked first


class PrefixRecencyOrder:
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

    def touch_chain(self, slots: Sequence[int], read: bool = True) -> None:
        """Link each chunk to the one before it, then touch them tail first: the head is the most recent."""
        self._link(slots)
        for slot in reversed(slots):
            self.touch(slot)

    def coldest(self) -> Iterator[int]:
        yield from self._lists.walk(_CUT_OFF)
        yield from self._lists.walk(_REACHABLE)

    def admits(self, key: Hashable) -> bool:
        return True

    def _link(self, slots: Sequence[int]) -> None:
        """Make each chunk of a batch the child of the one before it; the first keeps the parent it had (a
        batch may begin in the middle of a chain)."""
        for before, slot in pairwise(slots):
            if slot != before:
                self._grow(max(slot, before))
                if self._parent[slot] != before:
                    self._set_parent(slot, before)

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


MAX_READS = 15  # a chunk's read count stops here: one recency list per count, and 4 agings take any to 0
NEW_READS = 1  # a chunk put starts as read once
# Halve every count after this many times the tier's chunks were named by batches (reads and puts):
# tuned in the simulator, on its own copy of the rule then (2 lost long-doc-qa at 0.5; 8 never adapted).
AGE_EVERY_HELD = 4
_CUT_OFF_LIST = 0  # PrefixOrder's first list: cut-off chunks, whatever their counts
_FRESH = 0xFF  # in ``reads``: the slot has no count yet (it starts at NEW_READS when next seen)
_HALVED = bytes(n // 2 for n in range(256))  # a translate table: every counter of the sketch halved
# The counts of refused keys: a count-min sketch of SKETCH_ROWS rows of SKETCH_WIDTH one-byte counters
# (16 KiB a tier, whatever it holds): a key's estimate is its smallest counter, never below its count.
SKETCH_ROWS, SKETCH_WIDTH = 4, 4096
_SKETCH_BITS = 16  # the hash bits each row takes its column from (SKETCH_WIDTH <= 1 << _SKETCH_BITS)


class PrefixOrder(PrefixRecencyOrder):
    """The most-read chains stay: cut-off chunks first, then the fewest reads, least recent first among equals
    (a batch touches tail first, so inside a chain the tail leaves first); and a newcomer is refused
    (:meth:`admits`) when the chunk it would evict was read at least as often as it counts.

    The simulator runs this class itself (``bench/workload/sim.py`` ``NodeOrder``), as it runs the others.
    A read is a batch that read or looked a chunk up (``touch_chain(read=True)``); a put starts a chunk at
    NEW_READS. A refused key's refusals are counted in a fixed-size sketch and count as its reads when it
    is offered again, so a new working set that keeps coming back gets in as the old one cools.

    Every operation O(1), amortised. 26 bytes per slot: PrefixRecencyOrder's 24, ``reads`` (1) and ``epoch`` (1).
    One recency list per count (``1 + reads``) after the cut-off list (0). Aging halves every count without
    visiting a chunk: the lists of counts 2r and 2r+1 are spliced into the list of r (the lower first), and
    a chunk's stored count is halved by the agings it missed when it is next read (its ``epoch``, mod 256,
    against the order's). A chunk unread for 256 agings or more may keep a stale count when it sits
    inside a list: a tie-break error, never a broken list (a list's ends are checked, :meth:`_which`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._lists = _Recency(2 + MAX_READS)
        self._reads = column("B", fill=_FRESH)
        self._epoch = column("B")
        self._age = 0  # agings so far
        self._named = 0  # chunks named by batches since the last aging
        self._sketch = bytearray(SKETCH_ROWS * SKETCH_WIDTH)
        self.refused = 0  # newcomers refused (``admits``)
        self.agings = 0

    def _grow(self, slot: int) -> None:
        super()._grow(slot)
        if slot >= len(self._reads):
            self._reads = grown(self._reads, slot + 1, _FRESH)
            self._epoch = grown(self._epoch, slot + 1)

    def remove(self, slot: int) -> None:
        super().remove(slot)
        if slot < len(self._reads):
            self._reads[slot] = _FRESH  # a slot reused later starts afresh

    def reads(self, slot: int) -> int:
        """How often the chunk in ``slot`` was read, aged (NEW_READS when it was only put)."""
        self._grow(slot)
        stored, age = self._reads[slot], self._age & 0xFF
        if stored == _FRESH:
            self._reads[slot], self._epoch[slot] = NEW_READS, age
            return NEW_READS
        missed = (age - self._epoch[slot]) & 0xFF
        if missed:
            stored >>= min(missed, 8)
            self._reads[slot], self._epoch[slot] = stored, age
        return stored

    def _which(self, slot: int) -> int:
        if self._parent[slot] == _CUT:
            return _CUT_OFF_LIST
        which = 1 + self.reads(slot)
        lists = self._lists
        if lists.listed(slot) and (
            (lists.prev[slot] == _END and lists.ends[2 * which] != slot)
            or (lists.next[slot] == _END and lists.ends[2 * which + 1] != slot)
        ):  # a count gone stale past the epoch's wrap: the list whose end it is says its count
            end = 2 * which if lists.prev[slot] == _END else 2 * which + 1
            which = next(n for n in range(1, 2 + MAX_READS) if lists.ends[2 * n + end % 2] == slot)
            self._reads[slot] = which - 1
        return which

    def touch_chain(self, slots: Sequence[int], read: bool = True) -> None:
        """Link the batch's chunks as PrefixRecencyOrder does; a read counts once more for each; touch them tail first.

        Each listed chunk moves once: out of the list of its count, counted, into the list of its new count as the
        most recent (counting the whole batch first, then touching it, moved each twice)."""
        self._link(slots)
        lists = self._lists
        for slot in reversed(slots):
            listed = lists.listed(slot)
            if listed:
                lists.unlink(slot, self._which(slot))
            if read:
                self._count_read(slot)  # (not listed now: only its count changes)
            if listed:
                lists.append(slot, self._which(slot))
        self._named_by_batches(len(slots))

    def coldest(self) -> Iterator[int]:
        for which in range(2 + MAX_READS):
            yield from self._lists.walk(which)

    def admits(self, key: Hashable) -> bool:
        """Whether ``key`` may evict the coldest chunk: yes when that one is cut off or read fewer times than
        NEW_READS and the key's refusals; else the refusal is counted (in the sketch and ``refused``)."""
        coldest = next(self.coldest(), _END)
        if coldest == _END or self._parent[coldest] == _CUT:
            return True
        if self.reads(coldest) < NEW_READS + self.refusals(key):
            return True
        for index in self._cells(key):
            self._sketch[index] = min(self._sketch[index] + 1, 0xFF)
        self.refused += 1
        self._named_by_batches(1)  # asked for and not held: it counts toward aging as a miss put would
        return False

    def refusals(self, key: Hashable) -> int:
        """How often ``key`` was refused (aged as the reads are; never under, may be over: a sketch)."""
        return min(self._sketch[index] for index in self._cells(key))

    @staticmethod
    def _cells(key: Hashable) -> Iterator[int]:
        digest = hash(key)
        for row in range(SKETCH_ROWS):
            yield row * SKETCH_WIDTH + ((digest >> (row * _SKETCH_BITS)) & (SKETCH_WIDTH - 1))

    def _count_read(self, slot: int) -> None:
        reads = self.reads(slot)
        if reads >= MAX_READS:
            return
        lists = self._lists
        listed = lists.listed(slot)
        if listed:
            lists.unlink(slot, self._which(slot))
        self._reads[slot] = reads + 1
        if listed:
            lists.append(slot, self._which(slot))

    def _named_by_batches(self, chunks: int) -> None:
        """``chunks`` more were named by batches (held, or refused): age once the tier's were, AGE_EVERY_HELD
        times over."""
        self._named += chunks
        if self._named >= AGE_EVERY_HELD * max(len(self), 1):
            self._age_all()

    def _age_all(self) -> None:
        """Halve every count: splice the lists of counts 2r and 2r+1 into r's (O(MAX_READS)), halve the sketch
        (its fixed bytes), and let each chunk halve its stored count when next read (its epoch)."""
        self._named = 0
        self._age += 1
        self.agings += 1
        lists = self._lists
        ends = lists.ends
        for reads in range(MAX_READS // 2 + 1):
            low, high = 1 + 2 * reads, 2 + 2 * reads
            first, last = ends[2 * low], ends[2 * low + 1]
            if first == _END:
                first, last = ends[2 * high], ends[2 * high + 1]
            elif ends[2 * high] != _END:
                lists.next[last], lists.prev[ends[2 * high]] = ends[2 * high], last
                last = ends[2 * high + 1]
            ends[2 * (1 + reads)], ends[2 * (1 + reads) + 1] = first, last
        for reads in range(MAX_READS // 2 + 1, MAX_READS + 1):
            ends[2 * (1 + reads)] = ends[2 * (1 + reads) + 1] = _END
        self._sketch = bytearray(self._sketch.translate(_HALVED))


ORDERS: dict[str, Callable[[], EvictionOrder]] = {
    "lru": LruOrder,
    "prefix": PrefixOrder,
    "prefix-recency": PrefixRecencyOrder,
}  # the ``eviction`` setting


def order_named(name: str) -> EvictionOrder:
    """A new order of the policy ``name`` (a key of :data:`ORDERS`)."""
    return ORDERS[name]()
