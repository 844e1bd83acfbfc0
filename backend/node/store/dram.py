"""DRAM tier: a byte-bounded, evictable set of complete, verified chunks, kept with no object per chunk."""

from __future__ import annotations

from collections.abc import Container
from typing import NamedTuple

from backend.errors import CapacityError
from backend.node.memory.arena import Arena, room_of
from backend.node.memory.buffers import ChunkBuffer
from backend.node.memory.columns import column, grown
from backend.node.store.bookkeeping import IN_DRAM, NO_SLOT, PINNED, ChunkTable
from backend.node.store.eviction import EvictionOrder, LruOrder
from backend.node.store.same_chunk import slot_holds
from backend.protocol import ItemMeta

__all__ = ["DramTier", "StoredChunk"]

TIER_NAME = "dram"
PRIVATE = -1  # a slot's region when its bytes are a buffer of their own (``DramTier._private``)
_PUT_ID_MASK = (1 << 64) - 1  # put ids are 64-bit on the wire; the node's own are negative


class StoredChunk(NamedTuple):
    """A chunk's bytes and the metadata it was stored with, as handed out or brought in. Buffers are never
    mutated. The tier keeps no such object: it makes one per read (a tuple: made in a fraction of a
    frozen dataclass's time), whose buffer keeps the bytes alive."""

    meta: ItemMeta
    buffer: ChunkBuffer


