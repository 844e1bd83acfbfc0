"""Reading a chunk out of the tiers: from DRAM, or back from NVMe (verified) and promoted; re-checking a copy.

* A hit on NVMe is read back in a worker thread, verified, and promoted to DRAM; the file
  stays, so a later demotion of the same chunk costs nothing. With no DRAM room for it
  (the rest leased), it is served from disk without a DRAM copy.
* A file whose checksum fails is moved to ``quarantine/`` and reads as a miss.
"""

from __future__ import annotations

from collections import Counter

from backend.counters import NodeCounter
from backend.errors import CapacityError, IntegrityError
from backend.node.memory.arena import room_of
from backend.node.store.bookkeeping import DRAM, IndexChanges
from backend.node.store.dram import DramTier, StoredChunk
from backend.node.store.nvme_tier import NvmeTier
from backend.node.store.room import DramRoom
from backend.protocol import checksum

__all__ = ["ReadBack"]


class ReadBack:
    """A chunk's bytes, wherever this node holds them (:meth:`get`), and a re-check of them (:meth:`verify`)."""

    def __init__(
        self,
        dram: DramTier,
        nvme: NvmeTier | None,
        room: DramRoom,
        changes: IndexChanges,
        counters: Counter[NodeCounter],
    ) -> None:
        self.dram = dram
        self.nvme = nvme
        self.room = room
        self.changes = changes
        self.counters = counters

    async def get(self, key: str) -> StoredChunk | None:
        """The chunk from DRAM, or read back (verified) from NVMe and promoted; None if not held."""
        chunk = self.dram.get(key)
        if chunk is not None or self.nvme is None:
            return chunk
        nvme = self.nvme
        record = nvme.touch(key)
        if record is None:
            return None
        nbytes = record.meta.nbytes
        room = room_of(nbytes)
        try:
            await self.room.reserve(room)
            promote = True
        except CapacityError:
            promote = False  # serve from disk without keeping a DRAM copy
        buffer = self.room.take_buffer(nbytes, shared=promote)
        try:
            await nvme.read(record, buffer)
        except (IntegrityError, OSError) as exc:
            if promote:
                self.room.release(room)
            if nvme.is_current(record):  # not if a newer file replaced it meanwhile
                await nvme.quarantine(record, exc)
            return None
        if not nvme.is_current(record):
            # Deleted, or replaced by other bytes, while we read: what we hold is history.
            if promote:
                self.room.release(room)
            return None
        chunk = StoredChunk(record.meta, buffer)
        if promote:
            if key not in self.dram:
                self.dram.insert(chunk)
                self.changes.moved[key] = DRAM
                self.counters[NodeCounter.PROMOTIONS] += 1
            else:  # a put of the same key landed while we read
                self.room.release(room)
                current = self.dram.peek(key)
                assert current is not None
                chunk = current
        self.counters[NodeCounter.NVME_READS] += 1
        return chunk

    async def verify(self, key: str) -> str:
        """Re-check this node's copy of ``key``: "ok", "missing" or "corrupt" (then dropped)."""
        chunk = self.dram.peek(key)
        if chunk is not None:
            if checksum(chunk.buffer) == chunk.meta.checksum:
                return "ok"
            self.dram.delete(key)  # memory went bad: never serve it
            self.counters[NodeCounter.INTEGRITY_FAILURES] += 1
            if self.nvme is None or key not in self.nvme:
                self.changes.removed.add(key)
        record = self.nvme.touch(key) if self.nvme is not None else None
        if record is None:
            return "corrupt" if chunk is not None else "missing"
        assert self.nvme is not None
        try:
            await self.nvme.read(record, self.room.take_buffer(record.meta.nbytes, shared=False))
        except (IntegrityError, OSError) as exc:
            await self.nvme.quarantine(record, exc)
            return "corrupt"
        return "ok"
