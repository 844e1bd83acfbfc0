"""KVPoolConnector: kvpool as an LMCache 0.5 remote storage plugin.

Enable it in the LMCache config (``kvpool lmcache-config`` prints this)::

    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.lmcache_connector
      remote_storage_plugin.kvpool.class_name: KVPoolConnectorAdapter
      remote_storage_plugin.kvpool.url: kvpool://127.0.0.1:6379/default

or, as one line (``kvpool lmcache-config --form remote_url``; also ``LMCACHE_REMOTE_URL``)::

    remote_url: external://127.0.0.1:6379/kvpool.lmcache_connector/?connector_name=KVPoolRemoteURLConnector&namespace=default

Never both: LMCache would build two remote backends and write every chunk twice.
``kvpool.lmcache_connector``, the module those configs name, re-exports this one.
Every method runs on LMCache's event-loop thread and never blocks it; the ``*_sync``
methods are called from LMCache's worker threads and wait on that loop with a bound.
Library errors stop here (``MissBoundary``): they become misses, logged once per cause
and counted. Memory objects become chunks and back by ``backend.lmcache.chunks``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from backend.admin import DEFAULT_PIN_OWNER, UnpinReport
from backend.client import PoolClient
from backend.config import PoolConfig
from backend.counters import ClientCounter, ConnectorCounter, MissCause
from backend.errors import BusyError, ConfigError, KVPoolError
from backend.lmcache.boundary import MissBoundary
from backend.lmcache.chunks import ALLOCATE_TIMEOUT_S, LMCacheSink, to_chunk
from backend.lmcache.config import (
    PLUGIN_NAME,
    REMOTE_URL_FORM,
    pool_config_from,
    remote_url_pool_config,
    url_config_key,
    warn_if_secrets_inline,
)
from backend.lmcache.layout import EngineFingerprint
from backend.lmcache.pool_health import PoolHealth
from backend.lmcache.prompts import PromptPin, PromptPins
from backend.lmcache.tenant_names import key_names
from backend.lmcache.token_binding import TokenBinding
from backend.metrics import register_connector_metrics, unregister_connector_metrics

__all__ = [
    "KVPoolConnector",
    "KVPoolConnectorAdapter",
    "KVPoolRemoteURLConnector",
    "ALLOCATE_TIMEOUT_S",
    "CLIENT_COUNTERS",
    "FIX_HINT",
    "REMOTE_URL_FIX_HINT",
]

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 1.0
# The client's counters a connector reports as its own (the metrics and `kvpool doctor` show them).
CLIENT_COUNTERS: tuple[ClientCounter, ...] = (
    ClientCounter.INTEGRITY_FAILURES,
    ClientCounter.STALE_ENTRIES,
    ClientCounter.LAYOUT_MISSES,
    ClientCounter.GET_FAILOVERS,
    ClientCounter.SHM_GET_BYTES,
    ClientCounter.GET_BYTES_TCP,
    ClientCounter.GET_BYTES_CHANNEL,
    ClientCounter.CHANNEL_FALLBACKS,
    ClientCounter.STAGED_PUT_BYTES,
    ClientCounter.NODES_MARKED_DOWN,
    ClientCounter.NODES_RESTORED,
    ClientCounter.TOUCHES_SENT,
    ClientCounter.TOUCHES_DROPPED,
    ClientCounter.TOUCH_REFUSALS,
)
FIX_HINT = (
    "start a pool with `kvpool up` (it prints the URL), or check "
    "extra_config['remote_storage_plugin.kvpool.url'] / KVPOOL_URL"
)
REMOTE_URL_FIX_HINT = (
    "`kvpool lmcache-config --form remote_url --url kvpool://HOST:PORT/NAMESPACE` prints a valid remote_url "
    "(set it as remote_url or LMCACHE_REMOTE_URL, not both)"
)
_reported_remote_url_errors: set[str] = set()  # LMCache retries a failed connection: say each cause once


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
        self._own_counters: Counter[str] = Counter()  # ConnectorCounter and MissCause.counter names
        # Each key's pool name; with tenant_tag= the key's tag names its tenant, and names come scoped.
        self.names = key_names(pool_config, self._own_counters)
        self.client = PoolClient(dataclasses.replace(pool_config, tenant="") if pool_config.tenant_tag else pool_config)
        self.misses = MissBoundary(self._own_counters)
        # What every chunk is stored with and read back by: only this layout's engines share chunks.
        self.layout = EngineFingerprint(metadata, config)
        self.prompts = PromptPins(
            self.client, config, metadata, pool_config.tenant if pool_config.tenant_tag else ""
        )  # pin_prompt: a prompt's chunks by its tokens
        self.tokens = TokenBinding(self, self._own_counters, pool_config.event_tokens)  # event_tokens=on
        # meta_shapes/meta_dtypes: the engine's groups, set by RemoteConnector from LMCache's metadata.
        self._sink = LMCacheSink(local_cpu_backend, self.meta_shapes, self.meta_dtypes, self.misses, self.layout)
        self._closed = False
        self._plugin = plugin_name
        # Whether the pool can serve this engine: said once at start with its cause, rechecked until it can.
        self.health = PoolHealth(self.client, pool_config.to_url(with_token=False), FIX_HINT, lambda: self._closed)
        # In-process Prometheus: LMCache's own metrics live in the default registry too.
        register_connector_metrics(self._metric_counters, plugin_name, self.health.state)
        self.channel = self.client.channel  # built by the client from nccl=on; None when off or it cannot run here
        # Report a pool that is not usable at start once, loudly, with its cause: LMCache itself
        # would only ever show misses. On LMCache's loop, never blocking it.
        asyncio.run_coroutine_threadsafe(self.health.startup_check(), loop)

    @property
    def counters(self) -> Counter[str]:
        """The connector's counters plus the client's: integrity, stale entries, failovers, bytes per path."""
        merged = Counter(self._own_counters)
        for name in CLIENT_COUNTERS:
            merged[str(name)] = self.client.counters[name]
        return merged

    def _metric_counters(self) -> dict[str, int]:
        return {str(name): value for name, value in self.counters.items()}

    def _run_sync(self, coro: Any, what: str) -> Any:
        """Run a coroutine on LMCache's loop from one of LMCache's worker threads."""
        if self._on_loop_thread():
            coro.close()
            raise KVPoolError(f"{what} was called on the event-loop thread, where it would block it")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(self.client.deadlines.connector_call_s)
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
        self.tokens.ensure()  # the engine is listed by now: its stores' chunks are bound from the first store on
        try:
            hits = await self.client.hit_prefix(self.names.prefix(keys))
        except KVPoolError as exc:
            self.misses.miss(MissCause.LOOKUP, "lookup failed, reading as misses: %s", exc)
            return 0
        self.misses.recovered(MissCause.LOOKUP)
        return int(hits)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        self.tokens.ensure()  # (as in batched_async_contains)
        try:
            return int(self._run_sync(self.client.hit_prefix(self.names.prefix(keys)), "batched_contains"))
        except KVPoolError as exc:
            self.misses.miss(MissCause.LOOKUP, "lookup failed, reading as misses: %s", exc)
            return 0

    # -- put --------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: Sequence[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        # Returns only after the nodes answered: LMCache may reuse the buffers then.
        named = [(n, o, k.chunk_hash) for n, o, k in zip(self.names.names(keys), memory_objs, keys) if n is not None]
        if not named:
            return
        try:
            fingerprint, tokens = self.layout.value, self.tokens.tokens([h for _, _, h in named])
            await self.client.put([to_chunk(n, o, fingerprint, t) for (n, o, _), t in zip(named, tokens)])
        except BusyError as exc:
            # The pool was saturated, nothing failed: a skipped put, as when LMCache skips one.
            skipped = sum(exc.not_stored().values())
            self._own_counters[ConnectorCounter.PUT_SKIPPED_BUSY] += skipped
            self._own_counters[ConnectorCounter.PUT_CHUNKS] += len(named) - skipped
            logger.debug("kvpool: put skipped, the pool is busy: %s", exc)
            return
        except KVPoolError as exc:
            self.misses.miss(MissCause.PUT, "put failed, those chunks stay uncached: %s", exc)
            return
        self.misses.recovered(MissCause.PUT)
        self._own_counters[ConnectorCounter.PUT_CHUNKS] += len(named)

    # -- get --------------------------------------------------------------------------
    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        names = self.names.names(keys)
        try:
            got = iter(await self.client.get([n for n in names if n is not None], self._sink))
        except KVPoolError as exc:
            self.misses.miss(MissCause.GET, "get failed, reading as misses: %s", exc)
            return [None] * len(keys)
        objs = [None if name is None else next(got) for name in names]  # a refused key: a miss, never asked
        self.misses.recovered(MissCause.GET)
        hits = sum(1 for o in objs if o is not None)
        self._own_counters[ConnectorCounter.GET_HITS] += hits
        self._own_counters[ConnectorCounter.GET_MISSES] += len(keys) - hits
        return objs

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The hit prefix of ``keys``; objects after the first miss are released."""
        return _hit_prefix(await self.batched_get(keys))

    # -- admin ------------------------------------------------------------------------
    async def list(self) -> list[str]:
        try:
            return [self.names.listed(key) for key in await self.client.list_keys()]
        except KVPoolError as exc:
            self.misses.miss(MissCause.LIST, "list failed: %s", exc)
            return []

    def remove_sync(self, key: CacheEngineKey) -> bool:
        (name,) = self.names.names([key])
        if name is None:
            return False
        try:
            return bool(self._run_sync(self.client.delete([name]), "remove_sync"))
        except KVPoolError as exc:
            self.misses.miss(MissCause.REMOVE, "remove failed: %s", exc)
            return False

    # -- pins of a prompt (backend/lmcache/prompts.py): unlike the data path, errors raise --------
    async def pin_prompt(
        self,
        tokens: Sequence[int] | Any,
        ttl_s: float | None = None,
        owner: str = DEFAULT_PIN_OWNER,
        tenant: str | None = None,
    ) -> PromptPin:
        """Pin a prompt by its token ids (docs/fleet.md): its chunks the pool holds from the start up to the first
        missing one, until unpinned or ``ttl_s`` ends (None: the nodes' default). ``tenant``: whose chunks (None:
        the URL's ``tenant``'s, or no tenant's); under ``tenant_tag=`` any tenant, but only the URL's with a
        tenant's token (ConfigError naming ``tenant`` otherwise, nothing pinned). On LMCache's loop."""
        return await self.prompts.pin(tokens, ttl_s, owner, tenant)

    def pin_prompt_sync(
        self,
        tokens: Sequence[int] | Any,
        ttl_s: float | None = None,
        owner: str = DEFAULT_PIN_OWNER,
        tenant: str | None = None,
    ) -> PromptPin:
        """:meth:`pin_prompt` from any thread but LMCache's loop (waits on the loop, bounded)."""
        return cast(PromptPin, self._run_sync(self.prompts.pin(tokens, ttl_s, owner, tenant), "pin_prompt_sync"))

    async def unpin_prompt(
        self, tokens: Sequence[int] | Any, owner: str = DEFAULT_PIN_OWNER, tenant: str | None = None
    ) -> UnpinReport:
        """Let go of one of ``owner``'s pins of each chunk of the prompt (``tenant``'s, as in :meth:`pin_prompt`).
        On LMCache's loop."""
        return await self.prompts.unpin(tokens, owner, tenant)

    def unpin_prompt_sync(
        self, tokens: Sequence[int] | Any, owner: str = DEFAULT_PIN_OWNER, tenant: str | None = None
    ) -> UnpinReport:
        """:meth:`unpin_prompt` from any thread but LMCache's loop."""
        return cast(UnpinReport, self._run_sync(self.prompts.unpin(tokens, owner, tenant), "unpin_prompt_sync"))

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
        self.health.close()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self.client.close()  # the channel's pairs too
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
            # LMCache's own callers (CreateConnector(url, loop, local_cpu_backend, config), its tests) may pass
            # no metadata: the engine's is then the local CPU backend's, as for remote_url.
            metadata = context.metadata
            if metadata is None:
                metadata = _engine_metadata(context.local_cpu_backend, f"plugin {plugin_name!r}")
        except ConfigError as exc:
            logger.error(
                "kvpool: plugin %r is misconfigured, LMCache will run without it: %s. Fix: %s",
                plugin_name,
                exc,
                FIX_HINT,
            )
            raise
        return KVPoolConnector(
            pool_config, context.loop, context.local_cpu_backend, context.config, metadata, plugin_name
        )

    @staticmethod
    def _pool_config(context: ConnectorContext, plugin_name: str) -> PoolConfig:
        extra = (context.config.extra_config if context.config is not None else None) or {}
        url = extra.get(url_config_key(plugin_name))
        if not url and context.url.startswith(f"{PLUGIN_NAME}://"):
            url = context.url
        return pool_config_from(url or None, f"extra_config['{url_config_key(plugin_name)}']")


