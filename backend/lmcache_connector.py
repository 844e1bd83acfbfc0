"""KVPoolConnector: kvpool as an LMCache 0.5 remote storage plugin.

Enable it in the LMCache config (``kvpool lmcache-config`` prints this)::

    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: backend.lmcache_connector
      remote_storage_plugin.kvpool.class_name: KVPoolConnectorAdapter
      remote_storage_plugin.kvpool.url: kvpool://127.0.0.1:6379/default

or, as one line (``kvpool lmcache-config --form remote_url``; also ``LMCACHE_REMOTE_URL``)::

    remote_url: external://127.0.0.1:6379/backend.lmcache_connector/?connector_name=KVPoolRemoteURLConnector&namespace=default

Never both: LMCache would build two remote backends and write every chunk twice.
This is the only module that imports LMCache (with the L2 adapter). Every method runs on LMCache's
event-loop thread and never blocks it; the ``*_sync`` methods are called from
LMCache's worker threads and wait on that loop with a bound. Library errors stop
here: they become misses, logged once per cause and counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from backend.client import Chunk, PoolClient
from backend.config import PoolConfig, without_inline_secrets
from backend.errors import ConfigError, KVPoolError, NcclError
from backend.lmcache_config import (
    ADAPTER_CLASS,
    ADAPTER_MODULE,
    PLUGIN_NAME,
    REMOTE_URL_CLASS,
    REMOTE_URL_FORM,
    remote_url_pool_config,
    url_config_key,
    warn_if_secrets_inline,
)
from backend.metrics import register_connector_metrics, unregister_connector_metrics
from backend.protocol import ItemMeta

__all__ = ["KVPoolConnector", "KVPoolConnectorAdapter", "KVPoolRemoteURLConnector", "diagnose"]

logger = logging.getLogger(__name__)

ALLOCATE_TIMEOUT_S = 1.0  # LMCache's allocator blocks while its buffer is full: bound it
ALLOCATE_RETRY_S = 0.002
CLOSE_TIMEOUT_S = 1.0
# The client's counters a connector reports as its own (the metrics and `kvpool doctor` show them).
CLIENT_COUNTERS = ("integrity_failures", "stale_entries", "get_failovers", "shm_get_bytes", "get_bytes_tcp",
                   "get_bytes_channel", "channel_fallbacks", "staged_put_bytes")  # fmt: skip
FIX_HINT = (
    "start a pool with `kvpool up` (it prints the URL), or check "
    "extra_config['remote_storage_plugin.kvpool.url'] / KVPOOL_URL"
)
REMOTE_URL_FIX_HINT = (
    "`kvpool lmcache-config --form remote_url --url kvpool://HOST:PORT/NAMESPACE` prints a valid remote_url "
    "(set it as remote_url or LMCACHE_REMOTE_URL, not both)"
)
_reported_remote_url_errors: set[str] = set()  # LMCache retries a failed connection: say each cause once


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise KVPoolError(f"stored dtype {name!r} is not a torch dtype")
    return dtype


class _LMCacheSink:
    """Receives chunks straight into memory objects from LMCache's own allocator."""

    def __init__(self, connector: KVPoolConnector) -> None:
        self.connector = connector

    async def allocate(self, meta: ItemMeta) -> tuple[MemoryObj, Any] | None:
        shape = torch.Size(meta.shape)
        dtype = _torch_dtype(meta.dtype)
        fmt = MemoryFormat(meta.fmt)
        deadline = time.monotonic() + ALLOCATE_TIMEOUT_S
        backend = self.connector.local_cpu_backend
        while True:
            obj = backend.allocate(shape, dtype, fmt, busy_loop=False)
            if obj is not None:
                view = obj.byte_array
                if len(view) != meta.nbytes:
                    obj.ref_count_down()
                    raise KVPoolError(
                        f"LMCache allocated {len(view)} bytes for {meta.key!r}, which holds {meta.nbytes}"
                    )
                return obj, view
            if time.monotonic() >= deadline:
                self.connector._miss("allocate", "LMCache's local buffer stayed full for %.1f s; "
                                     "reading as a miss (raise max_local_cpu_size)", ALLOCATE_TIMEOUT_S)  # fmt: skip
                return None
            await asyncio.sleep(ALLOCATE_RETRY_S)

    def release(self, handle: MemoryObj) -> None:
        handle.ref_count_down()


class KVPoolConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache ``RemoteConnector`` over a kvpool pool."""

    def __init__(
        self,
        pool_config: PoolConfig,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
        plugin_name: str = PLUGIN_NAME,
    ) -> None:
        super().__init__(config, metadata)
        self.pool_config = pool_config
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.client = PoolClient(pool_config)
        self._own_counters: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._sink = _LMCacheSink(self)
        self._closed = False
        self._plugin = plugin_name
        # In-process Prometheus: LMCache's own metrics live in the default registry too.
        register_connector_metrics(self._metric_counters, plugin_name)
        self.channel = self._open_channel()  # nccl_channel.channel.NcclChannel with nccl=on, else None
        # Report a pool that is down at start once, loudly: LMCache itself would
        # only ever show misses.
        asyncio.run_coroutine_threadsafe(self._startup_check(), loop)

    @property
    def counters(self) -> Counter[str]:
        """The connector's counters plus the client's: integrity, stale entries, failovers, bytes per path."""
        merged = Counter(self._own_counters)
        for name in CLIENT_COUNTERS:
            merged[name] = self.client.counters[name]
        return merged

    def _metric_counters(self) -> dict[str, int]:
        return dict(self.counters)

    # -- error boundary ---------------------------------------------------------------
    def _miss(self, cause: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        self._own_counters[f"miss_{cause}"] += 1
        if cause not in self._logged:
            self._logged.add(cause)
            logger.log(level, "kvpool: " + message, *args)

    def _recovered(self, cause: str) -> None:
        if cause in self._logged:
            self._logged.discard(cause)
            logger.warning("kvpool: %s recovered", cause)

    async def _startup_check(self) -> None:
        try:
            await self.client.ping()
            nodes = await self.client.nodes(refresh=True)
        except KVPoolError as exc:
            logger.error("kvpool: pool %s is unreachable at start (%s); every lookup misses until it is up. "
                         "Fix: %s", self.pool_config.to_url(with_token=False), exc, FIX_HINT)  # fmt: skip
            self._logged.add("redis")
            return
        if not nodes:
            logger.error("kvpool: pool %s has no live node; every lookup misses until one joins. "
                         "Fix: run `kvpool node --redis %s --namespace %s`",
                         self.pool_config.to_url(with_token=False), self.pool_config.redis_url,
                         self.pool_config.namespace)  # fmt: skip
        else:
            logger.info(
                "kvpool: connected to %s (%d live nodes)", self.pool_config.to_url(with_token=False), len(nodes)
            )

    def _run_sync(self, coro: Any, what: str) -> Any:
        """Run a coroutine on LMCache's loop from one of LMCache's worker threads."""
        if self._on_loop_thread():
            coro.close()
            raise KVPoolError(f"{what} was called on the event-loop thread, where it would block it")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(self.pool_config.timeout_s * 2)
        except TimeoutError:
            future.cancel()
            raise KVPoolError(f"{what} timed out") from None

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return getattr(self.loop, "_thread_id", None) == threading.get_ident()

    # -- lookup -----------------------------------------------------------------------
    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.batched_async_contains("", [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        try:
            hits = await self.client.hit_prefix([k.to_string() for k in keys])
        except KVPoolError as exc:
            self._miss("lookup", "lookup failed, reading as misses: %s", exc)
            return 0
        self._recovered("lookup")
        return int(hits)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        try:
            return int(self._run_sync(self.client.hit_prefix([k.to_string() for k in keys]), "batched_contains"))
        except KVPoolError as exc:
            self._miss("lookup", "lookup failed, reading as misses: %s", exc)
            return 0

    # -- put --------------------------------------------------------------------------
    def _chunk(self, key: CacheEngineKey, obj: MemoryObj) -> Chunk:
        shapes = obj.get_shapes() if hasattr(obj, "get_shapes") else [obj.get_shape()]
        if len(shapes) != 1:
            raise KVPoolError(f"memory objects with {len(shapes)} shape groups are not supported yet")
        return Chunk(
            key=key.to_string(),
            data=obj.byte_array,
            dtype=_dtype_name(obj.get_dtype()),
            shape=tuple(int(d) for d in obj.get_shape()),
            fmt=int(obj.get_memory_format().value),
        )

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: Sequence[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        # Returns only after the nodes answered: LMCache may reuse the buffers then.
        try:
            await self.client.put([self._chunk(k, o) for k, o in zip(keys, memory_objs)])
        except KVPoolError as exc:
            self._miss("put", "put failed, those chunks stay uncached: %s", exc)
            return
        self._recovered("put")
        self._own_counters["put_chunks"] += len(keys)

    # -- get --------------------------------------------------------------------------
    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        try:
            objs = await self.client.get([k.to_string() for k in keys], self._sink)
        except KVPoolError as exc:
            self._miss("get", "get failed, reading as misses: %s", exc)
            return [None] * len(keys)
        self._recovered("get")
        hits = sum(1 for o in objs if o is not None)
        self._own_counters["get_hits"] += hits
        self._own_counters["get_misses"] += len(keys) - hits
        return list(objs)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The hit prefix of ``keys``; objects after the first miss are released."""
        objs = await self.batched_get(keys)
        prefix: list[MemoryObj] = []
        missed = False
        for obj in objs:
            if obj is None:
                missed = True
            elif missed:
                obj.ref_count_down()
            else:
                prefix.append(obj)
        return prefix

    # -- channel (nccl_channel) --------------------------------------------------------
    def _open_channel(self) -> Any:
        """The channel for ``nccl=on``, or None (logged once) when it cannot run here."""
        if not self.pool_config.nccl:
            return None
        if not self.pool_config.cluster:
            logger.warning("kvpool: nccl=on without cluster=NAME: no node counts as same-cluster; chunks move over TCP")
            return None
        from nccl_channel.channel import NcclChannel, make_transport
        from nccl_channel.rendezvous import Rendezvous

        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cuda:0"
        try:
            transport = make_transport(self.pool_config.channel_transport, device)
        except NcclError as exc:
            logger.warning("kvpool: nccl=on, but %s; chunks move over TCP", exc)
            return None
        endpoint = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        channel = NcclChannel(transport, Rendezvous(self.client.index), endpoint, self.pool_config.cluster,
                              self.client.channel_request, self.pool_config.timeout_s,
                              pair_timeout_s=self.pool_config.pair_timeout_ms / 1000)  # fmt: skip
        self.client.use_channel(channel)
        logger.info("kvpool: channel endpoint %s (%s, cluster %s)", endpoint, transport.kind, self.pool_config.cluster)
        return channel

    # -- admin ------------------------------------------------------------------------
    async def list(self) -> list[str]:
        try:
            return await self.client.list_keys()
        except KVPoolError as exc:
            self._miss("list", "list failed: %s", exc)
            return []

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return bool(self._run_sync(self.client.delete([key.to_string()]), "remove_sync"))
        except KVPoolError as exc:
            self._miss("remove", "remove failed: %s", exc)
            return False

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when Redis answers and at least one node is alive; 1 otherwise."""
        try:
            await self.client.ping()
            return 0 if await self.client.nodes(refresh=True) else 1
        except KVPoolError:
            return 1

    async def close(self) -> None:
        """Close connections; bounded, never deadlocks on LMCache's loop."""
        if self._closed:
            return
        self._closed = True
        unregister_connector_metrics(self._plugin)
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if self.channel is not None:
                    await self.channel.close()
                await self.client.close()
        except TimeoutError:
            logger.warning("kvpool: close took longer than %.1f s; abandoning connections", CLOSE_TIMEOUT_S)

    def __repr__(self) -> str:
        return f"<KVPoolConnector {self.pool_config.to_url(with_token=False)}>"


class KVPoolConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """What LMCache loads from ``remote_storage_plugins: ["kvpool"]``."""

    def __init__(self) -> None:
        super().__init__(f"{PLUGIN_NAME}://")

    def can_parse(self, url: str) -> bool:
        if url.startswith(f"{PLUGIN_NAME}://"):
            return True
        name = url.removeprefix("plugin://") if url.startswith("plugin://") else ""
        return name.split(".", 1)[0] == PLUGIN_NAME

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        plugin_name = context.plugin_name or PLUGIN_NAME
        try:
            pool_config = self._pool_config(context, plugin_name)
        except ConfigError as exc:
            logger.error("kvpool: plugin %r is misconfigured, LMCache will run without it: %s. Fix: %s",
                         plugin_name, exc, FIX_HINT)  # fmt: skip
            raise
        return KVPoolConnector(
            pool_config, context.loop, context.local_cpu_backend, context.config, context.metadata, plugin_name
        )

    @staticmethod
    def _pool_config(context: ConnectorContext, plugin_name: str) -> PoolConfig:
        extra = (context.config.extra_config if context.config is not None else None) or {}
        url = extra.get(url_config_key(plugin_name))
        if not url and context.url.startswith(f"{PLUGIN_NAME}://"):
            url = context.url
        if url:
            warn_if_secrets_inline(str(url), f"extra_config['{url_config_key(plugin_name)}']")
        url = url or os.environ.get("KVPOOL_URL")
        if not url:
            raise ConfigError(url_config_key(plugin_name), "no pool URL given (nor KVPOOL_URL)")
        return PoolConfig.from_url(str(url), os.environ)


