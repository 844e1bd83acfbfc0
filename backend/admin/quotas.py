"""The quota verbs: set, clear and list tenants' byte quotas (docs/fleet.md, "Tenants and quotas")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.admin.shared import stats_of
from backend.client import PoolClient
from backend.errors import ConfigError
from backend.tenants import check_tenant

__all__ = ["TenantRow", "clear_quota", "list_quotas", "set_quota"]


@dataclass(frozen=True)
class TenantRow:
    """One tenant across the live nodes: its quota (None: none), bytes held and counts, summed."""

    tenant: str
    quota_bytes: int | None
    held_bytes: int
    puts: int
    hits: int
    misses: int

    def to_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "quota_bytes": self.quota_bytes,
            "held_bytes": self.held_bytes,
            "puts": self.puts,
            "hits": self.hits,
            "misses": self.misses,
        }


async def set_quota(client: PoolClient, tenant: str, quota_bytes: int) -> None:
    """Bound ``tenant``'s bytes on each node to ``quota_bytes`` (applied from each node's next heartbeat)."""
    check_tenant(tenant, "TENANT")
    if quota_bytes < 0:
        raise ConfigError("BYTES", f"a quota is 0 or more bytes, not {quota_bytes}")
    await client.index.set_quota(tenant, quota_bytes)


async def clear_quota(client: PoolClient, tenant: str) -> bool:
    """Drop ``tenant``'s quota; whether it had one."""
    check_tenant(tenant, "TENANT")
    return await client.index.clear_quota(tenant)


async def list_quotas(client: PoolClient) -> list[TenantRow]:
    """Every tenant with a quota or with chunks on a live node, by name."""
    quotas = await client.index.quotas()
    totals: dict[str, list[int]] = {name: [0, 0, 0, 0] for name in quotas}
    for report in (await stats_of(client, await client.nodes(refresh=True))).values():
        for name, tenant in report.tenants.items():
            row = totals.setdefault(name, [0, 0, 0, 0])
            for i, value in enumerate((tenant.held_bytes, tenant.puts, tenant.hits, tenant.misses)):
                row[i] += value
    return [TenantRow(name, quotas.get(name), *totals[name]) for name in sorted(totals)]