def _hit_prefix(objs: Sequence[MemoryObj | None]) -> list[MemoryObj]:
    """The objects before the first miss; those after it are released (LMCache loads a prefix)."""
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


def _engine_metadata(local_cpu_backend: Any, where: str) -> Any:
    """The engine's LMCache metadata, from its local CPU backend (ConfigError naming ``where`` if it has none)."""
    metadata = getattr(local_cpu_backend, "metadata", None)
    if metadata is None:
        raise ConfigError(
            where, "LMCache passed no engine metadata and a local CPU backend without it, which the connector needs"
        )
    return metadata


class KVPoolRemoteURLConnector(KVPoolConnector):
    """What LMCache builds from ``remote_url: external://HOST:PORT/kvpool.lmcache_connector/?connector_name=...``.

    LMCache's ``ExternalConnectorAdapter`` calls ``CLASS(loop=, local_cpu_backend=, config=)``:
    the pool comes from ``config.remote_url`` (see ``backend.lmcache.config.remote_url_pool_config``),
    the engine metadata, which LMCache does not pass, from the local CPU backend. The rest
    is :class:`KVPoolConnector`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any) -> None:
        remote_url = str(getattr(config, "remote_url", None) or "")
        warn_if_secrets_inline(remote_url, REMOTE_URL_FORM)
        try:
            pool_config = remote_url_pool_config(remote_url, os.environ)
            metadata = _engine_metadata(local_cpu_backend, "remote_url")
        except ConfigError as exc:
            # LMCache only logs a failed connector at WARNING and runs on without it (and retries,
            # which would repeat this): one ERROR per cause.
            if str(exc) not in _reported_remote_url_errors:
                _reported_remote_url_errors.add(str(exc))
                logger.error(
                    "kvpool: remote_url is misconfigured, LMCache will run without kvpool: %s. Fix: %s",
                    exc,
                    REMOTE_URL_FIX_HINT,
                )
            raise
        super().__init__(pool_config, loop, local_cpu_backend, config, metadata)
