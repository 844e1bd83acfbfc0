"""Tier manager: DRAM in front of an optional NVMe tier; what a put, a get and a delete do to them.

* A put reserves DRAM space. If DRAM is full, its least recently used chunks are
  demoted to NVMe (or, with no NVMe tier, evicted) until the chunk fits
  (``demotion.py``, which also keeps DRAM between its watermarks in the background).
  A put never evicts its own chunks. A DRAM tier full of other puts in flight gives
  the put BusyError (the put path waits for them to land, until its deadline:
  ``intake.py``); one full of leased chunks and the put's own gives it CapacityError.
* The NVMe tier's files, its disk I/O and its disk-full episodes are ``nvme_tier.py``.
* A hit on NVMe is read back in a worker thread, verified, and promoted to DRAM;
  the file stays, so a later demotion of the same chunk costs nothing.
* A file whose checksum fails is moved to ``quarantine/`` and reads as a miss.
* A chunk under a lease (``leases.py``) is pinned: neither demoted nor evicted until
  the lease ends. Explicit deletes still remove it from the index at once.
* DRAM chunks live in an arena (``arena.py``): shared memory, so clients on this host
  can copy them without a socket, or private memory without one. When the arena has no
  room (or a chunk is larger than a connection's window, see ``intake.py``), a chunk
  lives in a buffer of its own and is served over TCP.

The manager never talks to Redis. Both tiers keep their chunks in one packed table
(``bookkeeping.ChunkTable``: a slot per key, no object per chunk), so the node counts
its keys in O(1) and pages through them in key order; ``changes`` records which keys
this node stopped holding and which moved tier, and the node's publisher sends them in
batches. All disk I/O runs on worker threads; the event loop never waits on a disk.

Memory: every chunk is counted at the room it occupies (``arena.room_of``: its cell,
or its pages), so ``--dram`` bounds the bytes, and the bookkeeping per chunk is bounded
and measured (docs/scale-node.md). A pinned chunk (under a lease, or landing) is out
of its tiers' eviction orders until it is unpinned, so finding a victim never walks
past pinned chunks: O(1) however many there are.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from backend.counters import NodeCounter
from backend.errors import BusyError, CapacityError, IntegrityError
from backend.node.memory.arena import Arena, PrivateArena, ShmArena, remove_stale_arenas, room_of
from backend.node.memory.buffers import BufferFactory, ChunkBuffer
from backend.node.store.bookkeeping import DRAM, NVME, ChunkTable, IndexChanges
from backend.node.store.demotion import Demoter
from backend.node.store.dram import DramTier, StoredChunk
from backend.node.store.eviction import order_named
from backend.node.store.landing import Landing
from backend.node.store.leases import LeaseTable
from backend.node.store.nvme_format import NvmeFile
from backend.node.store.nvme_tier import NvmeTier
from backend.node.store.quotas import TenantQuotas
from backend.node.store.same_chunk import same_meta, slot_holds
from backend.protocol import ItemMeta, checksum
from backend.protocol.meta import NO_FINGERPRINT
from backend.protocol.reports import TierReport

__all__ = ["TierConfig", "TierManager", "DRAM", "NVME"]

logger = logging.getLogger(__name__)

PREFAULT_BUDGET_BYTES = 256 * 1024 * 1024  # ready, pre-faulted buffers (see buffers.py)
ARENA_SLACK = 0.25  # arena room beyond DRAM for regions still held by leases or replies in flight
ARENA_MIN_SLACK_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TierConfig:
    dram_bytes: int
    nvme_dir: Path | None = None
    nvme_bytes: int = 0
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    io_threads: int = 4
    shm_dir: Path | None = None  # where the shared-memory arena lives; None: the arena is private memory
    prefault: bool = False  # the arena's pages are taken at start (else as chunks need them)
    eviction: str = "lru"  # each tier's eviction order (``eviction.ORDERS``)

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")


class TierManager:
    """DRAM + NVMe for one node. Use from the node's event loop only."""

    def __init__(self, config: TierConfig, *, defer_memory: bool = False) -> None:
        self.config = config
        self.counters: Counter[NodeCounter] = Counter()
        self.table = ChunkTable(pinned=self._pinned)
        self.changes = IndexChanges()
        self.arena: Arena | None = None  # where DRAM chunks live (take_memory); None: each its own buffer
        self.buffers = BufferFactory(0)  # private buffers (take_memory)
        self.dram = DramTier(config.dram_bytes, self.table, order=order_named(config.eviction))
        self.nvme: NvmeTier | None = None
        if config.nvme_dir and config.nvme_bytes:
            self.nvme = NvmeTier(
                config.nvme_dir,
                config.nvme_bytes,
                io_threads=config.io_threads,
                counters=self.counters,
                table=self.table,
                on_gone=self._gone_from_nvme,
                on_room=self._wake_demoter,
                order=order_named(config.eviction),
            )
        self.leases = LeaseTable(on_pin=self.table.repin, on_unpinned=self._wake_demoter)
        self.demoter = Demoter(
            self.dram,
            self.nvme,
            self.changes,
            self.counters,
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
        )
        self.quotas = TenantQuotas(self.table, self.delete, self.changes, self.counters, self.dram.put_of)  # by tenant
        # Chunks of puts not committed yet, and the puts waiting for room.
        self.landing = Landing(on_pin=self.table.repin)
        self.recovering: set[str] | None = None  # while NVMe recovery runs: the keys stored or deleted since
        if not defer_memory:
            self.take_memory()

    def take_memory(self) -> None:
        """Make the DRAM arena and the private buffers (``_take_memory``): a node does it once Redis and its id
        are checked (``defer_memory``; ``startup.py``), so a start that fails before costs no memory."""
        self.arena, self.buffers = _take_memory(self.config)
        self.dram.use_arena(self.arena)

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self.demoter.start()

    async def close(self) -> None:
        await self.demoter.close()
        if self.nvme is not None:
            await self.nvme.close()
        self.buffers.close()
        if self.arena is not None:
            self.arena.close()

    @property
    def shm_arena(self) -> ShmArena | None:
        """The arena same-host clients may map (published in the registry), if DRAM is in one."""
        return self.arena if isinstance(self.arena, ShmArena) else None

    @property
    def held(self) -> ChunkTable:
        """Every key held, in any tier: counted, listed (``all()``) and paged in key order."""
        return self.table

    def load_nvme(self, records: Iterable[NvmeFile]) -> list[NvmeFile]:
        """Adopt files found by recovery, oldest first (so eviction order follows file age); returns those adopted.

        Recovery runs while the node serves (``recovery.py``), handing files over in batches
        (``NvmeTier.load``: cheap per record): a key this run stored or deleted since it began
        (``recovering``), or holds now, is newer than any file of it found on disk, which is not adopted.
        """
        assert self.nvme is not None
        newer = self.recovering if self.recovering is not None else ()
        return self.nvme.load(r for r in records if r.meta.key not in newer)

    def _wake_demoter(self) -> None:
        self.landing.wake()  # unpinned chunks may move now
        self.demoter.wake()

    def _gone_from_nvme(self, key: str) -> None:
        if key not in self.dram:
            self.changes.removed.add(key)  # the node no longer holds it anywhere

    def _pinned(self, key: str) -> bool:
        """Whether a lease or a landing put holds ``key`` (its chunk then stays out of the eviction orders)."""
        return key in self.leases.pinned or key in self.landing.keys

    @property
    def capacity_bytes(self) -> int:
        return self.dram.capacity_bytes + (self.nvme.capacity_bytes if self.nvme else 0)

    @property
    def used_bytes(self) -> int:
        return self.dram.used_bytes + (self.nvme.used_bytes if self.nvme else 0)

    @property
    def disk_full(self) -> bool:
        return self.nvme is not None and self.nvme.disk_full

    room_of = staticmethod(room_of)  # the DRAM a chunk of N bytes occupies, is reserved and counted at

    def __len__(self) -> int:
        """Keys held in any tier (O(1): the heartbeat asks every second)."""
        return len(self.table)

    def contains(self, key: str) -> bool:
        return key in self.table

    def tier_of(self, key: str) -> str | None:
        return self.table.tier_of(key)

    def meta_of(self, key: str) -> ItemMeta | None:
        return self.table.meta_of(key)

    def page(self, after: str, limit: int) -> tuple[list[tuple[ItemMeta, str]], bool]:
        """Up to ``limit`` chunks with keys after ``after``, in key order, and whether more follow."""
        keys, more = self.table.page(after, limit)
        return [self.table.chunk(self.table.slot(key)) for key in keys], more

    def tier_reports(self) -> dict[str, TierReport]:
        """Each tier's size and what it holds (STAT, the registry entry)."""
        tiers = {
            DRAM: TierReport(
                capacity_bytes=self.dram.capacity_bytes, used_bytes=self.dram.used_bytes, objects=len(self.dram)
            )
        }
        if self.nvme is not None:
            tiers[NVME] = self.nvme.report()
        return tiers

    # -- put path ---------------------------------------------------------------------
    def take_buffer(self, nbytes: int, *, shared: bool = True) -> ChunkBuffer:
        """A buffer for a chunk entering DRAM: in the arena when it has room (and ``shared``), else private."""
        if shared and self.arena is not None:
            buffer = self.arena.alloc(nbytes)
            if buffer is not None:
                return buffer
        return self.buffers.take(nbytes)

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
        if room > self.dram.capacity_bytes:
            raise CapacityError(
                f"chunk of {room} bytes is larger than the DRAM tier ({self.dram.capacity_bytes} bytes)"
            )
        if not self.dram.fits(room):
            await self.demoter.make_room(room, keep_put=put_id)
        if not self.dram.fits(room):
            if self.dram.used_bytes <= self.dram.stored_bytes and not self.landing.nbytes:
                raise CapacityError("DRAM tier is full of leased chunks and this put's own")
            raise BusyError("DRAM tier is full of puts in flight")
        self.dram.reserve(room)
        self.demoter.wake()

    async def wait_for_room(self, until: float) -> bool:
        """Wait until DRAM may have room for a put: a reservation landed or was given back, a put committed
        or gave up, a chunk left or was unpinned, or room ahead of a put's bytes was given back (the
        demoter's lock is not held meanwhile). False once the loop time ``until`` passed."""
        return await self.landing.wait_for_room(until)

    def wake_waiters(self) -> None:
        """Room may have come for the puts in :meth:`wait_for_room`."""
        self.landing.wake()

    def settle(self, chunks: list[StoredChunk]) -> None:
        """The puts that inserted ``chunks`` committed, gave up, or wait: the chunks may move now."""
        self.landing.settle(chunks)

    def release(self, room: int) -> None:
        """Give back ``room`` bytes reserved by :meth:`reserve` (the chunk did not come, or is not kept)."""
        self.dram.release(room)
        self.landing.wake()

    def insert(self, chunk: StoredChunk, put_id: int = 0) -> None:
        """Store a verified chunk of put ``put_id`` (0: none) in reserved DRAM; an NVMe copy with other
        bytes is dropped first. A put's chunk is not moved until the put settles it (``settle``)."""
        if self.nvme is not None:
            old = self.nvme.record(chunk.meta.key)
            if old is not None and not same_meta(old.meta, chunk.meta):
                self.nvme.forget(old)
        self.dram.insert(chunk, put_id)
        if self.recovering is not None:
            self.recovering.add(chunk.meta.key)
        if put_id:  # a put's chunk: it stays until ``settle``
            self.landing.add(chunk)
        self.landing.wake()

    def claim(self, key: str, put_id: int) -> None:
        """A put found ``key`` already held with its bytes: that put will not evict it either."""
        self.dram.claim(key, put_id)

    def holds(self, key: str, item_checksum: int, fingerprint: int = NO_FINGERPRINT) -> bool:
        """Whether this node holds ``key`` with these bytes and layout fingerprint (DRAM or NVMe: both the same)."""
        return slot_holds(self.table, self.table.slot(key), item_checksum, fingerprint)

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
        if not self.contains(key):
            self.changes.removed.add(key)  # an older committed copy may have been displaced

    # -- get path ---------------------------------------------------------------------
    async def get(self, key: str) -> StoredChunk | None:
        """The chunk from DRAM, or read back (verified) from NVMe and promoted; None if not held."""
        chunk = self.dram.get(key)
        if chunk is not None or self.nvme is None:
            return chunk
        record = self.nvme.touch(key)
        if record is None:
            return None
        nbytes = record.meta.nbytes
        room = room_of(nbytes)
        try:
            await self.reserve(room)
            promote = True
        except CapacityError:
            promote = False  # serve from disk without keeping a DRAM copy
        buffer = self.take_buffer(nbytes) if promote else self.buffers.take(nbytes)
        try:
            await self.nvme.read(record, buffer)
        except (IntegrityError, OSError) as exc:
            if promote:
                self.release(room)
            if self.nvme.is_current(record):  # not if a newer file replaced it meanwhile
                await self.nvme.quarantine(record, exc)
            return None
        if not self.nvme.is_current(record):
            # Deleted, or replaced by other bytes, while we read: what we hold is history.
            if promote:
                self.release(room)
            return None
        chunk = StoredChunk(record.meta, buffer)
        if promote:
            if key not in self.dram:
                self.dram.insert(chunk)
                self.changes.moved[key] = DRAM
                self.counters[NodeCounter.PROMOTIONS] += 1
            else:  # a put of the same key landed while we read
                self.release(room)
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
            await self.nvme.read(record, self.buffers.take(record.meta.nbytes))
        except (IntegrityError, OSError) as exc:
            await self.nvme.quarantine(record, exc)
            return "corrupt"
        return "ok"

    async def delete(self, key: str) -> bool:
        if self.recovering is not None:
            self.recovering.add(key)
        found = self.dram.delete(key)
        self.landing.wake()
        if self.nvme is not None:
            record = self.nvme.remove(key)
            if record is not None:
                found = True
                await self.nvme.unlink(record.path)
        return found


