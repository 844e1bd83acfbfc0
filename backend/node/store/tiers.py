"""Tier manager: the store's one door. DRAM in front of an optional NVMe tier, and every operation on them.

Each store operation is one call here, and the parts behind it own its rules:

* a put: room reserved in DRAM (demoting or evicting), a verified chunk inserted, an uncommitted
  one taken out again (``room.py``); a request's chunks received into that room (``intake.py``);
* a read: the layout check, the tenant's read count and the chain touch (``reads.py``) around a
  tier read, which reads an NVMe hit back and promotes it (``readback.py``);
* a delete; a move between tiers (``demotion.py``, which also keeps DRAM between its watermarks
  in the background); leases and pins (``leases.py``, ``pins.py``); tenant quotas (``quotas.py``).

The NVMe tier's files, its disk I/O and its disk-full episodes are ``nvme_tier.py``. A chunk under
a lease is pinned: neither demoted nor evicted until the lease ends; explicit deletes still remove
it from the index at once. DRAM chunks live in an arena, else in buffers of their own
(``chunk_memory.py``).

The manager never talks to Redis. Both tiers keep their chunks in one packed table
(``bookkeeping.ChunkTable``: a slot per key, no object per chunk), so the node counts
its keys in O(1) and pages through them in key order; the manager records which keys
this node stopped holding and which moved tier (:meth:`TierManager.take_changes`), and the
node's publisher sends them in batches. All disk I/O runs on worker threads; the event loop
never waits on a disk.

Memory: every chunk is counted at the room it occupies (``arena.room_of``: its cell,
or its pages), so ``--dram`` bounds the bytes, and the bookkeeping per chunk is bounded
and measured (docs/scale-node.md). A pinned chunk (under a lease, or landing) is out
of its tiers' eviction orders until it is unpinned, so finding a victim never walks
past pinned chunks: O(1) however many there are.

Nothing outside this package reaches past the manager into its table, orders, quotas or tiers
(tests/test_store_door.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from backend.counters import NodeCounter
from backend.node.memory.arena import Arena, ShmArena, room_of
from backend.node.memory.buffers import ChunkBuffer
from backend.node.store.bookkeeping import DRAM, NVME, ChunkTable, IndexChanges
from backend.node.store.chunk_memory import ARENA_MIN_SLACK_BYTES, ARENA_SLACK, PREFAULT_BUDGET_BYTES, ChunkMemory
from backend.node.store.demotion import Demoter
from backend.node.store.dram import DramTier, StoredChunk
from backend.node.store.eviction import order_named
from backend.node.store.intake import ChunkSource, Received, RoomAhead, take_request
from backend.node.store.landing import Landing
from backend.node.store.leases import LeaseTable
from backend.node.store.leasing import Leasing
from backend.node.store.nvme_tier import NvmeTier
from backend.node.store.pins import PinBook, PinTtl
from backend.node.store.quotas import TenantQuotas
from backend.node.store.readback import ReadBack
from backend.node.store.reads import Fetched, Reads
from backend.node.store.room import DramRoom, NewerThanDisk
from backend.node.store.upkeep import StoreUpkeep
from backend.protocol import ItemMeta
from backend.protocol.meta import NO_FINGERPRINT
from backend.protocol.reports import TierReport

__all__ = [
    "ARENA_MIN_SLACK_BYTES",
    "ARENA_SLACK",
    "DRAM",
    "NVME",
    "PREFAULT_BUDGET_BYTES",
    "Fetched",
    "TierConfig",
    "TierManager",
]


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
    """DRAM + NVMe for one node: the store's operations, one call each. Use from the node's event loop only."""

    def __init__(self, config: TierConfig, *, defer_memory: bool = False) -> None:
        self.config = config
        self.counters: Counter[NodeCounter] = Counter()
        table = self._table = ChunkTable(pinned=self._pinned)
        changes = self._changes = IndexChanges()
        self._memory = ChunkMemory(config.dram_bytes, config.shm_dir, config.prefault)
        self._dram = DramTier(config.dram_bytes, table, order=order_named(config.eviction))
        self._nvme: NvmeTier | None = None
        if config.nvme_dir and config.nvme_bytes:
            self._nvme = NvmeTier(
                config.nvme_dir,
                config.nvme_bytes,
                io_threads=config.io_threads,
                counters=self.counters,
                table=table,
                on_gone=self._gone_from_nvme,
                on_room=self._wake_demoter,
                order=order_named(config.eviction),
            )
            self._nvme.warn_if_larger_than_disk()  # at start: what it advertises is capped from now on
        self._leases = LeaseTable(on_pin=table.repin, on_unpinned=self._wake_demoter)
        self._demoter = Demoter(
            self._dram,
            self._nvme,
            changes,
            self.counters,
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
        )
        self._quotas = TenantQuotas(table, self.delete, changes, self.counters, self._dram.put_of)  # by tenant
        self._landing = Landing(on_pin=table.repin)  # chunks of puts not committed yet, and the puts waiting for room
        self._newer = NewerThanDisk()
        self._room = DramRoom(
            table, self._dram, self._nvme, self._demoter, self._landing, changes, self._newer, self._memory
        )
        self._readback = ReadBack(self._dram, self._nvme, self._room, changes, self.counters)
        self._reads = Reads(table, self._readback.get, self._quotas, self._leases, self._memory)
        self.leasing = Leasing(self._reads, self._leases)  # LEASE, RELEASE, a connection's end, a tool's lock
        # What the node's index side and its statistics ask: changes, NVMe recovery, quotas, the report.
        self.upkeep = StoreUpkeep(
            changes,
            self._newer,
            self._nvme,
            self._quotas,
            self._leases,
            self._memory,
            self.counters,
            self.tier_reports,
            self.__len__,
        )
        if not defer_memory:
            self.take_memory()

    # -- lifecycle --------------------------------------------------------------------
    def take_memory(self) -> Arena | None:
        """Make the DRAM arena and the private buffers (``chunk_memory.py``), and answer the arena: a node does it
        once Redis and its id are checked (``defer_memory``; ``startup.py``), so a start that fails before costs no
        memory."""
        arena = self._memory.take()
        self._dram.use_arena(arena)
        return arena

    def start(self) -> None:
        self._demoter.start()

    async def close(self) -> None:
        await self._demoter.close()
        if self._nvme is not None:
            await self._nvme.close()
        self._memory.close()

    def pin_book(self, ttl: PinTtl) -> PinBook:
        """The node's pins over this store's leases (``pins.py``), kept in the NVMe directory when there is one."""
        nvme = self._nvme
        return PinBook(self._leases, self._table, ttl, nvme.root if nvme else None, save_copy=self._demoter.save_copy)

    # -- what it holds ----------------------------------------------------------------
    @property
    def shm_arena(self) -> ShmArena | None:
        """The arena same-host clients may map (published in the registry), if DRAM is in one."""
        return self._memory.shm_arena

    @property
    def nvme_root(self) -> Path | None:
        """The NVMe tier's directory; None: no NVMe tier."""
        return self._nvme.root if self._nvme is not None else None

    @property
    def capacity_bytes(self) -> int:
        """What the node advertises: its DRAM and what its disk can hold of its NVMe size (``NvmeTier.advertised_bytes``)."""
        return self._dram.capacity_bytes + (self._nvme.advertised_bytes if self._nvme else 0)

    @property
    def dram_capacity_bytes(self) -> int:
        return self._dram.capacity_bytes

    @property
    def dram_used_bytes(self) -> int:
        """DRAM reserved and held (``room_of`` each chunk)."""
        return self._dram.used_bytes

    @property
    def used_bytes(self) -> int:
        return self._dram.used_bytes + (self._nvme.used_bytes if self._nvme else 0)

    @property
    def disk_full(self) -> bool:
        return self._nvme is not None and self._nvme.disk_full

    room_of = staticmethod(room_of)  # the DRAM a chunk of N bytes occupies, is reserved and counted at

    def __len__(self) -> int:
        """Keys held in any tier (O(1): the heartbeat asks every second)."""
        return len(self._table)

    def contains(self, key: str) -> bool:
        return key in self._table

    def tier_of(self, key: str) -> str | None:
        return self._table.tier_of(key)

    def meta_of(self, key: str) -> ItemMeta | None:
        return self._table.meta_of(key)

    def keys(self) -> list[str]:
        """Every key held, in any tier."""
        return self._table.all()

    def page(self, after: str, limit: int) -> tuple[list[tuple[ItemMeta, str]], bool]:
        """Up to ``limit`` chunks with keys after ``after``, in key order, and whether more follow."""
        keys, more = self._table.page(after, limit)
        return [self._table.chunk(self._table.slot(key)) for key in keys], more

    # -- reports ----------------------------------------------------------------------
    def tier_reports(self) -> dict[str, TierReport]:
        """Each tier's size and what it holds (STAT, the registry entry)."""
        dram = self._dram
        tiers = {DRAM: TierReport(capacity_bytes=dram.capacity_bytes, used_bytes=dram.used_bytes, objects=len(dram))}
        if self._nvme is not None:
            tiers[NVME] = self._nvme.report()
        return tiers

    # -- a put ------------------------------------------------------------------------
    async def take(
        self, items: Sequence[ItemMeta], ahead: RoomAhead, source: ChunkSource, *, put_id: int, until: float
    ) -> Received:
        """A request's chunks into reserved DRAM, verified (``intake.py``): a PUT outcome per item. No tenant's
        quota evicts the put's own chunks for it; if the request fails, nothing of it stays."""
        return await take_request(self._room, self._quotas, items, ahead, source, put_id=put_id, until=until)

    def committed(self, chain: Sequence[str], stored: Iterable[str]) -> None:
        """A put's index commit landed: its batch (``chain``, in prefix order) was used, and ``stored`` count as its
        tenants' puts."""
        self._table.touch_chain(chain, read=False)
        self._quotas.count_puts(iter(stored))

    async def drop_uncommitted(self, chunks: list[StoredChunk]) -> None:
        """The chunks of a put that will not be committed leave the tiers (unless a newer put replaced them)."""
        await self._room.drop_uncommitted(chunks)

    def take_buffer(self, nbytes: int, *, shared: bool = True) -> ChunkBuffer:
        return self._memory.take_buffer(nbytes, shared=shared)

    async def reserve(self, room: int, *, put_id: int = 0) -> None:
        """Reserve ``room`` bytes of DRAM for put ``put_id`` (``DramRoom.reserve``)."""
        await self._room.reserve(room, put_id=put_id)

    def release(self, room: int) -> None:
        self._room.release(room)

    def insert(self, chunk: StoredChunk, put_id: int = 0) -> None:
        """Store a verified chunk of put ``put_id`` (0: none) in reserved DRAM (``DramRoom.insert``)."""
        self._room.insert(chunk, put_id)

    def holds(self, key: str, item_checksum: int, fingerprint: int = NO_FINGERPRINT) -> bool:
        return self._room.holds(key, item_checksum, fingerprint)

    async def discard(self, chunk: StoredChunk) -> None:
        await self._room.discard(chunk)

    def settle(self, chunks: list[StoredChunk]) -> None:
        """The puts that inserted ``chunks`` committed, gave up, or wait: the chunks may move now."""
        self._landing.settle(chunks)

    def wake_waiters(self) -> None:
        """Room may have come for the puts waiting for it."""
        self._landing.wake()

    # -- a read -----------------------------------------------------------------------
    async def read(self, keys: Sequence[str], fingerprint: int | None, max_bytes: int) -> Fetched:
        """A GET's keys for a reader of ``fingerprint``, within ``max_bytes`` of data (``Reads.fetch``)."""
        return await self._reads.fetch(keys, fingerprint, max_bytes)

    async def get(self, key: str) -> StoredChunk | None:
        """The chunk from DRAM, or read back (verified) from NVMe and promoted; None if not held."""
        return await self._readback.get(key)

    async def verify(self, key: str) -> str:
        """Re-check this node's copy of ``key``: "ok", "missing" or "corrupt" (then dropped)."""
        return await self._readback.verify(key)

    def touch_chains(self, chains: Iterable[Sequence[str]]) -> None:
        """Chains a client's lookups found, each touched as one batch; keys not held are skipped."""
        for chain in chains:
            self._table.touch_chain(chain)

    # -- a delete ---------------------------------------------------------------------
    async def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier; whether it was held."""
        self._newer.note(key)
        found = self._dram.delete(key)
        self._landing.wake()
        if self._nvme is not None:
            record = self._nvme.remove(key)
            if record is not None:
                found = True
                await self._nvme.unlink(record.path)
        return found

    async def delete_keys(self, keys: Sequence[str]) -> list[str]:
        """DELETE_BATCH: remove ``keys``; those that were held, their index entries due with the next flush."""
        deleted = [key for key in keys if await self.delete(key)]
        self._changes.put_back(set(deleted), {})
        return deleted

    # -- parts' callbacks -------------------------------------------------------------
    def _wake_demoter(self) -> None:
        self._landing.wake()  # unpinned chunks may move now
        self._demoter.wake()

    def _gone_from_nvme(self, key: str) -> None:
        if key not in self._dram:
            self._changes.removed.add(key)  # the node no longer holds it anywhere

    def _pinned(self, key: str) -> bool:
        """Whether a lease or a landing put holds ``key`` (its chunk then stays out of the eviction orders)."""
        return key in self._leases.pinned or key in self._landing.keys
