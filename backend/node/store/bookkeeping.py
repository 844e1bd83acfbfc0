"""What a node knows about its own chunks: which it holds, their fields packed per slot, in key order, and what
Redis has not heard yet.

``ChunkTable`` gives every chunk held, in any tier, one *slot*: an index into columns
(``columns.py``: machine integers in memory of their own, no object per chunk) holding
its size, checksum, layout id and which tiers hold it; each tier keeps its own columns
beside them (``dram.py``: where its bytes are, the put that stored it; ``nvme_tier.py``:
where its payload starts in its file; each tier's eviction order, ``eviction.py``). A
node of a million chunks then keeps no Python object per chunk but its key string: the
key finds its slot through an open-addressing index and is listed in key order by
sorted buckets (``keys.py``). docs/scale-node.md has the measured cost per chunk.

The table counts the keys held in O(1) (the heartbeat asks every second) and pages
through them in key order from a cursor (INVENTORY: ``kvpool check`` and ``kvpool
drain`` walk a node this way), in O(log N + L) for a page of L keys.

``IndexChanges`` collects what the tiers did that the index must hear about
(chunks gone, chunks that changed tier); the node's publisher sends them in batches.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Sequence

from backend.node.memory.columns import column, grown
from backend.node.store.eviction import EvictionOrder
from backend.node.store.keys import NO_SLOT, KeyIndex, SortedKeys
from backend.node.store.same_chunk import slot_holds
from backend.protocol import ItemMeta
from backend.tenants import tenant_of

__all__ = [
    "ChunkTable",
    "IndexChanges",
    "Layouts",
    "item_meta",
    "DRAM",
    "NVME",
    "IN_DRAM",
    "ON_NVME",
    "PINNED",
    "NO_SLOT",
]

DRAM = "dram"  # tier names, as the index records them
NVME = "nvme"
IN_DRAM = 1  # ChunkTable.where bits
ON_NVME = 2
PINNED = 4  # held by a lease or a put in flight: in no eviction order
MAX_LAYOUTS = 65_535  # distinct layouts with an id (2 bytes a slot) ...
OWN_LAYOUT = MAX_LAYOUTS  # ... beyond them, a slot keeps its layout beside the table

Layout = tuple[str, tuple[int, ...], int, int]  # dtype, shape, memory format, layout fingerprint


def item_meta(
    key: str, nbytes: int, checksum: int, dtype: str, shape: tuple[int, ...], fmt: int, fingerprint: int
) -> ItemMeta:
    """``ItemMeta(key, nbytes, checksum, dtype, shape, fmt, fingerprint)``, made in a third of the time.

    ItemMeta is a frozen dataclass: its ``__init__`` sets each field through ``object.__setattr__``
    (1.3 us here), and a read makes one per chunk from its slot. The fields go straight into the
    instance's dict instead (0.4-0.5 us); ``tests/test_node_memory.py`` checks that both make equal values.
    """
    meta = object.__new__(ItemMeta)
    fields = meta.__dict__
    fields["key"] = key
    fields["nbytes"] = nbytes
    fields["checksum"] = checksum
    fields["dtype"] = dtype
    fields["shape"] = shape
    fields["fmt"] = fmt
    fields["fingerprint"] = fingerprint
    return meta


class Layouts:
    """Each distinct tensor layout (dtype, shape, memory format, layout fingerprint) once, by a small id, counted
    by its users.

    Most chunks of a node share a handful of layouts (one model's full chunk, its partial
    last chunks, per engine layout fingerprint), so a slot keeps a 2-byte id, not a tuple:
    the fingerprint costs a chunk nothing beyond the id it had already. An id whose last user left is
    reused. Past ``MAX_LAYOUTS`` distinct layouts at once (a client inventing shapes), a slot
    keeps its own layout beside the table (``OWN_LAYOUT``): correct, only dearer.
    """

    def __init__(self) -> None:
        self._ids: dict[Layout, int] = {}
        self._layouts: list[Layout | None] = []
        self._users = array("I")
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._ids)

    def take(self, layout: Layout) -> int:
        """The id of ``layout`` with one more user; OWN_LAYOUT when the table is full."""
        layout_id = self._ids.get(layout)
        if layout_id is None:
            if self._free:
                layout_id = self._free.pop()
                self._layouts[layout_id] = layout
            elif len(self._layouts) < MAX_LAYOUTS:
                layout_id = len(self._layouts)
                self._layouts.append(layout)
                self._users.append(0)
            else:
                return OWN_LAYOUT
            self._ids[layout] = layout_id
        self._users[layout_id] += 1
        return layout_id

    def get(self, layout_id: int) -> Layout:
        layout = self._layouts[layout_id]
        assert layout is not None
        return layout

    def give_back(self, layout_id: int) -> None:
        """One user of ``layout_id`` left; the id is free again once none is left."""
        if layout_id == OWN_LAYOUT:
            return
        self._users[layout_id] -= 1
        if not self._users[layout_id]:
            layout = self._layouts[layout_id]
            assert layout is not None
            del self._ids[layout]
            self._layouts[layout_id] = None
            self._free.append(layout_id)


class ChunkTable:
    """Every chunk this node holds, in any tier: one slot each, its fields packed in columns.

    A key's slot lives from the moment it enters a tier until it leaves the last one; its
    chunk's size, checksum and layout are the same in every tier that holds it (a copy in
    DRAM and a file on NVMe always hold the same bytes: the tier manager drops one before
    the other could differ). What each tier keeps per chunk beyond that (where the bytes
    are, its place in the tier's eviction order) is in the tier's own columns, indexed by
    the same slot. ``where`` tells, per slot, which tiers hold it and whether it is
    *pinned* (a lease or a put in flight holds it: no eviction order lists it meanwhile).

    Per chunk, beyond the key string: its place in the slot -> key list (8 bytes) and in
    the sorted buckets (about 9), the key index (16 to 32, ``keys.py``) and 15 bytes of
    columns here; the DRAM tier adds 24 and the NVMe tier 12 (docs/scale-node.md has the
    measured total).
    """

    def __init__(self, pinned: Callable[[str], bool] = lambda key: False) -> None:
        self._pinned = pinned  # whether a key is pinned now (asked when it enters, and by ``repin``)
        self.orders: dict[int, EvictionOrder] = {}  # tier bit -> that tier's eviction order
        self._keys: list[str | None] = []  # slot -> key (None: a free slot)
        self._index = KeyIndex(self._keys)
        self._free = column("I")  # a stack of slots to reuse, last freed first
        self._free_count = 0
        self._sorted = SortedKeys()
        self.layouts = Layouts()
        self._own_layouts: dict[int, Layout] = {}  # slot -> its layout, when the table of layouts was full
        self.nbytes = column("I")  # a chunk is at most Limits.max_data_bytes (2 GiB)
        self.checksum = column("Q")
        self.layout = column("H")
        self.where = column("B")  # IN_DRAM | ON_NVME | PINNED
        # tenant -> payload bytes of its chunks held here (backend/tenants.py: the key says the tenant)
        self.tenant_bytes: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return self._index.get(key) != NO_SLOT

    def slot(self, key: str) -> int:
        """``key``'s slot, or NO_SLOT if no tier holds it."""
        return self._index.get(key)

    def key(self, slot: int) -> str:
        key = self._keys[slot]
        assert key is not None
        return key

    def meta(self, slot: int) -> ItemMeta:
        """The chunk in ``slot`` as the protocol describes it (made now: slots keep no objects)."""
        layout_id = self.layout[slot]
        dtype, shape, fmt, fingerprint = (
            self._own_layouts[slot] if layout_id == OWN_LAYOUT else self.layouts.get(layout_id)
        )
        return item_meta(self.key(slot), self.nbytes[slot], self.checksum[slot], dtype, shape, fmt, fingerprint)

    def fingerprint(self, slot: int) -> int:
        """The layout fingerprint the chunk in ``slot`` was stored with (0: none)."""
        layout_id = self.layout[slot]
        return (self._own_layouts[slot] if layout_id == OWN_LAYOUT else self.layouts.get(layout_id))[3]

    def meta_of(self, key: str) -> ItemMeta | None:
        """The chunk ``key`` names, as the protocol describes it, or None."""
        slot = self._index.get(key)
        return self.meta(slot) if slot != NO_SLOT else None

    def tier_of(self, key: str) -> str | None:
        """The tier serving ``key`` (DRAM before NVMe), or None."""
        slot = self._index.get(key)
        if slot == NO_SLOT:
            return None
        return DRAM if self.where[slot] & IN_DRAM else NVME

    def chunk(self, slot: int) -> tuple[ItemMeta, str]:
        """The chunk in ``slot`` and the tier serving it."""
        return self.meta(slot), DRAM if self.where[slot] & IN_DRAM else NVME

    def same_bytes(self, slot: int, meta: ItemMeta) -> bool:
        """Whether ``slot`` holds ``meta``'s chunk: its bytes, stored with its layout fingerprint (``same_chunk``)."""
        return slot_holds(self, slot, meta.checksum, meta.fingerprint)

    def enter(self, meta: ItemMeta, tier: int) -> int:
        """``meta``'s chunk entered ``tier``: its slot (new, or the key's, whose fields now describe ``meta``)."""
        slot = self._index.get(meta.key)
        if slot == NO_SLOT:
            slot = self._new_slot(meta)
        elif not self.same_bytes(slot, meta):
            self._describe(slot, meta, replacing=True)
        self.where[slot] |= tier
        return slot

    def leave(self, slot: int, tier: int) -> None:
        """The chunk in ``slot`` left ``tier``; the slot is freed once no tier holds it."""
        where = self.where[slot] & ~tier
        self.where[slot] = where
        if not where & (IN_DRAM | ON_NVME):
            self._drop(slot)

    def repin(self, key: str) -> None:
        """A lease or a landing put took ``key`` or let it go: its chunk leaves the tiers' eviction orders
        while it is pinned, and comes back (as just read) when it is not."""
        slot = self._index.get(key)
        if slot == NO_SLOT:
            return  # not held: a chunk that enters later asks ``pinned`` then
        where, pinned = self.where[slot], self._pinned(key)
        if pinned == bool(where & PINNED):
            return
        self.where[slot] = where | PINNED if pinned else where & ~PINNED
        for tier, order in self.orders.items():
            if where & tier:
                if pinned:
                    order.pin(slot)
                else:
                    order.unpin(slot)

    def touch_chain(self, keys: Sequence[str], read: bool = True) -> None:
        """The keys of one batch (a get, a lease, a lookup's touch: ``read``; or a put), in prefix order, were
        used: each tier's order hears of those it holds, as one chain (``EvictionOrder.touch_chain``). Keys not
        held are skipped: the chain a node keeps is the part of the batch it holds."""
        held = [s for s in map(self._index.get, keys) if s != NO_SLOT]  # each key looked up once, for every tier
        if not held:
            return
        where = self.where
        for tier, order in self.orders.items():
            slots = [s for s in held if where[s] & tier]
            if slots:
                order.touch_chain(slots, read)

    def slots(self) -> list[int]:
        """Every live slot, in slot order (a snapshot: the table may change while it is walked)."""
        return [slot for slot, key in enumerate(self._keys) if key is not None]

    def page(self, after: str, limit: int) -> tuple[list[str], bool]:
        """The first ``limit`` keys greater than ``after``, and whether more follow."""
        keys = self._sorted.after(after, limit + 1)
        return keys[:limit], len(keys) > limit

    def all(self) -> list[str]:
        return [key for key in self._keys if key is not None]

    def _new_slot(self, meta: ItemMeta) -> int:
        key = meta.key
        if self._free_count:
            self._free_count -= 1
            slot = self._free[self._free_count]
            self._keys[slot] = key
        else:
            slot = len(self._keys)
            self._keys.append(key)
            if slot >= len(self.where):
                self.nbytes = grown(self.nbytes, slot + 1)
                self.checksum = grown(self.checksum, slot + 1)
                self.layout = grown(self.layout, slot + 1)
                self.where = grown(self.where, slot + 1)
        self._index.add(key, slot)
        self._sorted.add(key)
        self.where[slot] = PINNED if self._pinned(key) else 0
        self._describe(slot, meta, replacing=False)
        return slot

    def _describe(self, slot: int, meta: ItemMeta, *, replacing: bool) -> None:
        if replacing:
            self._give_back_layout(slot)
        tenant = tenant_of(meta.key)
        if tenant is not None:
            self.tenant_bytes[tenant] += meta.nbytes - (self.nbytes[slot] if replacing else 0)
        self.nbytes[slot] = meta.nbytes
        self.checksum[slot] = meta.checksum
        layout = (meta.dtype, tuple(meta.shape), meta.fmt, meta.fingerprint)
        layout_id = self.layouts.take(layout)
        self.layout[slot] = layout_id
        if layout_id == OWN_LAYOUT:
            self._own_layouts[slot] = layout

    def _give_back_layout(self, slot: int) -> None:
        layout_id = self.layout[slot]
        self.layouts.give_back(layout_id)
        if layout_id == OWN_LAYOUT:
            del self._own_layouts[slot]

    def _drop(self, slot: int) -> None:
        key = self.key(slot)
        tenant = tenant_of(key)
        if tenant is not None:
            left = self.tenant_bytes[tenant] - self.nbytes[slot]
            if left:
                self.tenant_bytes[tenant] = left
            else:
                del self.tenant_bytes[tenant]
        self._index.remove(key)
        self._sorted.discard(key)
        self._give_back_layout(slot)
        self._keys[slot] = None
        self.where[slot] = 0
        if self._free_count >= len(self._free):
            self._free = grown(self._free, self._free_count + 1)
        self._free[self._free_count] = slot
        self._free_count += 1


class IndexChanges:
    """Keys this node stopped holding and keys that moved tier, not yet published to the index."""

    def __init__(self) -> None:
        self.removed: set[str] = set()
        self.moved: dict[str, str] = {}  # key -> the tier now serving it

    def take(self) -> tuple[set[str], dict[str, str]]:
        """Everything recorded so far; the record starts empty again."""
        removed, moved = self.removed, self.moved
        self.removed, self.moved = set(), {}
        return removed, moved

    def put_back(self, removed: set[str], moved: dict[str, str]) -> None:
        """Keep changes whose publishing failed for the next try."""
        self.removed |= removed
        for key, tier in moved.items():
            self.moved.setdefault(key, tier)  # a move recorded meanwhile is newer
