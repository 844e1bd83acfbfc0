"""MetadataStore: one namespace's metadata in Redis, as one object (registry + index + rendezvous)."""

from __future__ import annotations

import time
from typing import Any

from backend.metadata.connection import (
    NODES_KEY_PATTERN,
    heartbeat_prefix_of,
    namespace_of_nodes_key,
    nodes_key_of,
)
from backend.metadata.index import KeyIndex
from backend.metadata.lookup import LiveLookup
from backend.metadata.records import LiveNamespaces, NodeInfo
from backend.metadata.registry import NodeRegistry
from backend.metadata.scripts import SCAN_PAGE

__all__ = ["MetadataStore"]

# How long a search for the namespaces that have live nodes may walk Redis's keys: a few thousand
# SCAN pages, so an index of millions of keys is walked in part and the answer says so.
NAMESPACE_SEARCH_S = 2.0


class MetadataStore(NodeRegistry, KeyIndex, LiveLookup):
    """Async access to one namespace's metadata in Redis (redis-py + hiredis).

    The registry (``registry.py``), the index (``index.py``) and the lookup read against a
    live view (``lookup.py``) share one connection (``connection.py``); this class adds the
    channel rendezvous.
    """

    def rendezvous_key(self, session: str) -> str:
        return self._rendezvous_prefix + session

    async def offer_rendezvous(self, session: str, value: str, ttl_ms: int) -> None:
        """Publish a channel rendezvous offer that expires after ``ttl_ms``."""
        async with self._call("rendezvous offer"):
            await self._redis.set(self.rendezvous_key(session), value, px=ttl_ms)

    async def take_rendezvous(self, session: str) -> str | None:
        """Read and delete an offer (one peer joins it once); None if missing or expired."""
        async with self._call("rendezvous take"):
            value = await self._redis.getdel(self.rendezvous_key(session))
        return None if value is None else str(value)

    async def raw(self) -> Any:
        """The underlying redis-py client (tests and the CLI's inspection verbs)."""
        return self._redis

    async def live_namespaces(self, budget_s: float = NAMESPACE_SEARCH_S) -> LiveNamespaces:
        """Every namespace of this Redis that has live nodes (this one too), with how many.

        The registries are found by SCAN (``kvp:{NS}:nodes``; there is no list of namespaces),
        for at most ``budget_s``; then each one's heartbeats are read, as :meth:`nodes` does.
        """
        deadline = time.monotonic() + budget_s
        found: set[str] = set()
        cursor, complete = 0, True
        while True:
            cursor, names = await self._scan_step(cursor, NODES_KEY_PATTERN, SCAN_PAGE)
            found.update(ns for ns in map(namespace_of_nodes_key, names) if ns is not None)
            if cursor == 0:
                break
            if time.monotonic() > deadline:
                complete = False
                break
        live = {}
        for namespace in sorted(found):
            count = await self._live_count(namespace)
            if count:
                live[namespace] = count
        return LiveNamespaces(live, complete)

    async def _live_count(self, namespace: str) -> int:
        """How many of ``namespace``'s registered nodes are alive: their heartbeat holds their epoch."""
        async with self._call("HGETALL nodes"):
            raw = await self._redis.hgetall(nodes_key_of(namespace))
        infos = [NodeInfo.from_json(text) for text in raw.values()]
        if not infos:
            return 0
        prefix = heartbeat_prefix_of(namespace)
        async with self._call("MGET heartbeats"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for info in infos:
                    pipe.get(prefix + info.node_id)
                beats = await pipe.execute()
        return sum(1 for info, beat in zip(infos, beats) if beat is not None and beat == str(info.epoch))
