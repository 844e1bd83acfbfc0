"""DRAM -> NVMe: which chunks leave DRAM, and where they go.

* When a put needs room, the coldest unpinned DRAM chunks (by the tier's eviction
  order, least recently used first) are demoted to NVMe (or, with no NVMe tier, evicted) until it fits; a chunk the disk will not take
  is evicted instead, so DRAM stays writable whatever the disk does.
* A background task keeps DRAM between its watermarks (demote above ``high`` down
  to ``low``) so puts rarely wait for the disk; it pauses while the disk is full.
* A move re-checks DRAM after the write: a chunk deleted or replaced meanwhile is
  not resurrected, and a file of bytes nobody holds any more is removed.

One decision at a time (``lock``): two demotions of the same chunk would race.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from backend.counters import NodeCounter
from backend.errors import CapacityError
from backend.node.store.bookkeeping import NVME, IndexChanges
from backend.node.store.dram import DramTier, StoredChunk
from backend.node.store.nvme_format import NvmeFile
from backend.node.store.nvme_tier import NvmeTier
from backend.node.store.same_chunk import same_meta

__all__ = ["Demoter"]

DEMOTER_IDLE_S = 0.5
_PUT_ID_MASK = (1 << 64) - 1  # put marks are kept as 64-bit wire ids (``DramTier.put_of``)


class Demoter:
    """Moves chunks out of DRAM: on demand for a put, and in the background above the high watermark."""

    def __init__(
        self,
        dram: DramTier,
        nvme: NvmeTier | None,
        changes: IndexChanges,
        counters: Counter[NodeCounter],
        *,
        high_watermark: float,
        low_watermark: float,
    ) -> None:
        self.dram, self.nvme = dram, nvme
        self.changes, self.counters = changes, counters
        self.high_bytes = high_watermark * dram.capacity_bytes
        self.low_bytes = low_watermark * dram.capacity_bytes
        self.lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.nvme is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        """Start background demotion if DRAM is above the high watermark."""
        if self.nvme is not None and self.dram.used_bytes > self.high_bytes:
            self._wake.set()

    async def make_room(self, room: int, keep_put: int = 0) -> None:
        """Demote or evict chunks until ``room`` bytes fit, or nothing movable is left.

        Pinned chunks (leased, or landing: inserted by puts not committed yet) are in no
        eviction order, so they stay and are never walked past. A chunk of put ``keep_put``
        (the put asking for room) may go to NVMe but is never evicted: each stripe of a put
        answers for its own chunks, so one that evicted what another stripe had stored would
        have that one acknowledge a chunk that is gone.
        """
        async with self.lock:
            refused: set[str] = set()  # chunks of this put that the disk would not take
            while not self.dram.fits(room):
                key = self.dram.coldest(refused, keep_put=keep_put if self.nvme is None else 0)
                if key is None:
                    break
                if self.nvme is None:
                    self.evict(key)
                    continue
                victim = self.dram.peek(key)
                assert victim is not None
                if not keep_put or self.dram.put_of(key) != keep_put & _PUT_ID_MASK:
                    await self.demote(victim, evict_on_failure=True)
                    continue
                try:
                    await self.demote(victim)
                except CapacityError:
                    refused.add(key)

    async def demote(self, chunk: StoredChunk, *, evict_on_failure: bool = False) -> None:
        """Move a DRAM chunk to NVMe (or evict it with no NVMe tier). Caller holds the lock.

        With ``evict_on_failure`` (a put needs the room) a chunk the disk does not take
        is evicted instead; otherwise the CapacityError is raised.
        """
        key = chunk.meta.key
        if self.nvme is None:
            self.evict(key, chunk)
            return
        record = self.nvme.record(key)
        if record is None or not same_meta(record.meta, chunk.meta):
            try:
                written = await self._write(chunk)
            except CapacityError:
                if not evict_on_failure:
                    raise
                self.evict(key, chunk)
                return
            if written is None:
                return  # deleted or replaced while we wrote: nothing to move
            record = written
        if self.dram.is_current(chunk):
            self.dram.delete(key)
            self.changes.moved[key] = NVME
            self.counters[NodeCounter.DEMOTIONS] += 1
        elif key in self.dram and not self.dram.holds(key, chunk.meta.checksum, chunk.meta.fingerprint):
            self.nvme.forget(record)  # replaced by other bytes while we wrote

    async def save_copy(self, key: str) -> None:
        """Give ``key``'s DRAM chunk an NVMe file and keep it in DRAM too (a pinned chunk: the file outlives a
        restart); nothing to do without an NVMe tier, or when the file is there. CapacityError if the disk refuses."""
        if self.nvme is None:
            return
        async with self.lock:
            chunk = self.dram.peek(key)
            record = self.nvme.record(key)
            if chunk is not None and (record is None or not same_meta(record.meta, chunk.meta)):
                await self._write(chunk)

    def evict(self, key: str, chunk: StoredChunk | None = None) -> None:
        """Drop a DRAM chunk that has no other place (no NVMe tier, or the disk will not take it); with
        ``chunk``, only if that is still the copy held (a demotion awaited the disk meanwhile)."""
        if chunk is None or self.dram.is_current(chunk):
            self.dram.delete(key)
            self.changes.removed.add(key)
            self.counters[NodeCounter.EVICTIONS] += 1

    async def _write(self, chunk: StoredChunk) -> NvmeFile | None:
        """Write a DRAM chunk's file; None if the chunk was deleted or replaced meanwhile."""
        assert self.nvme is not None
        record = await self.nvme.write(chunk)
        if not self.dram.holds(chunk.meta.key, chunk.meta.checksum, chunk.meta.fingerprint) or not self.nvme.add(
            record
        ):
            await self.nvme.unlink(record.path)  # the bytes we wrote are no longer wanted
            return None
        self.counters[NodeCounter.NVME_WRITES] += 1
        return record

    async def _loop(self) -> None:
        """Keep DRAM below the high watermark, demoting down to the low one."""
        assert self.nvme is not None
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), DEMOTER_IDLE_S)
            except TimeoutError:
                pass
            self._wake.clear()
            if self.dram.used_bytes <= self.high_bytes or self.nvme.disk_full:
                continue  # nothing to do, or paused until the disk has room
            async with self.lock:
                while self.dram.used_bytes > self.low_bytes:
                    key = self.dram.coldest()
                    victim = self.dram.peek(key) if key is not None else None
                    if victim is None:
                        break
                    try:
                        await self.demote(victim)
                    except CapacityError:
                        break  # the disk refuses: puts will see CapacityError instead
