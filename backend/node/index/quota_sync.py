"""The quotas on the heartbeat: read from Redis, and for pool quotas this node's bytes out and the others' in.

At each heartbeat (``publisher.py``) the node reads both kinds of quota. For each tenant with a
pool quota it reports the bytes it holds of that tenant (a hash expiring with its heartbeat:
``backend.metadata.quotas``) and reads what the other live nodes reported; its share until the
next beat is ``quotas.pool_share`` of those numbers. Nothing per chunk, nothing on the put path:
a put compares the tenant's bytes here with one number, as for a quota on each node.

Redis cost a node a second: with no pool quota, one pipeline of two HGETALLs (the quotas); with
one, also one script (its report, and the registry's node ids) and one pipeline of an HMGET per
other registered node: three round trips, N-1 small reads. A beat that could not read or report
leaves the quotas and shares of the last beat in force (a node that never completed one has none).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from backend.metadata import Quotas
from backend.node.store.quotas import PoolShare, pool_share

__all__ = ["QuotaHolder", "QuotaSource", "QuotaSync"]


class QuotaSource(Protocol):
    """What the sync asks of the index (``backend.metadata.NodeMetadata``)."""

    async def quotas(self) -> Quotas: ...

    async def exchange_tenant_bytes(self, node_id: str, held: Mapping[str, int], ttl_ms: int) -> dict[str, int]: ...


class QuotaHolder(Protocol):
    """What the sync asks of the store (``StoreUpkeep``): a tenant's bytes here, and the limits to keep."""

    def tenant_bytes(self, tenant: str) -> int: ...

    def set_quota_limits(self, node: Mapping[str, int], pool: Mapping[str, PoolShare] | None = None) -> None: ...


class QuotaSync:
    """Brings the pool's quotas to this node's store (its ``TenantQuotas``), one heartbeat at a time."""

    def __init__(self, source: QuotaSource, quotas: QuotaHolder, ttl_ms: int) -> None:
        self._source = source
        self._quotas = quotas
        self._ttl_ms = ttl_ms  # a report lives as long as the heartbeat that wrote it
        self._reported = False  # whether a report of this node may be in Redis (to delete once none is due)

    async def beat(self, node_id: str) -> None:
        """Read the quotas; report and learn the tenants' bytes where a pool quota needs them. MetadataError
        if Redis did not answer (the last limits stay)."""
        quotas = await self._source.quotas()
        held = {tenant: self._quotas.tenant_bytes(tenant) for tenant in quotas.pool}
        others: dict[str, int] = {}
        if held or self._reported:
            others = await self._source.exchange_tenant_bytes(node_id, held, self._ttl_ms)
            self._reported = bool(held)
        shares = {
            tenant: pool_share(quota, held[tenant], others.get(tenant, 0)) for tenant, quota in quotas.pool.items()
        }
        self._quotas.set_quota_limits(quotas.node, shares)
