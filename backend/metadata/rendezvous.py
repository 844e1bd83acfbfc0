"""Rendezvous: short-lived offers one party leaves in Redis for one other party to take.

The NCCL channel pairs a client with a node this way (``nccl_channel.rendezvous``): one side
offers its pair's details under ``kvp:{NS}:rdv:<pair id>``, which expires after a TTL; the
peer takes it (read and delete in one command), so an offer is joined at most once.
"""

from __future__ import annotations

from backend.metadata.connection import RedisConnection

__all__ = ["Rendezvous"]


class Rendezvous:
    """Channel rendezvous offers: set with a TTL, taken once."""

    def __init__(self, conn: RedisConnection) -> None:
        self._conn = conn
        self._prefix = conn.tag_prefix + "rdv:"

    def rendezvous_key(self, pair_id: str) -> str:
        return self._prefix + pair_id

    async def offer_rendezvous(self, pair_id: str, value: str, ttl_ms: int) -> None:
        """Publish a channel rendezvous offer that expires after ``ttl_ms``."""
        async with self._conn.call("rendezvous offer"):
            await self._conn.redis.set(self.rendezvous_key(pair_id), value, px=ttl_ms)

    async def take_rendezvous(self, pair_id: str) -> str | None:
        """Read and delete an offer (one peer joins it once); None if missing or expired."""
        async with self._conn.call("rendezvous take"):
            value = await self._conn.redis.getdel(self.rendezvous_key(pair_id))
        return None if value is None else str(value)
