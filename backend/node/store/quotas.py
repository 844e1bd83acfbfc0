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
* Nor are the chunks of the put that needs the room: every chunk a request of that put
  names, while any request of the put runs here (:meth:`TenantQuotas.guard`; the stripes
  of one client put share its id), and the chunks in DRAM that the put stored or found
  already (the tier's mark, ``DramTier.put_of``: a later frame of the put, after an
  earlier one committed). A chain the node partly holds is thus never cut by its own
  put, wherever its held chunks are (DRAM or NVMe, moved by the demoter at any time):
  the names, not the tier, say what is the put's. A request's names become a set only
  when a quota first evicts for it. A request of the put that has not reached the node yet
  (another stripe, a later frame) is not known: its held chunks may still go.
* When nothing of the tenant can leave, the chunk is refused ``PUT_NO_ROOM`` (the put's
  chain is cut there, as for any refusal). A last check as the chunk lands
  (:meth:`TenantQuotas.fits`) refuses it if concurrent puts of the tenant filled the
  quota meanwhile, so the bytes held never pass it.

Two scopes, both applying where a tenant has both (the smaller bound wins): a quota on each
node (``limits`` as read), and a quota over the pool, of which this node may hold its
:class:`PoolShare` (``pool_share``: from what the other live nodes reported at the last
heartbeat, ``quota_sync.py``).

Cost: nothing for a chunk of no tenant or of a tenant without a quota but a dict
lookup; a victim costs the walk from the tier's coldest chunk past the colder chunks
of other tenants, at most :data:`MAX_QUOTA_WALK` slots a victim (a tenant whose
coldest chunk is further than that is refused rather than walked for).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from itertools import islice

from backend.counters import NodeCounter
from backend.node.store.bookkeeping import ON_NVME, ChunkTable, IndexChanges
from backend.node.store.eviction import EvictionOrder
from backend.protocol import ItemMeta
from backend.protocol.reports import TenantReport
from backend.tenants import tenant_of

__all__ = ["MAX_QUOTA_WALK", "PoolShare", "TenantQuotas", "pool_share"]

logger = logging.getLogger(__name__)

MAX_QUOTA_WALK = 100_000  # slots walked for one victim before the chunk is refused instead
_PUT_ID_MASK = (1 << 64) - 1  # a put's id as the DRAM tier marks it (64-bit on the wire; the node's own negative)


@dataclasses.dataclass(frozen=True)
class PoolShare:
    """A tenant's pool-wide quota, as this node applies it until the next heartbeat."""

    quota_bytes: int  # the tenant's quota over the pool
    others_bytes: int  # what the other live nodes reported holding of it
    limit_bytes: int  # what this node may hold of it


def pool_share(quota_bytes: int, mine_bytes: int, others_bytes: int) -> PoolShare:
    """This node's share of a pool quota, from its own bytes and the other live nodes' reported bytes.

    Within the quota, this node may grow into all the room left: ``quota - others`` (so may every
    other node, until their next reports: the overshoot docs/fleet.md bounds). Over it (nodes took
    the room together, or the quota was lowered), each node's share is its part of the quota in
    proportion to what it holds, ``mine * quota / (mine + others)``: the shares add up to the
    quota, so nodes that evict at once evict the excess once between them, not once each.
    """
    total = mine_bytes + others_bytes
    limit = quota_bytes - others_bytes if total <= quota_bytes else mine_bytes * quota_bytes // total
    return PoolShare(quota_bytes, others_bytes, limit)


class _RequestKeys:
    """The keys one put request names, made a set on first need (a quota eviction for that put)."""

    __slots__ = ("_items", "_keys")

    def __init__(self, items: Sequence[ItemMeta]) -> None:
        self._items = items
        self._keys: frozenset[str] | None = None

    def __contains__(self, key: object) -> bool:
        if self._keys is None:
            self._keys = frozenset(item.key for item in self._items)
        return key in self._keys


