"""DRAM -> NVMe: which chunks leave DRAM, and where they go.

* When a put needs room, the least recently used unpinned DRAM chunks are demoted to
  NVMe (or, with no NVMe tier, evicted) until it fits; a chunk the disk will not take
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
from collections.abc import Container

from backend.errors import CapacityError
from backend.node.bookkeeping import NVME, IndexChanges
from backend.node.dram import DramTier, StoredChunk
from backend.node.leases import LeaseTable
from backend.node.nvme_format import NvmeFile
from backend.node.nvme_tier import NvmeTier

__all__ = ["Demoter"]

DEMOTER_IDLE_S = 0.5


class Demoter:
    """Moves chunks out of DRAM: on demand for a put, and in the background above the high watermark."""

    def __init__(
        self,
        dram: DramTier,
        nvme: NvmeTier | None,
        leases: LeaseTable,
        changes: IndexChanges,
        counters: Counter[str],
        *,
        high_watermark: float,
        low_watermark: float,
    ) -> None:
        self.dram, self.nvme, self.leases = dram, nvme, leases
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

    async def make_room(self, nbytes: int, keep_put: int = 0, landing: Container[str] = ()) -> None:
        """Demote or evict chunks until ``nbytes`` fit, or nothing movable is left.

        Pinned chunks and ``landing`` ones (inserted by puts not committed yet) stay. A
        chunk of put ``keep_put`` (the put asking for room) may go to NVMe but is never
        evicted: each stripe of a put answers for its own chunks, so one that evicted what
        another stripe had stored would have that one acknowledge a chunk that is gone.
        """
        async with self.lock:
            refused: set[str] = set()  # chunks of this put that the disk would not take
            skip = _AnyOf(self.leases.pinned, landing, refused)
            while not self.dram.fits(nbytes):
                victim = self.dram.oldest(skip, keep_put=keep_put if self.nvme is None else 0)
                if victim is None:
                    break
                if not keep_put or self.dram.put_of(victim.meta.key) != keep_put:
                    await self.demote(victim, evict_on_failure=True)
                    continue
                try:
                    await self.demote(victim)
                except CapacityError:
                    refused.add(victim.meta.key)

    async def demote(self, chunk: StoredChunk, *, evict_on_failure: bool = False) -> None:
        """Move a DRAM chunk to NVMe (or evict it with no NVMe tier). Caller holds the lock.

        With ``evict_on_failure`` (a put needs the room) a chunk the disk does not take
        is evicted instead; otherwise the CapacityError is raised.
        """
        key = chunk.meta.key
        if self.nvme is None:
            self.evict(chunk)
            return
        record = self.nvme.files.get(key)
        if record is None or record.meta.checksum != chunk.meta.checksum:
            try:
                written = await self._write(chunk)
            except CapacityError:
                if not evict_on_failure:
                    raise
                self.evict(chunk)
                return
            if written is None:
                return  # deleted or replaced while we wrote: nothing to move
            record = written
        if self.dram.peek(key) is chunk:
            self.dram.delete(key)
            self.changes.moved[key] = NVME
            self.counters["demotions"] += 1
        elif (current := self.dram.peek(key)) is not None and current.meta.checksum != chunk.meta.checksum:
            self.nvme.forget(record)  # replaced by other bytes while we wrote

    def evict(self, chunk: StoredChunk) -> None:
        """Drop a DRAM chunk that has no other place (no NVMe tier, or the disk will not take it)."""
        if self.dram.peek(chunk.meta.key) is chunk:
            self.dram.delete(chunk.meta.key)
            self.changes.removed.add(chunk.meta.key)
            self.counters["evictions"] += 1

    async def _write(self, chunk: StoredChunk) -> NvmeFile | None:
        """Write a DRAM chunk's file; None if the chunk was deleted or replaced meanwhile."""
        assert self.nvme is not None
        record = await self.nvme.write(chunk, self.leases.pinned)
        current = self.dram.peek(chunk.meta.key)
        if current is None or current.meta.checksum != chunk.meta.checksum:
            await self.nvme.unlink(record.path)  # the bytes we wrote are no longer wanted
            return None
        self.nvme.add(record)
        self.counters["nvme_writes"] += 1
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
                    victim = self.dram.oldest(self.leases.pinned)
                    if victim is None:
                        break
                    try:
                        await self.demote(victim)
                    except CapacityError:
                        break  # the disk refuses: puts will see CapacityError instead


class _AnyOf:
    """Keys in any of several containers (without copying them)."""

    def __init__(self, *parts: Container[str]) -> None:
        self.parts = parts

    def __contains__(self, key: object) -> bool:
        return any(key in part for part in self.parts)
