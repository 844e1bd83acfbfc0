"""PoolIndex: what a client's users may ask of the pool's metadata, and nothing more.

``PoolClient.index`` is the one door from the LMCache layers, the admin verbs, the
channel and the bench to the Redis metadata: where keys live, which nodes exist,
index walks and the repairs ``kvpool check``/``drain``/``flush`` make. It forwards to
:class:`backend.metadata.MetadataStore`, which stays private to the client, so the
node-side operations (heartbeats, epochs, commits of a node's own puts) and the raw
Redis client are out of reach from here.

Every call is bounded by the pool's ``timeout_s`` and raises
:class:`backend.errors.MetadataError` when Redis does not answer in time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from backend.metadata import (
    LOOKUP_BATCH,
    NODE_SCOPE,
    IndexEntry,
    LiveNamespaces,
    Location,
    MetadataStore,
    NodeInfo,
    Quotas,
    RedisFacts,
    RedisMemory,
)

__all__ = ["PoolIndex", "glob_escape"]


def glob_escape(text: str) -> str:
    """Escape Redis glob characters so user text matches literally in a ``match`` pattern."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class PoolIndex:
    """The pool's index and node registry, as seen by a client (see the module docstring)."""

    def __init__(self, store: MetadataStore) -> None:
        self._store = store

    # -- reads ------------------------------------------------------------------------
    async def ping(self) -> float:
        """Redis round trip in ms."""
        return await self._store.connection.ping()

    async def memory(self) -> RedisMemory:
        """Redis's memory use and limit (``INFO memory``): whether it is full and refuses writes."""
        return await self._store.connection.memory()

    async def facts(self) -> RedisFacts:
        """Redis's version and clock."""
        return await self._store.connection.facts()

    async def nodes(self) -> list[NodeInfo]:
        """Every registered node, alive or not (``NodeInfo.alive`` says which)."""
        return await self._store.registry.nodes()

    async def live_namespaces(self) -> LiveNamespaces:
        """The namespaces of this Redis that have live nodes (this one too), found within a bounded walk."""
        return await self._store.registry.live_namespaces()

    async def lookup(self, keys: Sequence[str]) -> list[IndexEntry]:
        """Every recorded location of every key, in one pipelined round trip."""
        return await self._store.index.lookup(keys)

    def scan_entries(self, match: str = "*", batch: int = LOOKUP_BATCH) -> AsyncIterator[list[tuple[str, IndexEntry]]]:
        """``(key, locations)`` in batches of at most ``batch``; ``match`` is a glob on the pool key."""
        return self._store.index.scan_entries(match, batch)

    def scan_key_batches(self, match: str = "*", batch: int = LOOKUP_BATCH) -> AsyncIterator[list[str]]:
        """Pool keys in lists of at most ``batch``."""
        return self._store.index.scan_key_batches(match, batch)

    async def scan_step(self, cursor: int, match: str = "*", count: int = 1000) -> tuple[int, list[str]]:
        """One SCAN step: ``(next cursor, keys)``; the cursor is 0 at the start and at the end."""
        return await self._store.index.scan_step(cursor, match, count)

    async def legacy_entries(self, *, remove: bool = False) -> int:
        """How many index keys of the release before this schema remain (``remove``: deleted, page by page)."""
        return await self._store.index.legacy_entries(remove=remove)

    # -- repairs (kvpool drain / check / flush / evict) ----------------------------------
    async def delete(self, keys: Sequence[str]) -> int:
        """Remove index entries outright; returns how many existed. Bytes stay until evicted."""
        return await self._store.index.delete(keys)

    async def commit(self, locations: Sequence[tuple[str, Location]]) -> None:
        """Record locations (``kvpool check --fix`` indexes valid bytes nobody could find)."""
        await self._store.index.commit(locations)

    async def remove_stale(self, stale: Sequence[tuple[str, Location]]) -> None:
        """Drop exactly these locations, unless they changed since they were read."""
        await self._store.index.remove_stale(stale)

    async def quotas(self) -> Quotas:
        """Every tenant's byte quotas, on each node and over the pool: tenant -> bytes."""
        return await self._store.quotas.quotas()

    async def set_quota(self, tenant: str, quota_bytes: int, scope: str = NODE_SCOPE) -> None:
        """Set a tenant's byte quota of ``scope`` (nodes apply it from their next heartbeat)."""
        await self._store.quotas.set_quota(tenant, quota_bytes, scope)

    async def clear_quota(self, tenant: str, scope: str = NODE_SCOPE) -> bool:
        """Drop a tenant's quota of ``scope``; whether it had one."""
        return await self._store.quotas.clear_quota(tenant, scope)

    async def set_draining(self, node_id: str, draining: bool) -> bool:
        """Mark a node as draining (placement skips it) or not; whether the mark changed."""
        return await self._store.registry.set_draining(node_id, draining)

    async def forget_node(self, node_id: str) -> None:
        """Drop a dead node's registry record."""
        await self._store.registry.forget_node(node_id)

    # -- channel rendezvous (nccl_channel.rendezvous.RendezvousStore) -------------------
    async def offer_rendezvous(self, pair_id: str, value: str, ttl_ms: int) -> None:
        await self._store.rendezvous.offer_rendezvous(pair_id, value, ttl_ms)

    async def take_rendezvous(self, pair_id: str) -> str | None:
        return await self._store.rendezvous.take_rendezvous(pair_id)
