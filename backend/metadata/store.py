"""MetadataStore: one namespace's metadata in Redis, as one object (registry + index + rendezvous)."""

from __future__ import annotations

from typing import Any

from backend.metadata.index import KeyIndex
from backend.metadata.lookup import LiveLookup
from backend.metadata.registry import NodeRegistry

__all__ = ["MetadataStore"]


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