def _take_memory(config: TierConfig) -> tuple[Arena | None, BufferFactory]:
    """The DRAM arena (``_open_arena``) and the private buffers, pre-faulted: for every chunk when there is
    no arena (else only for the chunks that do not go into it, which are few: no pool kept ready for them)."""
    arena = _open_arena(config)
    prefault = 0 if arena is not None else min(PREFAULT_BUDGET_BYTES, config.dram_bytes // 4)
    return arena, BufferFactory(prefault)


def _open_arena(config: TierConfig) -> Arena | None:
    """The arena for DRAM: shared memory, else private (its pages taken at start with prefault, else as
    chunks are written); None (logged) when even a private one cannot be mapped."""
    size = config.dram_bytes + max(int(config.dram_bytes * ARENA_SLACK), ARENA_MIN_SLACK_BYTES)
    if config.shm_dir is not None:
        stale = remove_stale_arenas(config.shm_dir)
        if stale:
            logger.info("removed %d shared-memory arena(s) of nodes that no longer run", stale)
        try:
            return ShmArena(config.shm_dir, size)
        except OSError as exc:
            logger.warning(
                "no shared-memory arena in %s (%s): same-host clients read over TCP",
                config.shm_dir,
                exc.strerror or exc,
            )
    try:
        return PrivateArena(size, populate=config.prefault)
    except OSError as exc:
        logger.warning("no private arena of %d bytes (%s): each chunk is a buffer of its own", size, exc.strerror)
        return None
