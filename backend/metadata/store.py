"""MetadataStore: one namespace's metadata in Redis, as four parts over one connection.

Each part is its own object and holds the shared :class:`RedisConnection` (the client, its
key names, deadlines and breaker), never another part:

* ``registry`` (:class:`NodeRegistry`, ``registry.py``): nodes join, beat, leave; epochs, claims.
* ``index`` (:class:`KeyIndex`, ``index.py``): which node holds which key: commits, removals, walks.
* ``lookup`` (:class:`LiveLookup`, ``lookup.py``): the per-request hit-prefix / exists read.
* ``rendezvous`` (:class:`Rendezvous`, ``rendezvous.py``): the channel's pairing offers.
* ``quotas`` (:class:`QuotaBook`, ``quotas.py``): tenants' quotas, and the bytes nodes report for pool quotas.

A caller keeps the part it uses (a claim the registry, a live view the lookup); the store
itself only builds them and closes the connection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from backend.metadata.connection import RedisConnection
from backend.metadata.index import KeyIndex
from backend.metadata.lookup import LiveLookup
from backend.metadata.quotas import QuotaBook, Quotas
from backend.metadata.records import Beat, ClaimHolder, Location, NodeInfo, RedisMemory
from backend.metadata.registry import NodeRegistry
from backend.metadata.rendezvous import Rendezvous

__all__ = ["MetadataStore", "NodeMetadata"]


class MetadataStore:
    """One namespace's metadata in Redis (redis-py + hiredis): the four parts over one connection."""

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        timeout_s: float = 2.0,
        *,
        password: str = "",
        ca_file: str = "",
        password_file: str = "",
    ) -> None:
        """As :class:`RedisConnection`: ``redis://`` or ``rediss://`` (TLS, verified against ``ca_file``
        or the system trust), optionally with an ACL user; ``password`` when the URL carries none, read
        from ``password_file`` (named when Redis refuses it)."""
        self.connection = RedisConnection(
            redis_url, namespace, timeout_s, password=password, ca_file=ca_file, password_file=password_file
        )
        self.registry = NodeRegistry(self.connection)
        self.index = KeyIndex(self.connection)
        self.lookup = LiveLookup(self.connection)
        self.rendezvous = Rendezvous(self.connection)
        self.quotas = QuotaBook(self.connection)

    async def close(self) -> None:
        await self.connection.close()


class NodeMetadata:
    """What a node process's parts write and read of the metadata (``backend.node.context.NodeIndex``):
    its own index entries, its registry beats and marker, and whether Redis is full."""

    def __init__(self, store: MetadataStore) -> None:
        self._index = store.index
        self._registry = store.registry
        self._connection = store.connection
        self._quotas = store.quotas

    async def commit(self, locations: Sequence[tuple[str, Location]], timeout_s: float | None = None) -> None:
        await self._index.commit(locations, timeout_s)

    async def remove(self, node_id: str, epoch: int, keys: Sequence[str]) -> None:
        await self._index.remove(node_id, epoch, keys)

    async def move(self, locations: Sequence[tuple[str, Location]]) -> None:
        await self._index.move(locations)

    async def remove_stale(self, stale: Sequence[tuple[str, Location]]) -> None:
        await self._index.remove_stale(stale)

    async def ensure_marker(self) -> str:
        return await self._registry.ensure_marker()

    async def ensure_epoch_at_least(self, epoch: int) -> None:
        await self._registry.ensure_epoch_at_least(epoch)

    async def new_epoch(self) -> int:
        return await self._registry.new_epoch()

    async def heartbeat(
        self, info: NodeInfo, ttl_ms: int, changed: bool = False, holder: ClaimHolder | None = None
    ) -> Beat:
        return await self._registry.heartbeat(info, ttl_ms, changed, holder)

    async def memory(self) -> RedisMemory:
        return await self._connection.memory()

    async def quotas(self) -> Quotas:
        return await self._quotas.quotas()

    async def exchange_tenant_bytes(self, node_id: str, held: Mapping[str, int], ttl_ms: int) -> dict[str, int]:
        return await self._quotas.exchange(node_id, held, ttl_ms)
