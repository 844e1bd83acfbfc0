"""What a put does to the tiers: room reserved in DRAM, a verified chunk inserted, an uncommitted one taken out again.

* A put reserves DRAM room (``room_of`` its chunk). If DRAM is full, its least recently used
  chunks are demoted to NVMe (or, with no NVMe tier, evicted) until the chunk fits
  (``demotion.py``). A put never evicts its own chunks. A DRAM tier full of other puts in
  flight gives the put BusyError (the put path waits for them to land, until its deadline:
  ``intake.py``); one full of leased chunks and the put's own gives it CapacityError.
* A put's inserted chunks stay where they are until the put settles them (``landing.py``):
  committed, given up, or waiting.
"""

from __future__ import annotations

from backend.errors import BusyError, CapacityError
from backend.node.memory.arena import room_of
from backend.node.memory.buffers import ChunkBuffer
from backend.node.store.bookkeeping import ChunkTable, IndexChanges
from backend.node.store.chunk_memory import ChunkMemory
from backend.node.store.demotion import Demoter
from backend.node.store.dram import DramTier, StoredChunk
from backend.node.store.landing import Landing
from backend.node.store.nvme_tier import NvmeTier
from backend.node.store.same_chunk import same_meta, slot_holds
from backend.protocol.meta import NO_FINGERPRINT

__all__ = ["DramRoom", "NewerThanDisk"]


class NewerThanDisk:
    """While NVMe recovery runs (``recovery.py``): the keys stored or deleted since it began, newer than any file
    of them found on disk."""

    def __init__(self) -> None:
        self._keys: set[str] | None = None  # None: no recovery runs

    def begin(self) -> None:
        self._keys = set()

    def end(self) -> None:
        self._keys = None

    def note(self, key: str) -> None:
        if self._keys is not None:
            self._keys.add(key)

    def __contains__(self, key: str) -> bool:
        return self._keys is not None and key in self._keys


class DramRoom:
    """The put path's side of the tiers: buffers, reserve, give back, insert, settle, discard."""

    def __init__(
        self,
        table: ChunkTable,
        dram: DramTier,
        nvme: NvmeTier | None,
        demoter: Demoter,
        landing: Landing,
        changes: IndexChanges,
        newer: NewerThanDisk,
        memory: ChunkMemory,
    ) -> None:
        self.table = table
        self.dram = dram
        self.nvme = nvme
        self.demoter = demoter
        self.landing = landing
        self.changes = changes
        self.newer = newer
        self.memory = memory

    room_of = staticmethod(room_of)  # the DRAM a chunk of N bytes occupies, is reserved and counted at

    def contains(self, key: str) -> bool:
        return key in self.table

    def take_buffer(self, nbytes: int, *, shared: bool = True) -> ChunkBuffer:
        """A buffer for a chunk entering DRAM: in the arena when it has room (and ``shared``), else private."""
        return self.memory.take_buffer(nbytes, shared=shared)

    async def reserve(self, room: int, *, put_id: int = 0) -> None:
        """Reserve ``room`` bytes of DRAM (``room_of`` a chunk, or a part of one) for put ``put_id``,
        demoting or evicting older chunks as needed.

        Raise BusyError when nothing can move because other puts fill DRAM (reserved, or
        inserted and not committed yet: a burst of puts, or a put striped over several
        connections): the caller may wait for them to land and commit (``wait_for_room``),
        holding no reservation another waiter may need meanwhile, and try again
        (``backend.node.store.intake``). Raise CapacityError when no put in flight could make room:
        the chunk is larger than DRAM, or the rest is leased or this same put's
        (``Demoter.make_room``).
        """
        dram = self.dram
        if room > dram.capacity_bytes:
            raise CapacityError(f"chunk of {room} bytes is larger than the DRAM tier ({dram.capacity_bytes} bytes)")
        if not dram.fits(room):
            await self.demoter.make_room(room, keep_put=put_id)
        if not dram.fits(room):
            if dram.used_bytes <= dram.stored_bytes and not self.landing.nbytes:
                raise CapacityError("DRAM tier is full of leased chunks and this put's own")
            raise BusyError("DRAM tier is full of puts in flight")
        dram.reserve(room)
        self.demoter.wake()

    async def wait_for_room(self, until: float) -> bool:
        """Wait until DRAM may have room for a put: a reservation landed or was given back, a put committed
        or gave up, a chunk left or was unpinned, or room ahead of a put's bytes was given back (the
        demoter's lock is not held meanwhile). False once the loop time ``until`` passed."""
        return await self.landing.wait_for_room(until)

    def release(self, room: int) -> None:
        """Give back ``room`` bytes reserved by :meth:`reserve` (the chunk did not come, or is not kept)."""
        self.dram.release(room)
        self.landing.wake()

    def insert(self, chunk: StoredChunk, put_id: int = 0) -> None:
        """Store a verified chunk of put ``put_id`` (0: none) in reserved DRAM; an NVMe copy with other
        bytes is dropped first. A put's chunk is not moved until the put settles it (``Landing.settle``)."""
        if self.nvme is not None:
            old = self.nvme.record(chunk.meta.key)
            if old is not None and not same_meta(old.meta, chunk.meta):
                self.nvme.forget(old)
        self.dram.insert(chunk, put_id)
        self.newer.note(chunk.meta.key)
        if put_id:  # a put's chunk: it stays until settled
            self.landing.add(chunk)
        self.landing.wake()

    def claim(self, key: str, put_id: int) -> None:
        """A put found ``key`` already held with its bytes: that put will not evict it either."""
        self.dram.claim(key, put_id)

    def settle(self, chunks: list[StoredChunk]) -> None:
        """The puts that inserted ``chunks`` committed, gave up, or wait: the chunks may move now."""
        self.landing.settle(chunks)

    def holds(self, key: str, item_checksum: int, fingerprint: int = NO_FINGERPRINT) -> bool:
        """Whether this node holds ``key`` with these bytes and layout fingerprint (DRAM or NVMe: both the same)."""
        return slot_holds(self.table, self.table.slot(key), item_checksum, fingerprint)

    def admits(self, key: str, room: int) -> bool:
        """Whether a put of ``key`` (``room`` bytes) may make its room by eviction: False when DRAM is full, evicts
        (no NVMe tier below it), and its order refuses the newcomer (``prefix``: the coldest chunk was read as
        often). A key held already, or one that fits, is never refused here."""
        if self.nvme is not None or self.dram.fits(room) or key in self.table:
            return True
        return self.dram.order.admits(key)

    async def drop_uncommitted(self, chunks: list[StoredChunk]) -> None:
        """The chunks of a put that will not be committed leave the tiers (unless a newer put replaced them)."""
        self.settle(chunks)
        for chunk in chunks:
            await self.discard(chunk)

    async def discard(self, chunk: StoredChunk) -> None:
        """Undo ``insert`` (the put was not committed), unless the key was replaced since."""
        key = chunk.meta.key
        if self.dram.is_current(chunk):
            self.dram.delete(key)
        elif key in self.dram:
            return  # a newer put of the key owns it now
        record = self.nvme.record(key) if self.nvme is not None else None
        if record is not None and same_meta(record.meta, chunk.meta):
            assert self.nvme is not None
            self.nvme.remove(key)
            await self.nvme.unlink(record.path)
        if key not in self.table:
            self.changes.removed.add(key)  # an older committed copy may have been displaced
