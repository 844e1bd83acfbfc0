"""KVPoolL2Adapter: kvpool as an L2 adapter of LMCache's multiprocess mode.

In multiprocess mode a separate LMCache server owns L1 memory and moves chunks
to and from storage through ``L2AdapterInterface``. LMCache loads this adapter
through its ``plugin`` L2 adapter type (``kvpool lmcache-config --mode mp``
prints this)::

    lmcache server --l1-size-gb 20 --eviction-policy LRU --l2-adapter \\
      '{"type": "plugin", "module_path": "backend.lmcache_l2_adapter",
        "class_name": "KVPoolL2Adapter", "config_class_name": "KVPoolL2AdapterConfig",
        "adapter_params": {"url": "kvpool://127.0.0.1:6379/default"}}'

How it runs: one :class:`PoolClient` lives on the adapter's own event-loop
thread. LMCache's store and prefetch controller threads only submit work there
and get a task id back at once; the result is parked in a completed-task table
and the matching event fd is signalled, as LMCache's own adapters do. Nothing an
LMCache thread calls waits on the network, except ``delete`` (synchronous by
interface, bounded) and ``list_l2_keys``.

Key mapping (see docs/design.md): ``ObjectKey`` -> ``mp:SALT@MODEL@0xKVRANK@GROUP@HASH``.
``@`` cannot occur in a salt or model name, so the mapping is injective and the
salt is a prefix (per-salt usage is one SCAN). In-process keys
(``MODEL@WS@WORKER@HASH@DTYPE``) never take this shape: their third field is a
decimal worker id, never ``0x...``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Coroutine, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import EncodedObjectKey, KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from backend.client import MAX_LOCK_TTL_MS, Chunk, Lock, PoolClient
from backend.client.index import glob_escape
from backend.config import PoolConfig
from backend.errors import ConfigError, KVPoolError
from backend.lmcache_config import warn_if_secrets_inline
from backend.protocol import ItemMeta
from backend.transport import Buffer

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.memory_management import MemoryObj

__all__ = [
    "KVPoolL2Adapter",
    "KVPoolL2AdapterConfig",
    "MP_KEY_PREFIX",
    "pool_key",
    "object_key_from_pool_key",
    "salt_pattern",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

MP_KEY_PREFIX = "mp:"
DEFAULT_LOCK_TTL_MS = 30_000  # longer than LMCache's lookup -> load window; a crash frees it by itself
DEFAULT_USAGE_REFRESH_MS = 10_000  # registry capacity and per-salt bytes are at most this old
UNLOCK_ATTEMPTS = 3  # then the lease's TTL frees the chunk
UNLOCK_RETRY_S = 0.2
CLOSE_TIMEOUT_S = 2.0
DELETE_TIMEOUT_FACTOR = 4  # delete waits up to this many pool timeouts
ADAPTER_PARAMS = ("url", "lock_ttl_ms", "usage_refresh_ms")


# -- key mapping ---------------------------------------------------------------------
def pool_key(key: ObjectKey) -> str:
    """The pool key of an L2 object key; salts and models are ``@``-free, so it is injective."""
    return (
        f"{MP_KEY_PREFIX}{key.cache_salt}@{key.model_name}@{key.kv_rank:#010x}"
        f"@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    )


def object_key_from_pool_key(text: str) -> ObjectKey | None:
    """Reverse :func:`pool_key`; None for keys of another shape (in-process keys)."""
    if not text.startswith(MP_KEY_PREFIX):
        return None
    parts = text[len(MP_KEY_PREFIX) :].split("@")
    if len(parts) != 5 or not parts[2].startswith("0x"):
        return None
    salt, model, kv_rank, group, chunk_hash = parts
    try:
        return ObjectKey(bytes.fromhex(chunk_hash), model, int(kv_rank, 16), int(group, 16), salt)
    except ValueError:
        return None


def salt_pattern(cache_salt: str, model_name: str | None = None) -> str:
    """A SCAN glob matching every pool key of one salt (and model)."""
    model = glob_escape(model_name) if model_name is not None else "*"
    return f"{glob_escape(MP_KEY_PREFIX + cache_salt)}@{model}@*"


# -- config --------------------------------------------------------------------------
class KVPoolL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """``adapter_params`` of the kvpool L2 adapter: the pool URL and lease settings."""

    def __init__(self, pool: PoolConfig, lock_ttl_ms: int = DEFAULT_LOCK_TTL_MS,
                 usage_refresh_ms: int = DEFAULT_USAGE_REFRESH_MS) -> None:  # fmt: skip
        super().__init__()
        self.pool = pool
        self.lock_ttl_ms = lock_ttl_ms
        self.usage_refresh_ms = usage_refresh_ms

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVPoolL2AdapterConfig:
        """Validate ``adapter_params``; a ConfigError (a ValueError) names the bad key."""
        if not isinstance(d, dict):
            raise ConfigError("adapter_params", f"must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - set(ADAPTER_PARAMS) - {"type"})
        if unknown:
            raise ConfigError(f"adapter_params.{unknown[0]}", f"unknown option; known: {', '.join(ADAPTER_PARAMS)}")
        url = d.get("url") or os.environ.get("KVPOOL_URL")
        if not url:
            raise ConfigError("adapter_params.url", "no pool URL given (nor KVPOOL_URL); e.g. kvpool://HOST:PORT/NS")
        if not isinstance(url, str):
            raise ConfigError("adapter_params.url", f"must be a string, got {type(url).__name__}")
        if d.get("url"):
            warn_if_secrets_inline(url, "adapter_params.url")
        pool = PoolConfig.from_url(url, os.environ)
        lock_ttl_ms = _positive_int(d, "lock_ttl_ms", DEFAULT_LOCK_TTL_MS)
        if lock_ttl_ms > MAX_LOCK_TTL_MS:
            raise ConfigError(
                "adapter_params.lock_ttl_ms", f"{lock_ttl_ms} exceeds the nodes' bound of {MAX_LOCK_TTL_MS}"
            )
        return cls(pool, lock_ttl_ms, _positive_int(d, "usage_refresh_ms", DEFAULT_USAGE_REFRESH_MS))

    @classmethod
    def help(cls) -> str:
        return (
            "kvpool L2 adapter (load with type 'plugin', module_path 'backend.lmcache_l2_adapter',\n"
            "class_name 'KVPoolL2Adapter'). adapter_params:\n"
            "- url (str): kvpool://[:TOKEN@]REDIS_HOST:PORT/NAMESPACE[?options] (or KVPOOL_URL)\n"
            f"- lock_ttl_ms (int): lease of a looked-up chunk (default {DEFAULT_LOCK_TTL_MS})\n"
            f"- usage_refresh_ms (int): how often capacity and per-salt usage are refreshed "
            f"(default {DEFAULT_USAGE_REFRESH_MS})"
        )


def _positive_int(d: Mapping[str, Any], name: str, default: int) -> int:
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"adapter_params.{name}", f"must be a positive integer, got {value!r}")
    return value


# -- the adapter ---------------------------------------------------------------------
class _BufferSink:
    """Receives each key straight into the caller's memory object, or declines it."""

    def __init__(self, buffers: Mapping[str, memoryview], adapter: KVPoolL2Adapter) -> None:
        self.buffers = buffers
        self.adapter = adapter

    async def allocate(self, meta: ItemMeta) -> tuple[str, Buffer] | None:
        view = self.buffers.get(meta.key)
        if view is None:
            return None
        if len(view) != meta.nbytes:
            # Another layout under the same key (a different L1 chunk shape): a miss, never a partial copy.
            self.adapter._warn_once("size", "kvpool: %s holds %d bytes but LMCache's buffer has %d; reading "
                                    "as a miss", meta.key, meta.nbytes, len(view))  # fmt: skip
            return None
        return meta.key, view

    def release(self, handle: str) -> None:
        pass  # the buffer belongs to LMCache


