"""What the L2 adapter reports about the pool without waiting on it: capacity, fill, bytes per salt.

A background refresh reads the registry and scans the index every
``usage_refresh_ms``; between two scans the adapter's own stores and deletes are
added at once (docs/design.md, "Usage").
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from types import MappingProxyType

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage

from backend.client import PoolClient
from backend.counters import MissCause
from backend.errors import KVPoolError
from backend.lmcache.boundary import MissBoundary
from backend.lmcache.l2.keys import listing_pattern, object_key_from_pool_key

__all__ = ["PoolView", "UsageView"]


@dataclasses.dataclass
class PoolView:
    """What the last registry refresh saw; read by ``get_usage``/``report_status`` without I/O."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    live_nodes: int = 0
    reachable: bool = False
    bytes_by_salt: Mapping[str, int] | None = None  # from the pool index; None until the first scan
    refreshed_at: float = 0.0


class UsageView:
    """The pool's capacity and per-salt bytes as last refreshed, plus this adapter's changes since."""

    def __init__(self, client: PoolClient, misses: MissBoundary) -> None:
        self.client = client
        self.misses = misses
        self.view = PoolView()
        self._lock = threading.Lock()
        self._salt_delta: Counter[str] = Counter()  # bytes stored minus deleted here since the last scan

    def count_salt_bytes(self, keys: list[ObjectKey], sizes: list[int], sign: int) -> None:
        """This adapter's own stores and deletes since the last index scan, shown by ``get_usage`` at once."""
        with self._lock:
            for key, size in zip(keys, sizes):
                self._salt_delta[key.cache_salt] += sign * size

    def usage(self, own: AdapterUsage) -> AdapterUsage:
        """``get_usage``: the last refresh, or ``own`` (LMCache's count of this adapter's notices) before one."""
        view = self.view
        if view.bytes_by_salt is None:
            by_salt = dict(own.bytes_by_cache_salt)
        else:
            by_salt = dict(view.bytes_by_salt)
            with self._lock:
                for salt, delta in self._salt_delta.items():
                    by_salt[salt] = max(0, by_salt.get(salt, 0) + delta)
        return AdapterUsage(
            total_bytes_used=view.used_bytes if view.reachable else own.total_bytes_used,
            total_capacity_bytes=view.capacity_bytes,
            bytes_by_cache_salt=MappingProxyType(dict(by_salt)),
        )

    async def usage_by_salt(self) -> dict[str, int]:
        """Bytes per cache_salt of every multiprocess-mode key in the pool (SCAN + lookups)."""
        totals: dict[str, int] = defaultdict(int)
        async for batch in self.client.index.scan_entries(listing_pattern()):
            for name, entry in batch:
                key = object_key_from_pool_key(name)
                if key is not None and entry:
                    totals[key.cache_salt] += entry[0].nbytes
        return dict(totals)

    async def refresh(self) -> None:
        with self._lock:  # the scan sees what was stored before it starts; keep counting what comes after
            before, self._salt_delta = self._salt_delta, Counter()
        try:
            nodes = await self.client.nodes(refresh=True)
            by_salt = await self.usage_by_salt()
        except KVPoolError as exc:
            with self._lock:
                self._salt_delta.update(before)
            self.view = dataclasses.replace(self.view, reachable=False, live_nodes=0)
            self.misses.miss(MissCause.REGISTRY, "L2 adapter cannot read the pool registry: %s", exc)
            return
        self.misses.recovered(MissCause.REGISTRY)
        self.view = PoolView(
            capacity_bytes=sum(n.capacity_bytes for n in nodes),
            used_bytes=sum(n.used_bytes for n in nodes),
            live_nodes=len(nodes),
            reachable=True,
            bytes_by_salt=by_salt,
            refreshed_at=time.time(),
        )

    async def refresh_forever(self, interval_s: float) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval_s)