class TenantQuotas:
    """Per-tenant quotas, bytes and counters of one node. Event loop only."""

    def __init__(
        self,
        table: ChunkTable,
        remove: Callable[[str], Awaitable[bool]],
        changes: IndexChanges,
        counters: Counter[NodeCounter],
        marked: Callable[[str], int],
    ) -> None:
        self.table = table
        self._remove = remove  # drop a key from every tier
        self._marked = marked  # key -> id of the put that last stored or found it in DRAM (0: none, or not there)
        self._requests: dict[int, list[_RequestKeys]] = {}  # put id -> its requests running here
        self._changes = changes
        self._counters = counters
        self.limits: dict[str, int] = {}  # tenant -> the bytes it may hold here: its node quota or pool share
        self.node_limits: dict[str, int] = {}  # tenant -> its quota on each node (Redis, at the last heartbeat)
        self.pool: dict[str, PoolShare] = {}  # tenant -> its pool quota and this node's share of it
        self.puts: Counter[str] = Counter()  # tenant -> chunks stored (committed)
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()  # chunks evicted to keep the tenant within its quota

    def set_limits(self, node: Mapping[str, int], pool: Mapping[str, PoolShare] | None = None) -> None:
        """The quotas from now on: on each node, and this node's shares of pool quotas (both bound a tenant)."""
        self.node_limits, self.pool = dict(node), dict(pool or {})
        limits = dict(node)
        for tenant, share in self.pool.items():
            limits[tenant] = min(limits.get(tenant, share.limit_bytes), share.limit_bytes)
        self.limits = limits

    def held(self, tenant: str) -> int:
        """``tenant``'s bytes on this node (both tiers)."""
        return self.table.tenant_bytes.get(tenant, 0)

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

    def growth(self, key: str, nbytes: int) -> int:
        """The bytes ``key``'s tenant will hold more once ``key``'s chunk of ``nbytes`` lands (a copy held
        already counts as gone: a chunk found here adds nothing)."""
        slot = self.table.slot(key)
        return max(nbytes - (self.table.nbytes[slot] if slot >= 0 else 0), 0)

    @contextlib.contextmanager
    def guard(self, put_id: int, items: Sequence[ItemMeta]) -> Iterator[None]:
        """While it runs, a request of put ``put_id`` naming ``items``: no quota evicts them for that put."""
        keys = _RequestKeys(items)
        self._requests.setdefault(put_id, []).append(keys)
        try:
            yield
        finally:
            requests = self._requests[put_id]
            requests.remove(keys)
            if not requests:
                del self._requests[put_id]

    async def make_room(self, key: str, nbytes: int, pending: int, put_id: int) -> bool:
        """Evict the tenant's coldest chunks until ``key``'s ``nbytes`` (and ``pending`` bytes of the same
        request and tenant, not landed yet) fit its quota, never a chunk of put ``put_id``; False when they
        cannot (refuse the chunk)."""
        quota = self.quota_of(key)
        if quota is None:
            return True
        tenant, limit = quota
        if nbytes + pending > limit:
            return False
        while not self.fits(key, nbytes + pending):
            victim = self._coldest_of(tenant, put_id)
            if victim is None:
                return False
            if await self._remove(victim):
                self._changes.removed.add(victim)
                self._counters[NodeCounter.QUOTA_EVICTIONS] += 1
                self.evictions[tenant] += 1
        return True

    def _coldest_of(self, tenant: str, put_id: int) -> str | None:
        """The key of ``tenant``'s first chunk to leave (by the tiers' orders) that is not put ``put_id``'s."""
        orders = self.table.orders  # tier bit -> its eviction order: NVMe's (the colder tier) first
        for tier in sorted(orders, key=lambda bit: bit != ON_NVME):
            order = orders[tier]
            for key in islice(self._keys(order), MAX_QUOTA_WALK):
                if tenant_of(key) == tenant and not self._of_put(key, put_id):
                    return key
        return None

    def _of_put(self, key: str, put_id: int) -> bool:
        """Whether ``key``'s chunk is put ``put_id``'s: a request of it running here names it, or the put
        stored or found it in DRAM."""
        if any(key in request for request in self._requests.get(put_id, ())):
            return True
        return self._marked(key) == put_id & _PUT_ID_MASK

    def _keys(self, order: EvictionOrder) -> Iterator[str]:
        table = self.table
        for slot in order.coldest():
            yield table.key(slot)

    def reports(self) -> dict[str, TenantReport]:
        """What STAT (and /metrics) carries per tenant: every tenant with bytes here, a quota, or counts."""
        names = set(self.table.tenant_bytes) | set(self.limits) | set(self.puts) | set(self.hits) | set(self.misses)
        none = PoolShare(-1, 0, -1)
        return {
            name: TenantReport(
                held_bytes=self.table.tenant_bytes.get(name, 0),
                quota_bytes=self.node_limits.get(name, -1),
                pool_quota_bytes=self.pool.get(name, none).quota_bytes,
                pool_share_bytes=self.pool.get(name, none).limit_bytes,
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
