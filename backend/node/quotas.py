"""Tenant quotas on one node: a tenant's bytes held here stay within its quota; its own coldest chunks go first.

The quotas are the pool's (``kvpool quota set``, a hash in Redis) and a node reads them
at each heartbeat (``publisher.py``); the bytes are this node's (``ChunkTable.tenant_bytes``,
kept as chunks enter and leave: no field per chunk, the key says the tenant). The rule:

* A chunk of a tenant with a quota is taken only if the tenant's bytes held here, plus
  the bytes of this request's chunks of that tenant not landed yet, plus the chunk, fit
  the quota (:meth:`TenantQuotas.make_room`). If they do not, the tenant's own coldest
  chunks leave this node (both tiers), in the tier's eviction order, NVMe first (its
  chunks are colder than DRAM's), until they fit. Another tenant's chunk is never
  evicted for it: the walk passes over them.
* Chunks that may not move (leased, pinned, landing: in no eviction order) are never
  evicted for a quota: a tenant whose pinned bytes fill its quota gets no room, so it
  cannot pin past its quota (a pin holds bytes put under the quota).
* When nothing of the tenant can leave, the chunk is refused ``PUT_NO_ROOM`` (the put's
  chain is cut there, as for any refusal). A last check as the chunk lands
  (:meth:`TenantQuotas.fits`) refuses it if concurrent puts of the tenant filled the
  quota meanwhile, so the bytes held never pass it.

Cost: nothing for a chunk of no tenant or of a tenant without a quota but a dict
lookup; a victim costs the walk from the tier's coldest chunk past the colder chunks
of other tenants, at most :data:`MAX_QUOTA_WALK` slots a victim (a tenant whose
coldest chunk is further than that is refused rather than walked for).
The quota is per node: a tenant holds at most its quota on each node.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from itertools import islice

from backend.counters import NodeCounter
from backend.node.bookkeeping import ON_NVME, ChunkTable, IndexChanges
from backend.node.eviction import EvictionOrder
from backend.protocol import TenantReport
from backend.tenants import tenant_of

__all__ = ["MAX_QUOTA_WALK", "TenantQuotas"]

logger = logging.getLogger(__name__)

MAX_QUOTA_WALK = 100_000  # slots walked for one victim before the chunk is refused instead


class TenantQuotas:
    """Per-tenant quotas, bytes and counters of one node. Event loop only."""

    def __init__(
        self,
        table: ChunkTable,
        remove: Callable[[str], Awaitable[bool]],
        changes: IndexChanges,
        counters: Counter[NodeCounter],
    ) -> None:
        self.table = table
        self._remove = remove  # drop a key from every tier
        self._changes = changes
        self._counters = counters
        self.limits: dict[str, int] = {}  # tenant -> quota bytes (as Redis had them at the last heartbeat)
        self.puts: Counter[str] = Counter()  # tenant -> chunks stored (committed)
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()  # chunks evicted to keep the tenant within its quota

    def set_limits(self, limits: Mapping[str, int]) -> None:
        self.limits = dict(limits)

    def quota_of(self, key: str) -> tuple[str, int] | None:
        """``(tenant, quota bytes)`` of ``key`` when its tenant has a quota, else None."""
        tenant = tenant_of(key) if self.limits else None
        if tenant is None:
            return None
        limit = self.limits.get(tenant)
        return None if limit is None else (tenant, limit)

    def fits(self, key: str, nbytes: int) -> bool:
        """Whether ``key``'s chunk of ``nbytes`` may enter now within its tenant's quota (a replaced copy's bytes
        are counted as gone)."""
        quota = self.quota_of(key)
        if quota is None:
            return True
        tenant, limit = quota
        slot = self.table.slot(key)
        old = self.table.nbytes[slot] if slot >= 0 else 0
        return self.table.tenant_bytes[tenant] - old + nbytes <= limit

    async def make_room(self, key: str, nbytes: int, pending: int, keep_put: int) -> bool:
        """Evict the tenant's coldest chunks until ``key``'s ``nbytes`` (and ``pending`` bytes of the same
        request and tenant, not landed yet) fit its quota; False when they cannot (refuse the chunk)."""
        quota = self.quota_of(key)
        if quota is None:
            return True
        tenant, limit = quota
        if nbytes + pending > limit:
            return False
        while not self.fits(key, nbytes + pending):
            victim = self._coldest_of(tenant, key)
            if victim is None:
                return False
            if await self._remove(victim):
                self._changes.removed.add(victim)
                self._counters[NodeCounter.QUOTA_EVICTIONS] += 1
                self.evictions[tenant] += 1
        return True

    def _coldest_of(self, tenant: str, keep: str) -> str | None:
        """The key of ``tenant``'s first chunk to leave (by the tiers' orders), other than ``keep``."""
        orders = self.table.orders  # tier bit -> its eviction order: NVMe's (the colder tier) first
        for tier in sorted(orders, key=lambda bit: bit != ON_NVME):
            order = orders[tier]
            for key in islice(self._keys(order), MAX_QUOTA_WALK):
                if key != keep and tenant_of(key) == tenant:
                    return key
        return None

    def _keys(self, order: EvictionOrder) -> Iterator[str]:
        table = self.table
        for slot in order.coldest():
            yield table.key(slot)

    def reports(self) -> dict[str, TenantReport]:
        """What STAT (and /metrics) carries per tenant: every tenant with bytes here, a quota, or counts."""
        names = set(self.table.tenant_bytes) | set(self.limits) | set(self.puts) | set(self.hits) | set(self.misses)
        return {
            name: TenantReport(
                held_bytes=self.table.tenant_bytes.get(name, 0),
                quota_bytes=self.limits.get(name, -1),
                puts=self.puts[name],
                hits=self.hits[name],
                misses=self.misses[name],
                quota_evictions=self.evictions[name],
            )
            for name in sorted(names)
        }

    def count_read(self, key: str, hit: bool) -> None:
        """A GET of ``key`` hit or missed: counted for its tenant, if it has one."""
        tenant = tenant_of(key)
        if tenant is not None:
            (self.hits if hit else self.misses)[tenant] += 1

    def count_puts(self, keys: Iterator[str]) -> None:
        """Chunks of these keys were stored and committed: counted for their tenants."""
        for key in keys:
            tenant = tenant_of(key)
            if tenant is not None:
                self.puts[tenant] += 1
