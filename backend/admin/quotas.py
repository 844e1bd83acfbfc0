"""The quota verbs: set, clear and list tenants' byte quotas, on each node or over the pool (docs/fleet.md,
"Tenants and quotas")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.admin.shared import stats_of
from backend.client import PoolClient
from backend.errors import ConfigError
from backend.metadata import NODE_SCOPE, check_scope
from backend.tenants import check_tenant

__all__ = ["TenantRow", "clear_quota", "list_quotas", "set_quota"]


@dataclass(frozen=True)
class TenantRow:
    """One tenant across the live nodes: its quotas on each node and over the pool (None: none), and its
    bytes held and counts, summed over the live nodes."""

    tenant: str
    quota_bytes: int | None
    held_bytes: int
    puts: int
    hits: int
    misses: int
    pool_quota_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "quota_bytes": self.quota_bytes,
            "pool_quota_bytes": self.pool_quota_bytes,
            "held_bytes": self.held_bytes,
            "puts": self.puts,
            "hits": self.hits,
            "misses": self.misses,
        }


def check_quota(tenant: str, quota_bytes: int, scope: str) -> None:
    """ConfigError naming what is wrong with a quota to set: the tenant's name, a negative size, the scope."""
    check_tenant(tenant, "TENANT")
    if quota_bytes < 0:
        raise ConfigError("BYTES", f"a quota is 0 or more bytes, not {quota_bytes}")
    check_scope(scope)


async def set_quota(client: PoolClient, tenant: str, quota_bytes: int, scope: str = NODE_SCOPE) -> None:
    """Bound ``tenant``'s bytes to ``quota_bytes`` on each node (``scope`` "node") or summed over the live
    nodes ("pool"); applied from each node's next heartbeat."""
    check_quota(tenant, quota_bytes, scope)
    await client.index.set_quota(tenant, quota_bytes, scope)


async def clear_quota(client: PoolClient, tenant: str, scope: str = NODE_SCOPE) -> bool:
    """Drop ``tenant``'s quota of ``scope``; whether it had one."""
    check_tenant(tenant, "TENANT")
    check_scope(scope)
    return await client.index.clear_quota(tenant, scope)


async def list_quotas(client: PoolClient) -> list[TenantRow]:
    """Every tenant with a quota or with chunks on a live node, by name."""
    quotas = await client.index.quotas()
    totals: dict[str, list[int]] = {name: [0, 0, 0, 0] for name in [*quotas.node, *quotas.pool]}
    for report in (await stats_of(client, await client.nodes(refresh=True))).values():
        for name, tenant in report.tenants.items():
            row = totals.setdefault(name, [0, 0, 0, 0])
            for i, value in enumerate((tenant.held_bytes, tenant.puts, tenant.hits, tenant.misses)):
                row[i] += value
    rows = []
    for name in sorted(totals):
        held, puts, hits, misses = totals[name]
        rows.append(TenantRow(name, quotas.node.get(name), held, puts, hits, misses, quotas.pool.get(name)))
    return rows
