"""SyncPoolClient: the blocking twin of PoolClient, the same code on a private event-loop thread."""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from backend.client.chunks import Chunk, Fetched, Lock
from backend.client.pool_client import PoolClient
from backend.config import PoolConfig
from backend.metadata import NodeInfo
from backend.protocol.meta import NO_FINGERPRINT
from backend.threads import LoopThread

__all__ = ["SyncPoolClient"]

T = TypeVar("T")


class SyncPoolClient:
    """Blocking twin of :class:`PoolClient`: the same code on a private event-loop thread."""

    def __init__(self, config: PoolConfig) -> None:
        self._loop = LoopThread("kvpool-client")
        self._client = self._call(self._make(config))
        self.config = config

    @staticmethod
    async def _make(config: PoolConfig) -> PoolClient:
        return PoolClient(config)

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self._loop.call(coro, timeout_s)

    @property
    def counters(self) -> dict[str, int]:
        return {str(name): value for name, value in self._client.counters.items()}

    def prepare_puts(self) -> int:
        return self._call(self._client.prepare_puts())

    def put(self, chunks: Sequence[Chunk]) -> None:
        self._call(self._client.put(chunks))

    def get(self, keys: Sequence[str], *, fingerprint: int = NO_FINGERPRINT) -> list[Fetched | None]:
        return self._call(self._client.get(keys, fingerprint=fingerprint))

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return self._call(self._client.contains(keys))

    def hit_prefix(self, keys: Sequence[str]) -> int:
        return self._call(self._client.hit_prefix(keys))

    def delete(self, keys: Sequence[str]) -> int:
        return self._call(self._client.delete(keys))

    def lock(self, keys: Sequence[str], ttl_ms: int) -> list[Lock | None]:
        """Lease each key on its node for ``ttl_ms`` (:meth:`PoolClient.lock`)."""
        return self._call(self._client.lock(keys, ttl_ms))

    def unlock(self, locks: Sequence[Lock | None]) -> None:
        """End the leases taken by :meth:`lock` (:meth:`PoolClient.unlock`)."""
        self._call(self._client.unlock(locks))

    def nodes(self, refresh: bool = True) -> list[NodeInfo]:
        return self._call(self._client.nodes(refresh=refresh))

    def list_keys(self, match: str = "*") -> list[str]:
        return self._call(self._client.list_keys(match))

    def node_stats(self, node: NodeInfo) -> dict[str, Any]:
        return self._call(self._client.node_stats(node))

    def ping(self) -> float:
        return self._call(self._client.ping())

    def close(self) -> None:
        if self._loop.loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._client.close(), timeout_s=5.0)
        self._loop.stop(5.0)

    def connect(self, *, check_token: bool = True) -> SyncPoolClient:
        """Open: :meth:`PoolClient.connect` (Redis and its password, then a live node's token)."""
        self._call(self._client.connect(check_token=check_token))
        return self

    def __enter__(self) -> SyncPoolClient:
        """Check Redis and its credentials now, as :meth:`PoolClient.__aenter__`; closed again if that fails."""
        try:
            return self.connect(check_token=False)
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
