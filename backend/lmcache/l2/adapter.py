"""KVPoolL2Adapter: kvpool as an L2 adapter of LMCache's multiprocess mode.

In multiprocess mode a separate LMCache server owns L1 memory and moves chunks
to and from storage through ``L2AdapterInterface``. LMCache loads this adapter
through its ``plugin`` L2 adapter type (``kvpool lmcache-config --mode mp``
prints this; ``kvpool.lmcache_l2_adapter``, the module it names, re-exports this one)::

    lmcache server --l1-size-gb 20 --eviction-policy LRU --l2-adapter \\
      '{"type": "plugin", "module_path": "kvpool.lmcache_l2_adapter",
        "class_name": "KVPoolL2Adapter", "config_class_name": "KVPoolL2AdapterConfig",
        "adapter_params": {"url": "kvpool://127.0.0.1:6379/default"}}'

How it runs: one :class:`PoolClient` lives on the adapter's own event-loop
thread (:mod:`.tasks`). LMCache's store and prefetch controller threads only submit
work there and get a task id back at once; the result is parked in a completed-task
table and the matching event fd is signalled, as LMCache's own adapters do. Nothing
an LMCache thread calls waits on the network, except ``delete`` (synchronous by
interface, bounded) and ``list_l2_keys``.

This class is the interface LMCache sees; each part is its own room: the read side
(:mod:`.prefetch`: lookup-and-lock, unlock, load), the write side (:mod:`.store`:
store, delete), the listing (:mod:`.listing`) and usage (:mod:`.usage`). The key
mapping is :mod:`.keys`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId

from backend.client import Lock, PoolClient
from backend.config import PoolConfig
from backend.config.values import ms_to_s
from backend.counters import ClientCounter
from backend.doctor import TROUBLESHOOTING, Finding, reach
from backend.errors import KVPoolError
from backend.lmcache.boundary import MissBoundary
from backend.lmcache.config import check_tenant_source
from backend.lmcache.l2.config import KVPoolL2AdapterConfig
from backend.lmcache.l2.keys import SaltNames
from backend.lmcache.l2.listing import check_page_size, list_page, parse_cursor
from backend.lmcache.l2.prefetch import Prefetcher
from backend.lmcache.l2.store import Storer
from backend.lmcache.l2.tasks import TaskRunner
from backend.lmcache.l2.unreadable import Unreadable
from backend.lmcache.l2.usage import UsageView

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.memory_management import MemoryObj

__all__ = ["KVPoolL2Adapter"]

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0
LAYOUT_MISSES = ClientCounter.LAYOUT_MISSES  # the client's counter the adapter reports as its own


async def _make_client(pool: PoolConfig) -> PoolClient:
    return PoolClient(pool)  # created on the loop that will use it


class KVPoolL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """LMCache ``L2AdapterInterface`` over a kvpool pool, with real leases for lookup-and-lock."""

    def __init__(self, config: KVPoolL2AdapterConfig | Mapping[str, Any], l1_memory_desc: Any = None) -> None:
        if not isinstance(config, KVPoolL2AdapterConfig):
            config = KVPoolL2AdapterConfig.from_dict(dict(config))
        check_tenant_source(config.pool, multiprocess=True)
        # Capacity 0 for LMCache: the pool evicts on its own nodes, so LMCache's
        # aggregate L2 eviction stays off; get_usage still reports the pool's capacity.
        super().__init__(max_capacity_bytes=0)
        self.config = config
        self.counters: Counter[str] = Counter()
        self._misses = MissBoundary(self.counters, label="L2 ")
        self._tasks = TaskRunner("kvpool-l2")
        # Each key's pool name; with tenant_from_salt=on its salt names its tenant, and names come scoped.
        self.names = SaltNames(config.pool, self.counters)
        pool = dataclasses.replace(config.pool, tenant="") if config.pool.tenant_from_salt else config.pool
        self.client: PoolClient = self._tasks.call(_make_client(pool), CLOSE_TIMEOUT_S)
        self._usage = UsageView(self.client, self._misses)
        unreadable = Unreadable()  # names a load missed: the store side sends them again
        self._prefetch = Prefetcher(
            self.client,
            self.names,
            self._tasks,
            self._misses,
            self.counters,
            config.lock_ttl_ms,
            self._notify_keys_accessed,
            unreadable,
        )
        self._store = Storer(
            self.client,
            self.names,
            self._tasks,
            self._misses,
            self.counters,
            self._usage,
            self._notify_keys_stored,
            self._notify_keys_deleted,
            unreadable,
        )
        self._refresher = self._tasks.start(self._usage.refresh_forever(ms_to_s(config.usage_refresh_ms)))
        # Why the pool is not usable at start (None: it is, or not checked yet): one ERROR, as the connector says it.
        self.pool_problem: Finding | None = None
        self._tasks.start(self._startup_check())
        logger.info("kvpool: L2 adapter for %s (lease %d ms)", config.pool.to_url(with_token=False), config.lock_ttl_ms)

    async def _startup_check(self) -> None:
        try:
            problem = next((f for f in await reach(self.client) if not f.ok), None)
        except KVPoolError as exc:
            problem = Finding.failed("pool", str(exc))
        self.pool_problem = problem
        if problem is not None:
            where = f" ({problem.cause.title}: {TROUBLESHOOTING}#{problem.cause.slug})" if problem.cause else ""
            logger.error(
                "kvpool: L2 adapter: pool %s is not usable at start: %s%s; every lookup misses until it is. Fix: %s",
                self.config.pool.to_url(with_token=False),
                problem.detail,
                where,
                problem.fix,
            )

    # -- event fds --------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store.stores.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._prefetch.lookups.fileno()

    def get_load_event_fd(self) -> int:
        return self._prefetch.loads.fileno()

    # -- tasks ------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        _same_length(keys, objects, "objects")
        return self._store.submit_store(keys, objects)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._store.stores.pop_all()

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        return self._prefetch.submit_lookup_and_lease(keys)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._prefetch.lookups.pop(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._prefetch.submit_release(keys)

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        _same_length(keys, objects, "objects")
        return self._prefetch.submit_load(keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._prefetch.loads.pop(task_id)

    # -- delete, listing, usage -------------------------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove keys from the pool (LMCache's L2 eviction); bounded, synchronous by interface."""
        self._store.delete(keys, self.client.deadlines.delete_s)

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        """One page of this adapter's keys in the pool (Redis SCAN; ``cursor`` is opaque)."""
        scan_cursor, skip = parse_cursor(cursor)
        page = list_page(self.client, self.names, model_name, check_page_size(page_size), scan_cursor, skip)
        return self._tasks.call(page, self.client.deadlines.delete_s)

    def get_usage(self) -> AdapterUsage:
        """Pool capacity and fill from the registry; per-salt bytes from the pool index.

        Both come from the last background refresh (at most ``usage_refresh_ms`` old),
        so this never waits on the network. Until the first index scan, per-salt
        bytes are what this adapter stored and deleted itself.
        """
        return self._usage.usage(super().get_usage())

    async def usage_by_salt(self) -> dict[str, int]:
        """Bytes per cache_salt of every multiprocess-mode key in the pool (SCAN + lookups)."""
        return await self._usage.usage_by_salt()

    def refresh_usage(self) -> None:
        """Refresh capacity and per-salt usage now (blocking, bounded); for tools and tests."""
        self._tasks.call(self._usage.refresh(), self.client.deadlines.delete_s)

    # -- status and close -------------------------------------------------------------
    def report_status(self) -> dict[str, Any]:
        view = self._usage.view
        loop_alive = self._tasks.is_alive()
        healthy = loop_alive and view.reachable and view.live_nodes > 0
        problem = self.pool_problem if not healthy else None
        return {
            "is_healthy": healthy,
            # the docs/troubleshooting.md entry of why the pool was not usable at start, while it is not
            "pool_problem": problem.cause.slug if problem is not None and problem.cause is not None else "",
            "type": "KVPoolL2Adapter",
            "pool": self.config.pool.to_url(with_token=False),
            "event_loop_alive": loop_alive,
            "redis_reachable": view.reachable,
            "live_nodes": view.live_nodes,
            "capacity_bytes": view.capacity_bytes,
            "used_bytes": view.used_bytes,
            "locked_keys": self._prefetch.held_count,
            "in_flight_tasks": self._tasks.in_flight,
            "lock_ttl_ms": self.config.lock_ttl_ms,
            # the adapter's own, and its client's layout misses (a load that found another layout's chunk)
            "counters": {**self.counters, str(LAYOUT_MISSES): self.client.counters[LAYOUT_MISSES]},
        }

    def close(self) -> None:
        """Release held leases, close the client, stop the loop; bounded."""
        if self._tasks.closed:
            return
        self._tasks.closed = True
        held = self._prefetch.take_all_held()
        try:
            self._tasks.call(self._shutdown(held), CLOSE_TIMEOUT_S * 2)
        except KVPoolError as exc:
            logger.warning("kvpool: L2 adapter close was not clean: %s", exc)
        self._tasks.stop(CLOSE_TIMEOUT_S)
        self._store.close()
        self._prefetch.close()

    async def _shutdown(self, held: list[Lock]) -> None:
        self._refresher.cancel()
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        for task in pending:
            task.cancel()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await asyncio.gather(*pending, return_exceptions=True)
        if held:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self.client.unlock(held)
        await self.client.close()

    def __repr__(self) -> str:
        return f"<KVPoolL2Adapter {self.config.pool.to_url(with_token=False)}>"


def _same_length(keys: Sequence[Any], objects: Sequence[Any], name: str) -> None:
    if len(keys) != len(objects):
        raise KVPoolError(f"{len(keys)} keys but {len(objects)} {name}: one memory object per key is required")