class DramTier:
    """Chunks in memory, bounded by ``capacity_bytes`` of the room they occupy (``arena.room_of``).

    Space is *reserved* before a chunk's bytes are received (so memory never exceeds
    the bound while a put is in flight), then the chunk is inserted or the
    reservation released. What leaves the tier when it is full (demotion to NVMe or
    eviction) is the tier manager's decision (``backend.node.store.tiers``); the tier's
    ``order`` (LRU unless another is given) says which chunk is coldest.

    A chunk's bytes live in the arena, kept by their offset alone, or (larger than a
    connection's window, or no room in the arena) in a buffer of their own. Per chunk the
    tier keeps 16 bytes here and its order's 8 (``bookkeeping.ChunkTable`` the rest).

    Each chunk a put brought (or found already here) is marked with that put's id, so a
    put never evicts its own chunks to make room for itself (``coldest(keep_put=...)``).
    """

    name = TIER_NAME

    def __init__(
        self, capacity_bytes: int, table: ChunkTable, arena: Arena | None = None, order: EvictionOrder | None = None
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError("DRAM capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self.table = table
        self.arena = arena
        self.order: EvictionOrder = order if order is not None else LruOrder()
        table.orders[IN_DRAM] = self.order  # a chunk pinned or unpinned leaves or rejoins it (``ChunkTable.repin``)
        self._region = column("q")  # slot -> arena offset of its bytes, or PRIVATE
        self._put = column("Q")  # slot -> id of the put that last stored or found it (0: none)
        self._private: dict[int, ChunkBuffer] = {}  # slot -> its own buffer (not in the arena)
        self._count = 0
        self._stored_bytes = 0
        self._reserved_bytes = 0

    def use_arena(self, arena: Arena | None) -> None:
        """Keep chunks in ``arena`` from now on: given once, before the tier holds anything
        (``TierManager.take_memory``)."""
        assert self._count == 0 and self._reserved_bytes == 0, "an arena is given to an empty DRAM tier"
        self.arena = arena

    @property
    def used_bytes(self) -> int:
        return self._stored_bytes + self._reserved_bytes

    @property
    def stored_bytes(self) -> int:
        return self._stored_bytes

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: str) -> bool:
        return self._slot(key) != NO_SLOT

    def fits(self, room: int) -> bool:
        return self.used_bytes + room <= self.capacity_bytes

    def reserve(self, room: int) -> None:
        """Reserve ``room`` bytes for a chunk about to arrive; CapacityError if it does not fit now."""
        if not self.fits(room):
            raise CapacityError(
                f"DRAM tier full: {room} bytes do not fit ({self.used_bytes} of {self.capacity_bytes} used)"
            )
        self._reserved_bytes += room

    def release(self, room: int) -> None:
        """Give back a reservation whose put did not complete."""
        self._reserved_bytes -= room

    def coldest(self, skip: Container[str] = (), keep_put: int = 0) -> str | None:
        """The key of the first chunk to leave (by the tier's order) that is not in ``skip`` nor marked by put
        ``keep_put``, without touching recency. Pinned chunks are in no order: they are never walked past."""
        keep = keep_put & _PUT_ID_MASK
        table, put = self.table, self._put
        for slot in self.order.coldest():
            if keep and put[slot] == keep:
                continue
            key = table.key(slot)
            if key not in skip:
                return key
        return None

    def put_of(self, key: str) -> int:
        """The id of the put that last stored or found ``key`` here (0: none), as a 64-bit wire id."""
        slot = self._slot(key)
        return self._put[slot] if slot != NO_SLOT else 0

    def claim(self, key: str, put_id: int) -> None:
        """Mark ``key`` (held here) as part of put ``put_id``: that put will not evict it."""
        slot = self._slot(key)
        if slot != NO_SLOT:
            self._put[slot] = put_id & _PUT_ID_MASK

    def holds(self, key: str, checksum: int, fingerprint: int) -> bool:
        """Whether ``key`` is here with these bytes, stored with this layout fingerprint."""
        return slot_holds(self.table, self._slot(key), checksum, fingerprint)

    def peek(self, key: str) -> StoredChunk | None:
        """The chunk for ``key`` without touching its recency."""
        slot = self._slot(key)
        return self._chunk(slot) if slot != NO_SLOT else None

    def get(self, key: str) -> StoredChunk | None:
        """The chunk for ``key`` (marked as read), or None."""
        slot = self._slot(key)
        if slot == NO_SLOT:
            return None
        if not self.table.where[slot] & PINNED:
            self.order.touch(slot)
        return self._chunk(slot)

    def is_current(self, chunk: StoredChunk) -> bool:
        """Whether ``chunk`` (handed out or inserted earlier) is still what the tier holds for its key."""
        slot = self._slot(chunk.meta.key)
        if slot == NO_SLOT or self.table.checksum[slot] != chunk.meta.checksum:
            return False
        region = self._region[slot]
        if region == PRIVATE:
            return self._private[slot] is chunk.buffer
        return self.arena is not None and self.arena.offset_of(chunk.buffer) == region

    def insert(self, chunk: StoredChunk, put_id: int = 0) -> None:
        """Store a chunk whose room was reserved (by put ``put_id``, 0: none); replaces an older copy.

        An older copy on another tier with other bytes must be gone first (``TierManager.insert``):
        a slot describes one chunk."""
        meta = chunk.meta
        room = room_of(meta.nbytes)
        self._reserved_bytes -= room
        table = self.table
        slot = table.slot(meta.key)
        if slot != NO_SLOT and table.where[slot] & IN_DRAM:
            self._let_go(slot)
            table.enter(meta, IN_DRAM)
            if not table.where[slot] & PINNED:
                self.order.touch(slot)
        else:
            slot = table.enter(meta, IN_DRAM)
            if slot >= len(self._region):
                self._region = grown(self._region, slot + 1)
                self._put = grown(self._put, slot + 1)
            if not table.where[slot] & PINNED:
                self.order.add(slot)
            self._count += 1
        region = self.arena.adopt(chunk.buffer) if self.arena is not None else None
        if region is None:
            self._region[slot] = PRIVATE
            self._private[slot] = chunk.buffer
        else:
            self._region[slot] = region
        self._put[slot] = put_id & _PUT_ID_MASK
        self._stored_bytes += room

    def delete(self, key: str) -> bool:
        """Drop ``key``'s chunk from the tier; whether it was here. Its bytes are freed once no view is left."""
        slot = self._slot(key)
        if slot == NO_SLOT:
            return False
        self.order.remove(slot)  # pinned or not: it leaves the tier (and the chains it is in)
        self._let_go(slot)
        self._count -= 1
        self.table.leave(slot, IN_DRAM)
        return True

    def _slot(self, key: str) -> int:
        slot = self.table.slot(key)
        return slot if slot != NO_SLOT and self.table.where[slot] & IN_DRAM else NO_SLOT

    def _chunk(self, slot: int) -> StoredChunk:
        region = self._region[slot]
        meta = self.table.meta(slot)
        if region == PRIVATE:
            return StoredChunk(meta, self._private[slot])
        assert self.arena is not None
        return StoredChunk(meta, self.arena.view(region, meta.nbytes))

    def _let_go(self, slot: int) -> None:
        """Give up the bytes of ``slot``'s chunk (freed once no view of them is left)."""
        nbytes = self.table.nbytes[slot]
        region = self._region[slot]
        if region == PRIVATE:
            del self._private[slot]
        else:
            assert self.arena is not None
            self.arena.disown(region, nbytes)
        self._region[slot] = PRIVATE
        self._put[slot] = 0
        self._stored_bytes -= room_of(nbytes)