class KVPoolRemoteURLConnector(KVPoolConnector):
    """What LMCache builds from ``remote_url: external://HOST:PORT/backend.lmcache_connector/?connector_name=...``.

    LMCache's ``ExternalConnectorAdapter`` calls ``CLASS(loop=, local_cpu_backend=, config=)``:
    the pool comes from ``config.remote_url`` (see ``lmcache_config.remote_url_pool_config``),
    the engine metadata, which LMCache does not pass, from the local CPU backend. The rest
    is :class:`KVPoolConnector`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any) -> None:
        remote_url = str(getattr(config, "remote_url", None) or "")
        warn_if_secrets_inline(remote_url, REMOTE_URL_FORM)
        try:
            pool_config = remote_url_pool_config(remote_url, os.environ)
            metadata = getattr(local_cpu_backend, "metadata", None)
            if metadata is None:
                raise ConfigError("remote_url", "LMCache passed a local CPU backend without engine metadata, "
                                  "which the connector needs")  # fmt: skip
        except ConfigError as exc:
            # LMCache only logs a failed connector at WARNING and runs on without it (and retries,
            # which would repeat this): one ERROR per cause.
            if str(exc) not in _reported_remote_url_errors:
                _reported_remote_url_errors.add(str(exc))
                logger.error("kvpool: remote_url is misconfigured, LMCache will run without kvpool: %s. Fix: %s",
                             exc, REMOTE_URL_FIX_HINT)  # fmt: skip
            raise
        super().__init__(pool_config, loop, local_cpu_backend, config, metadata)


DOCTOR_MODEL = "kvpool-doctor/probe"
DOCTOR_TIMEOUT_S = 30.0


def diagnose(config_path: Path) -> list[dict[str, Any]]:
    """Check an LMCache config end to end, the way LMCache itself would use it.

    Loads the file with LMCache's loader (``LMCACHE_*`` variables included, as an engine
    would), checks whichever form enables kvpool (the plugin entry or ``remote_url``),
    builds LMCache's storage backends from it (so a connector that fails to load shows
    here, not as silent misses), checks Redis and the nodes, and makes one put/get round
    trip through LMCache's RemoteBackend. Returns findings: ``{"ok", "check", "detail", "fix"}``.
    """
    from lmcache.v1.config import load_engine_config_with_overrides

    findings: list[dict[str, Any]] = []

    def add(ok: bool, check: str, detail: str, fix: str = "") -> bool:
        findings.append({"ok": ok, "check": check, "detail": detail, "fix": fix})
        return ok

    try:
        config = load_engine_config_with_overrides(config_file_path=str(config_path))
    except Exception as exc:  # LMCache raises many kinds here
        add(False, "LMCache config", f"{config_path} does not load: {exc}", "fix the YAML (see docs/quickstart.md)")
        return findings
    add(True, "LMCache config", f"{config_path} loads")
    plugins = [str(p) for p in (config.remote_storage_plugins or [])]
    names = [p for p in plugins if p.split(".", 1)[0] == PLUGIN_NAME]
    remote_url = str(config.remote_url or "")
    if names:
        pool_config = _check_plugin_form(config, names[0], add)
        backend_name, label = f"RemoteBackend-{names[0]}", "plugin loaded"
    elif remote_url:
        pool_config = _check_remote_url_form(remote_url, add)
        backend_name, label = "RemoteBackend", "connector loaded"
    else:
        add(False, "kvpool enabled", f"remote_storage_plugins = {plugins} and remote_url is unset",
            f'set remote_storage_plugins: ["{PLUGIN_NAME}"] (`kvpool lmcache-config` prints the config), or '
            "remote_url (`kvpool lmcache-config --form remote_url`)")  # fmt: skip
        return findings
    if pool_config is None:
        return findings

    async def probe_pool() -> tuple[float, int]:
        async with PoolClient(pool_config) as client:
            return await client.ping(), len(await client.nodes(refresh=True))

    try:
        rtt_ms, live = asyncio.run(probe_pool())
    except KVPoolError as exc:
        add(False, "Redis", str(exc), "start the pool (`kvpool up`) or fix the host/port in the URL")
        return findings
    add(True, "Redis", f"reachable ({rtt_ms:.2f} ms)")
    if not add(live > 0, "nodes", f"{live} live", f"start one: kvpool node --redis {pool_config.redis_url} "
               f"--namespace {pool_config.namespace}"):  # fmt: skip
        return findings
    _round_trip(config, backend_name, label, add)
    return findings


def _check_plugin_form(config: Any, plugin: str, add: Any) -> PoolConfig | None:
    """The plugin entry's module, class and pool URL; None when the URL is unusable."""
    extra = config.extra_config or {}
    for suffix, expected in (("module_path", ADAPTER_MODULE), ("class_name", ADAPTER_CLASS)):
        key = f"remote_storage_plugin.{plugin}.{suffix}"
        add(extra.get(key) == expected, key, f"is {extra.get(key)!r}", f"set extra_config['{key}'] = {expected!r}")
    if config.remote_url:
        add(False, "remote_url", f"is also set ({_shown(str(config.remote_url))}): LMCache builds a second remote "
            "backend and writes every chunk twice", "remove remote_url (and LMCACHE_REMOTE_URL); the plugin entry "
            "is enough")  # fmt: skip
    try:
        pool_config = PoolConfig.from_url(str(extra.get(url_config_key(plugin)) or os.environ.get("KVPOOL_URL", "")),
                                          os.environ)  # fmt: skip
    except ConfigError as exc:
        add(False, "pool URL", str(exc), f"set extra_config['{url_config_key(plugin)}'] = kvpool://HOST:PORT/NAMESPACE")
        return None
    add(True, "pool URL", pool_config.to_url(with_token=False))
    return pool_config