@dataclasses.dataclass
class _PoolView:
    """What the last registry refresh saw; read by ``get_usage``/``report_status`` without I/O."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    live_nodes: int = 0
    reachable: bool = False
    bytes_by_salt: Mapping[str, int] | None = None  # from the pool index; None until the first scan
    refreshed_at: float = 0.0


class KVPoolL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """LMCache ``L2AdapterInterface`` over a kvpool pool, with real leases for lookup-and-lock."""

    def __init__(self, config: KVPoolL2AdapterConfig | Mapping[str, Any], l1_memory_desc: Any = None) -> None:
        if not isinstance(config, KVPoolL2AdapterConfig):
            config = KVPoolL2AdapterConfig.from_dict(dict(config))
        # Capacity 0 for LMCache: the pool evicts on its own nodes, so LMCache's
        # aggregate L2 eviction stays off; get_usage still reports the pool's capacity.
        super().__init__(max_capacity_bytes=0)
        self.config = config
        self.counters: Counter[str] = Counter()
        self._warned: set[str] = set()
        self._lock = threading.Lock()  # task ids, completed tables, held leases
        self._next_task_id: L2TaskId = 0
        self._completed_store: dict[L2TaskId, L2StoreResult] = {}
        self._completed_lookup: dict[L2TaskId, Bitmap] = {}
        self._completed_load: dict[L2TaskId, Bitmap] = {}
        self._held: defaultdict[ObjectKey, list[Lock]] = defaultdict(list)  # one lease per successful lookup
        self._salt_delta: Counter[str] = Counter()  # bytes stored minus deleted by this adapter since the last scan
        self._view = _PoolView()
        self._closed = False
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvpool-l2", daemon=True)
        self._thread.start()
        self._tasks: set[concurrent.futures.Future[None]] = set()
        self.client: PoolClient = self._call(self._make_client(), CLOSE_TIMEOUT_S)
        self._refresher = asyncio.run_coroutine_threadsafe(self._refresh_forever(), self._loop)
        logger.info("kvpool: L2 adapter for %s (lease %d ms)", config.pool.to_url(with_token=False),
                    config.lock_ttl_ms)  # fmt: skip

    async def _make_client(self) -> PoolClient:
        return PoolClient(self.config.pool)  # created on the loop that will use it

    # -- plumbing ---------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the adapter's loop and wait, bounded (never from the loop itself)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise KVPoolError(f"kvpool L2 adapter call timed out after {timeout_s:.1f} s") from None

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        """Start ``coro`` on the adapter's loop and return at once."""
        if self._closed:
            coro.close()
            raise KVPoolError("the kvpool L2 adapter is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        with self._lock:
            self._tasks.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._tasks.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.error("kvpool: L2 task failed: %r", future.exception())

    def _new_task_id(self) -> L2TaskId:
        with self._lock:
            task_id = self._next_task_id
            self._next_task_id += 1
        return task_id

    def _warn_once(self, cause: str, message: str, *args: Any) -> None:
        self.counters[f"miss_{cause}"] += 1
        if cause not in self._warned:
            self._warned.add(cause)
            logger.warning(message, *args)

    def _failed(self, cause: str, what: str, exc: Exception) -> None:
        """The error boundary of a task: pool errors are logged once per cause, bugs with their trace."""
        if isinstance(exc, KVPoolError):
            self._warn_once(cause, "kvpool: %s: %s", what, exc)
            return
        self.counters[f"miss_{cause}"] += 1
        if f"bug:{cause}" not in self._warned:
            self._warned.add(f"bug:{cause}")
            logger.error("kvpool: %s (unexpected error)", what, exc_info=exc)

    def _recovered(self, cause: str) -> None:
        if cause in self._warned:
            self._warned.discard(cause)
            logger.warning("kvpool: L2 %s recovered", cause)

    # -- event fds --------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- store ------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        _same_length(keys, objects, "objects")
        task_id = self._new_task_id()
        self._submit(self._store(task_id, list(keys), list(objects)))
        return task_id

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._completed_store = self._completed_store, {}
        return done

    async def _store(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        ok = True
        sent_bytes = 0
        stored: list[ObjectKey] = []
        sizes: list[int] = []
        try:
            names = [pool_key(k) for k in keys]
            # Re-sending a chunk the pool has is wasted bandwidth and would count its bytes twice.
            present = await self.client.contains(names)
            todo = [i for i, hit in enumerate(present) if not hit]
            chunks = [_chunk(names[i], objects[i]) for i in todo]
            await self.client.put(chunks)
            for i, chunk in zip(todo, chunks):
                stored.append(keys[i])
                sizes.append(len(memoryview(chunk.data)))
            sent_bytes = sum(sizes)
            self._recovered("store")
        except Exception as exc:  # the task must complete, or LMCache waits on it forever
            ok = False
            self._failed("store", "L2 store failed, those chunks stay out of the pool", exc)
        if stored:
            self.counters["stored_chunks"] += len(stored)
            self._count_salt_bytes(stored, sizes, +1)
            self._notify_keys_stored(stored, sizes)
        with self._lock:
            self._completed_store[task_id] = L2StoreResult(ok, sent_bytes)
        self._store_efd.notify()

    # -- lookup and lock --------------------------------------------------------------
    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        task_id = self._new_task_id()
        self._submit(self._lookup_and_lock(task_id, list(keys)))
        return task_id

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._completed_lookup.pop(task_id, None)

    async def _lookup_and_lock(self, task_id: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            # One Redis round trip, then one LEASE per node: a hit is also a lease.
            locks = await self.client.lock([pool_key(k) for k in keys], self.config.lock_ttl_ms)
            with self._lock:
                for i, (key, lock) in enumerate(zip(keys, locks)):
                    if lock is not None:
                        bitmap.set(i)
                        self._held[key].append(lock)
            self._recovered("lookup")
        except Exception as exc:
            self._failed("lookup", "L2 lookup failed, reading as misses", exc)
        with self._lock:
            self._completed_lookup[task_id] = bitmap
        self._lookup_efd.notify()

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            locks = [self._held_pop(k) for k in keys]
        released = [lock for lock in locks if lock is not None]
        if released and not self._closed:
            self._submit(self._unlock(released))

    def _held_pop(self, key: ObjectKey) -> Lock | None:
        held = self._held.get(key)
        if not held:
            return None
        lock = held.pop(0)
        if not held:
            del self._held[key]
        return lock

    async def _unlock(self, locks: list[Lock]) -> None:
        # LMCache never retries an unlock: try a few times; after that the lease's TTL frees the chunk.
        for attempt in range(UNLOCK_ATTEMPTS):
            try:
                await self.client.unlock(locks)
                return
            except KVPoolError as exc:
                if attempt == UNLOCK_ATTEMPTS - 1:
                    self._warn_once("unlock", "kvpool: unlock of %d chunks failed (%s); their leases end "
                                    "after %d ms", len(locks), exc, self.config.lock_ttl_ms)  # fmt: skip
                    return
                await asyncio.sleep(UNLOCK_RETRY_S)

    # -- load -------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        _same_length(keys, objects, "objects")
        task_id = self._new_task_id()
        self._submit(self._load(task_id, list(keys), list(objects)))
        return task_id

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._completed_load.pop(task_id, None)

    async def _load(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            names = [pool_key(k) for k in keys]
            views = [memoryview(obj.byte_array).cast("B") for obj in objects]
            first: dict[str, int] = {}  # a key named twice is fetched once, then copied to its other objects
            for i, name in enumerate(names):
                first.setdefault(name, i)
            unique = list(first)
            sink = _BufferSink({name: views[first[name]] for name in unique}, self)
            handles = await self.client.get(unique, sink)
            got = dict(zip(unique, handles))
            loaded = []
            for i, name in enumerate(names):
                if got[name] is None:
                    continue
                if i != first[name]:
                    if len(views[i]) != len(views[first[name]]):
                        continue  # another layout under the same key: a miss for this object
                    views[i][:] = views[first[name]]
                bitmap.set(i)
                loaded.append(keys[i])
            self.counters["loaded_chunks"] += len(loaded)
            self.counters["load_misses"] += len(keys) - len(loaded)
            if loaded:
                self._notify_keys_accessed(loaded)
            self._recovered("load")
        except Exception as exc:
            self._failed("load", "L2 load failed, reading as misses", exc)
        with self._lock:
            self._completed_load[task_id] = bitmap
        self._load_efd.notify()

    # -- delete, listing, usage -------------------------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove keys from the pool (LMCache's L2 eviction); bounded, synchronous by interface."""
        if not keys or self._closed:
            return
        try:
            deleted, sizes = self._call(self._delete(list(keys)), self.config.pool.timeout_s * DELETE_TIMEOUT_FACTOR)
        except KVPoolError as exc:
            logger.warning("kvpool: L2 delete of %d keys failed: %s", len(keys), exc)
            return
        if deleted:
            self._count_salt_bytes(deleted, sizes, -1)
            self._notify_keys_deleted(deleted, sizes)

    def _count_salt_bytes(self, keys: list[ObjectKey], sizes: list[int], sign: int) -> None:
        """This adapter's own stores and deletes since the last index scan, shown by ``get_usage`` at once."""
        with self._lock:
            for key, size in zip(keys, sizes):
                self._salt_delta[key.cache_salt] += sign * size

    async def _delete(self, keys: list[ObjectKey]) -> tuple[list[ObjectKey], list[int]]:
        names = [pool_key(k) for k in keys]
        entries = await self.client.index.lookup(names)
        await self.client.delete(names)
        present = [(k, e[0].nbytes) for k, e in zip(keys, entries) if e]
        return [k for k, _ in present], [n for _, n in present]

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> KeyListPage:  # fmt: skip
        """One page of this adapter's keys in the pool (Redis SCAN; ``cursor`` is opaque)."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ConfigError("page_size", f"must be a positive integer, got {page_size!r}")
        scan_cursor, skip = _parse_cursor(cursor)
        pattern = glob_escape(MP_KEY_PREFIX) + "*" + (f"@{glob_escape(model_name)}@*" if model_name else "")
        return self._call(self._list_page(pattern, page_size, scan_cursor, skip),
                          self.config.pool.timeout_s * DELETE_TIMEOUT_FACTOR)  # fmt: skip

    async def _list_page(self, pattern: str, page_size: int, scan_cursor: int, skip: int) -> KeyListPage:
        names: list[str] = []
        token: str | None = None
        while True:
            next_cursor, found = await self.client.index.scan_step(scan_cursor, pattern, count=max(page_size, 100))
            batch = found[skip:]
            room = page_size - len(names)
            names.extend(batch[:room])
            if len(batch) > room:  # resume inside this SCAN step next time
                token = f"{scan_cursor}:{skip + room}"
                break
            scan_cursor, skip = int(next_cursor), 0
            if scan_cursor == 0:
                break
            if len(names) >= page_size:
                token = f"{scan_cursor}:0"
                break
        entries = await self.client.index.lookup(names) if names else []
        out: list[KeyEntry] = []
        for name, entry in zip(names, entries):
            key = object_key_from_pool_key(name)
            if key is not None and entry:
                out.append(KeyEntry(EncodedObjectKey(key.chunk_hash.hex(), key.model_name, key.kv_rank,
                                                     key.object_group_id, key.cache_salt), entry[0].nbytes))  # fmt: skip
        return KeyListPage(tuple(out), token)

    def get_usage(self) -> AdapterUsage:
        """Pool capacity and fill from the registry; per-salt bytes from the pool index.

        Both come from the last background refresh (at most ``usage_refresh_ms`` old),
        so this never waits on the network. Until the first index scan, per-salt
        bytes are what this adapter stored and deleted itself.
        """
        view = self._view
        own = super().get_usage()
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
        async for batch in self.client.index.scan_entries(glob_escape(MP_KEY_PREFIX) + "*"):
            for name, entry in batch:
                key = object_key_from_pool_key(name)
                if key is not None and entry:
                    totals[key.cache_salt] += entry[0].nbytes
        return dict(totals)

    async def _refresh(self) -> None:
        with self._lock:  # the scan sees what was stored before it starts; keep counting what comes after
            before, self._salt_delta = self._salt_delta, Counter()
        try:
            nodes = await self.client.nodes(refresh=True)
            by_salt = await self.usage_by_salt()
        except KVPoolError as exc:
            with self._lock:
                self._salt_delta.update(before)
            self._view = dataclasses.replace(self._view, reachable=False, live_nodes=0)
            self._warn_once("registry", "kvpool: L2 adapter cannot read the pool registry: %s", exc)
            return
        self._recovered("registry")
        self._view = _PoolView(
            capacity_bytes=sum(n.capacity_bytes for n in nodes),
            used_bytes=sum(n.used_bytes for n in nodes),
            live_nodes=len(nodes),
            reachable=True,
            bytes_by_salt=by_salt,
            refreshed_at=time.time(),
        )

    async def _refresh_forever(self) -> None:
        while True:
            await self._refresh()
            await asyncio.sleep(self.config.usage_refresh_ms / 1000)

    def refresh_usage(self) -> None:
        """Refresh capacity and per-salt usage now (blocking, bounded); for tools and tests."""
        self._call(self._refresh(), self.config.pool.timeout_s * DELETE_TIMEOUT_FACTOR)

    # -- status and close -------------------------------------------------------------
    def report_status(self) -> dict[str, Any]:
        view = self._view
        with self._lock:
            locked = sum(len(v) for v in self._held.values())
            in_flight = len(self._tasks)
        loop_alive = self._thread.is_alive() and not self._closed
        return {
            "is_healthy": loop_alive and view.reachable and view.live_nodes > 0,
            "type": "KVPoolL2Adapter",
            "pool": self.config.pool.to_url(with_token=False),
            "event_loop_alive": loop_alive,
            "redis_reachable": view.reachable,
            "live_nodes": view.live_nodes,
            "capacity_bytes": view.capacity_bytes,
            "used_bytes": view.used_bytes,
            "locked_keys": locked,
            "in_flight_tasks": in_flight,
            "lock_ttl_ms": self.config.lock_ttl_ms,
            "counters": dict(self.counters),
        }

    def close(self) -> None:
        """Release held leases, close the client, stop the loop; bounded."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            held = [lock for locks in self._held.values() for lock in locks]
            self._held.clear()
        try:
            self._call(self._shutdown(held), CLOSE_TIMEOUT_S * 2)
        except KVPoolError as exc:
            logger.warning("kvpool: L2 adapter close was not clean: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()

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


def _parse_cursor(cursor: str | None) -> tuple[int, int]:
    if cursor is None:
        return 0, 0
    try:
        scan, skip = (int(part) for part in cursor.split(":"))
    except ValueError:
        raise ConfigError("cursor", f"{cursor!r} is not a cursor this adapter returned") from None
    if scan < 0 or skip < 0:
        raise ConfigError("cursor", f"{cursor!r} is not a cursor this adapter returned")
    return scan, skip


def _chunk(name: str, obj: MemoryObj) -> Chunk:
    """The pool chunk of a memory object: its bytes, plus its layout when it has one shape group."""
    data = memoryview(obj.byte_array).cast("B")
    shapes = getattr(obj.meta, "shapes", None) or [obj.get_shape()]
    fmt = int(obj.get_memory_format().value)
    if len(shapes) == 1:
        dtype = str(obj.get_dtype()).removeprefix("torch.")
        return Chunk(name, data, dtype=dtype, shape=tuple(int(d) for d in shapes[0]), fmt=fmt)
    return Chunk(name, data, fmt=fmt)  # several groups in one buffer: stored as plain bytes
