"""A client's read of the store: the layout check, the tenant's read count and the chain touch, around each tier read.

A GET (over TCP or the channel) and a mapped LEASE read alike (:meth:`Reads.fetch`, :meth:`Reads.lease`):

* A chunk stored with another layout fingerprint than the reader's is OtherLayout and its bytes
  are never read: looked at before the tier read (from its table row, so such a chunk is not
  promoted from NVMe) and after it (a put may have replaced it meanwhile) (docs/protocol.md,
  "Layout fingerprints"). A reader naming none (None: an older client) reads chunks stored with none.
* Each key read counts as a hit or a miss of its tenant (``quotas.py``).
* The batch's keys, in prefix order, are touched as one chain (``EvictionOrder.touch_chain``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Hashable, Sequence

from backend.node.store.bookkeeping import NO_SLOT, ChunkTable
from backend.node.store.chunk_memory import ChunkMemory
from backend.node.store.dram import StoredChunk
from backend.node.store.leases import LeaseTable
from backend.node.store.quotas import TenantQuotas
from backend.protocol import ItemMeta
from backend.protocol.meta import ANY_FINGERPRINT, NO_FINGERPRINT, OtherLayout
from backend.protocol.reads import NO_OFFSET

__all__ = ["Fetched", "Leased", "Reads"]


@dataclasses.dataclass(frozen=True)
class Fetched:
    """What a read of a batch found, key by key: its meta (a hit), OtherLayout, or None (a miss); and the hits' chunks,
    in order."""

    found: list[ItemMeta | OtherLayout | None]
    chunks: list[StoredChunk]
    over_limit: int = 0  # chunks held but answered as misses: the reply's data limit was reached


@dataclasses.dataclass(frozen=True)
class Leased:
    """A lease taken (``lease_id``; 0: none, nothing held) and, key by key, what it holds: the chunk's meta and its
    offset in the shared arena (NO_OFFSET: none), OtherLayout, or None (not held)."""

    lease_id: int
    found: list[tuple[ItemMeta, int] | OtherLayout | None]


class Reads:
    """The store's reads for clients (GET, CHANNEL_GET, LEASE)."""

    def __init__(
        self,
        table: ChunkTable,
        get: Callable[[str], Awaitable[StoredChunk | None]],
        quotas: TenantQuotas,
        leases: LeaseTable,
        memory: ChunkMemory,
    ) -> None:
        self.table = table
        self.get = get  # a tier read: an NVMe hit is promoted (``ReadBack.get``)
        self.quotas = quotas
        self.leases = leases
        self.memory = memory

    async def fetch(self, keys: Sequence[str], fingerprint: int | None, max_bytes: int) -> Fetched:
        """Each key's chunk for a reader of ``fingerprint``, within ``max_bytes`` of data in all: keys past it are
        misses (``over_limit``), which the client reads again."""
        found: list[ItemMeta | OtherLayout | None] = []
        chunks: list[StoredChunk] = []
        over_limit = 0
        budget = max_bytes
        for key in keys:
            chunk = await self.one(key, fingerprint)
            if isinstance(chunk, OtherLayout):
                self.quotas.count_read(key, hit=False)
                found.append(chunk)
                continue
            if chunk is not None and chunk.meta.nbytes > budget:
                over_limit += 1
                chunk = None
            self.quotas.count_read(key, hit=chunk is not None)
            if chunk is None:
                found.append(None)
            else:
                found.append(chunk.meta)
                chunks.append(chunk)
                budget -= chunk.meta.nbytes
        self.table.touch_chain(keys)  # read as one chain, in prefix order (the eviction order links and touches it)
        return Fetched(found, chunks, over_limit)

    async def lease(
        self, keys: Sequence[str], fingerprint: int | None, ttl_ms: int, owner: Hashable, *, mapped: bool
    ) -> Leased:
        """Pin the keys this node holds for ``owner`` for ``ttl_ms``; ``mapped``: read them too (an NVMe hit is
        promoted into the arena) and answer their arena offsets.

        A mapped read is a GET whose bytes the client copies itself: the lease holds the
        chunk object, so its region outlives a concurrent delete or eviction, and only a
        chunk of the reader's layout is read. Without ``mapped`` this is a lock only: it
        pins whatever is held, nothing moves, so it never waits.
        """
        found: list[tuple[ItemMeta, int] | OtherLayout | None] = []
        held: list[str] = []
        chunks: list[StoredChunk] = []
        arena = self.memory.shm_arena  # a private arena's offsets mean nothing to a client
        for key in keys:
            if mapped:
                chunk = await self.one(key, fingerprint)
                self.quotas.count_read(key, hit=chunk is not None and not isinstance(chunk, OtherLayout))
                if chunk is None or isinstance(chunk, OtherLayout):
                    found.append(chunk)
                    continue
                offset = arena.offset_of(chunk.buffer) if arena is not None else None
                found.append((chunk.meta, NO_OFFSET if offset is None else offset))
                chunks.append(chunk)
            else:
                item = self.table.meta_of(key)
                found.append(None if item is None else (item, NO_OFFSET))
                if item is None:
                    continue
            held.append(key)
        self.table.touch_chain(held)  # a lease is taken to read: the chain was used
        lease_id = self.leases.grant(held, chunks, ttl_ms, owner=owner) if held else 0
        return Leased(lease_id, found)

    async def one(self, key: str, fingerprint: int | None) -> StoredChunk | OtherLayout | None:
        """``key``'s chunk for a reader of ``fingerprint`` (an NVMe hit is promoted), OtherLayout when it is stored
        with another one (looked at before the tier read, so such a chunk is not promoted, and after), or None."""
        if fingerprint != ANY_FINGERPRINT:  # the stored fingerprint from its table row, no ItemMeta built
            slot = self.table.slot(key)
            other = _other_layout(key, None if slot == NO_SLOT else self.table.fingerprint(slot), fingerprint)
            if other is not None:
                return other
        chunk = await self.get(key)
        if chunk is None:
            return None
        return _other_layout(key, chunk.meta.fingerprint, fingerprint) or chunk


def _other_layout(key: str, stored: int | None, fingerprint: int | None) -> OtherLayout | None:
    """OtherLayout if ``key`` is stored with another layout fingerprint (``stored``; None: not held) than the reader's
    (``fingerprint``; None: an older client's read, which names none), else None."""
    if stored is None or fingerprint == ANY_FINGERPRINT:
        return None
    if stored == (NO_FINGERPRINT if fingerprint is None else fingerprint):
        return None
    return OtherLayout(key)