def _check_remote_url_form(remote_url: str, add: Any) -> PoolConfig | None:
    """``remote_url`` names kvpool's connector and a usable pool; None when it does not."""
    source = "LMCACHE_REMOTE_URL" if os.environ.get("LMCACHE_REMOTE_URL") else "remote_url"
    parts = urlsplit(remote_url.strip())
    module = parts.path.strip("/")
    connector = dict(parse_qsl(parts.query)).get("connector_name", "")
    named = module == ADAPTER_MODULE and connector == REMOTE_URL_CLASS
    add(named, "remote_url connector", f"{source} is {_shown(remote_url)}",
        f"external://HOST:PORT/{ADAPTER_MODULE}/?connector_name={REMOTE_URL_CLASS}&namespace=NS "
        "(`kvpool lmcache-config --form remote_url` prints it)")  # fmt: skip
    try:
        pool_config = remote_url_pool_config(remote_url, os.environ)
    except ConfigError as exc:
        add(False, "pool URL", str(exc), REMOTE_URL_FIX_HINT)
        return None
    add(True, "pool URL", f"{pool_config.to_url(with_token=False)} (from {source})")
    return pool_config if named else None


def _shown(url: str) -> str:
    return without_inline_secrets(url)[0]


def _round_trip(config: Any, backend_name: str, label: str, add: Any) -> None:
    """Build LMCache's storage from ``config`` and move one chunk through its ``backend_name``."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    chunk = int(config.chunk_size)
    metadata = LMCacheMetadata(model_name=DOCTOR_MODEL, world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, chunk, 1, 64))  # fmt: skip
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kvpool-doctor", daemon=True)
    thread.start()
    backends: dict[str, Any] = {}
    try:
        backends = CreateStorageBackends(config, metadata, loop)
        remote: Any = backends.get(backend_name)
        if not add(remote is not None and remote.connection is not None, label,
                   f"LMCache built {backend_name}" if remote is not None and remote.connection is not None
                   else "LMCache has no working kvpool backend (LMCache hides why: see its log above)",
                   "check that kvpool is installed in this Python environment (pip install 'kvpool[lmcache]')"):  # fmt: skip
            return
        local = backends["LocalCPUBackend"]
        shape = torch.Size([2, 2, chunk, 64])
        obj = local.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        if obj is None:
            add(False, "round trip", "LMCache could not allocate a probe chunk", "raise max_local_cpu_size")
            return
        obj.tensor.copy_(torch.randn(shape).to(torch.bfloat16))
        expected = obj.tensor.clone()
        key = CacheEngineKey(DOCTOR_MODEL, 1, 0, int(time.time() * 1000), torch.bfloat16)
        done = threading.Event()
        remote.batched_submit_put_task([key], [obj], on_complete_callback=lambda _k: done.set())
        obj.ref_count_down()
        if not done.wait(DOCTOR_TIMEOUT_S) or not remote.contains(key):
            add(False, "round trip", "the probe chunk was not stored", "see `kvpool status` and the node logs")
            return
        got = remote.get_blocking(key)
        same = got is not None and torch.equal(got.tensor.view(torch.uint8), expected.view(torch.uint8))
        if got is not None:
            got.ref_count_down()
        remote.remove(key)
        add(same, "round trip", "put and get through LMCache's RemoteBackend, byte-identical" if same
            else "the probe chunk came back different or not at all", "run `kvpool check --deep`")  # fmt: skip
    finally:
        closer = threading.Thread(target=lambda: [b.close() for b in backends.values()], daemon=True)
        closer.start()
        closer.join(5.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
