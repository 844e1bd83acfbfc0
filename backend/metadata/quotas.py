"""QuotaBook: tenants' byte quotas in Redis, per node and over the pool, and the bytes each node reports.

Keys (hash tag ``{NS}``: one Redis Cluster slot, beside the registry)::

    kvp:{NS}:quotas          hash tenant -> byte quota on each node (``kvpool quota set TENANT BYTES``)
    kvp:{NS}:poolquotas      hash tenant -> byte quota over the pool (``... --scope pool``)
    kvp:{NS}:held:<node_id>  hash tenant -> the bytes that node held at its last heartbeat, for the
                             tenants with a pool quota; expires with its heartbeat (the same ttl)

At each heartbeat a node reads both quota hashes (one pipeline, one round trip); when a pool
quota is set it also writes its report and reads the registry's node ids (one script: one
round trip), then the other nodes' reports of those tenants (one HMGET per other node, one
pipeline). A node dead for its heartbeat's ttl has no report left, so its bytes stop counting;
one that stops cleanly deletes its report as it deregisters (``DEREGISTER_LUA``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from backend.errors import ConfigError
from backend.metadata.connection import RedisConnection

__all__ = ["NODE_SCOPE", "POOL_SCOPE", "QUOTA_SCOPES", "QuotaBook", "Quotas", "check_scope"]

NODE_SCOPE = "node"  # a quota bounds the tenant's bytes on each node
POOL_SCOPE = "pool"  # a quota bounds the tenant's bytes summed over the live nodes
QUOTA_SCOPES = (NODE_SCOPE, POOL_SCOPE)

# A node's report: KEYS = {its report, the registry}, ARGV = {ttl ms, tenant, bytes, tenant, bytes, ...}.
# The report is replaced whole (a tenant whose pool quota went is dropped); none when no tenant is named.
# Answers the registry's node ids, whose reports the caller reads next. allow-oom: a few bytes a node,
# and a report missing on a full Redis would let the other nodes take this node's share again.
REPORT_LUA = """#!lua flags=allow-oom
redis.call('DEL', KEYS[1])
if #ARGV > 1 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return redis.call('HKEYS', KEYS[2])
"""


def check_scope(scope: str, key: str = "--scope") -> str:
    """``scope`` if it is one of :data:`QUOTA_SCOPES`, else ConfigError naming ``key``."""
    if scope not in QUOTA_SCOPES:
        raise ConfigError(key, f"a quota's scope is {' or '.join(QUOTA_SCOPES)}, not {scope!r}")
    return scope


@dataclasses.dataclass(frozen=True)
class Quotas:
    """Every tenant's byte quotas: on each node, and over the pool (tenant -> bytes)."""

    node: Mapping[str, int] = dataclasses.field(default_factory=dict)
    pool: Mapping[str, int] = dataclasses.field(default_factory=dict)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _table(raw: Mapping[Any, Any]) -> dict[str, int]:
    return {_text(name): int(value) for name, value in raw.items()}


class QuotaBook:
    """The quotas (``kvpool quota``) and the per-node reports a pool quota is shared out from."""

    def __init__(self, conn: RedisConnection) -> None:
        self._conn = conn
        self._redis = conn.redis
        self._call = conn.call
        self._report = conn.script(REPORT_LUA)

    def _key(self, scope: str) -> str:
        return self._conn.pool_quotas_key if check_scope(scope) == POOL_SCOPE else self._conn.quotas_key

    async def quotas(self) -> Quotas:
        """Every tenant's quotas, both scopes (one round trip)."""
        async with self._call("quotas"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(self._conn.quotas_key)
                pipe.hgetall(self._conn.pool_quotas_key)
                node, pool = await pipe.execute()
        return Quotas(_table(node), _table(pool))

    async def set_quota(self, tenant: str, quota_bytes: int, scope: str = NODE_SCOPE) -> None:
        """Set ``tenant``'s byte quota of ``scope``; nodes apply it from their next heartbeat."""
        key = self._key(scope)
        async with self._call("quota set"):
            await self._redis.hset(key, tenant, str(quota_bytes))

    async def clear_quota(self, tenant: str, scope: str = NODE_SCOPE) -> bool:
        """Drop ``tenant``'s quota of ``scope``; whether it had one."""
        key = self._key(scope)
        async with self._call("quota clear"):
            return bool(await self._redis.hdel(key, tenant))

    async def exchange(self, node_id: str, held: Mapping[str, int], ttl_ms: int) -> dict[str, int]:
        """Report ``held`` (tenant -> bytes on ``node_id``) for ``ttl_ms``; for each of its tenants, the bytes
        the other live nodes last reported (summed). An empty ``held`` deletes the report and reads nothing."""
        args: list[str | int] = [ttl_ms]
        for tenant, nbytes in held.items():
            args += [tenant, nbytes]
        async with self._call("tenant bytes report"):
            registered = await self._report(keys=[self._conn.held_key(node_id), self._conn.nodes_key], args=args)
            others = [name for name in map(_text, registered) if name != node_id]
            if not held or not others:
                return dict.fromkeys(held, 0)
            tenants = list(held)
            async with self._redis.pipeline(transaction=False) as pipe:
                for other in others:
                    pipe.hmget(self._conn.held_key(other), tenants)
                rows = await pipe.execute()
        totals = dict.fromkeys(tenants, 0)
        for row in rows:
            for tenant, value in zip(tenants, row):
                if value is not None:
                    totals[tenant] += int(value)
        return totals
