"""``kvpool doctor``: an LMCache config checked end to end, the way LMCache itself would use it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import torch
from lmcache.v1.memory_management import MemoryFormat

from backend.client import PoolClient
from backend.config import PoolConfig, format_size, mask_secrets, without_inline_secrets
from backend.doctor import Finding, check_pool
from backend.doctor.findings import PLUGIN_NOT_LOADED, State
from backend.doctor.memory import check_cache_size, memory_limit
from backend.errors import ConfigError
from backend.lmcache.config import (
    ADAPTER_CLASS,
    ADAPTER_MODULE,
    KEPT_ADAPTER_MODULES,
    PLUGIN_NAME,
    REMOTE_URL_CLASS,
    pool_config_from,
    remote_url_pool_config,
    url_config_key,
)
from backend.lmcache.connector import REMOTE_URL_FIX_HINT
from backend.threads import LoopThread

__all__ = ["diagnose"]

# The modules a config may name: the printed (public) path, or one that earlier configs name.
CONNECTOR_MODULES = (ADAPTER_MODULE, *KEPT_ADAPTER_MODULES)


DOCTOR_MODEL = "kvpool-doctor/probe"
DOCTOR_TIMEOUT_S = 30.0
# The probe's KV shape per token: (K and V, layers, heads, head size) of bfloat16, 512 bytes a token.
PROBE_KV_LAYERS, PROBE_KV_HEADS, PROBE_HEAD_SIZE = 2, 1, 64
PROBE_CHUNKS = 4  # the CPU buffer LMCache is built with holds this many probe chunks, and no less than:
PROBE_MIN_CPU_BYTES = 16 * 2**20
GIB = 2**30
MIN_MASKED = 4  # a shorter secret is not searched for in text (it would mask ordinary words); URLs are masked anyway


def diagnose(config_path: Path) -> list[Finding]:
    """Check an LMCache config end to end, the way LMCache itself would use it.

    Loads the file with LMCache's loader (``LMCACHE_*`` variables included, as an engine
    would), checks whichever form enables kvpool (the plugin entry or ``remote_url``),
    checks its CPU cache size against this host's (or container's) memory, builds
    LMCache's storage backends from it (so a connector that fails to load shows here, not
    as silent misses), checks Redis and the nodes, and makes one put/get round trip
    through LMCache's RemoteBackend. The backends are built from the same file loaded
    again with its memory settings overridden (:func:`probe_overrides`): the probe moves
    one small chunk, and an engine's gigabytes of cache would only make doctor slow and
    big enough to be killed where the engine itself fits. The pool's checks are
    ``backend.doctor.check_pool``'s, so a failure names its cause (docs/troubleshooting.md).
    """
    known: list[str] = []  # the pool's secrets, once its config is read
    with _secrets_masked(known):
        return _diagnose(config_path, known)


@contextlib.contextmanager
def _secrets_masked(known: list[str]) -> Iterator[None]:
    """Every log record made meanwhile, by LMCache or kvpool, shown with its secrets masked.

    LMCache logs its whole configuration at INFO as it loads it, pool URL included: a
    token or Redis password written into the YAML doctor checks would be printed. The
    record factory masks every record as it is made, whatever logger or handler
    (LMCache gives each module its own) prints it; ``known`` adds secrets read from
    files or the environment once the pool's config is known.
    """
    make = logging.getLogRecordFactory()

    def masked(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # a malformed record: logging reports it as it would have
            return record
        shown = mask_secrets(text, known)
        if shown != text:
            record.msg, record.args = shown, None
        return record

    logging.setLogRecordFactory(masked)
    try:
        yield
    finally:
        logging.setLogRecordFactory(make)


def _diagnose(config_path: Path, known: list[str]) -> list[Finding]:
    from lmcache.v1.config import load_engine_config_with_overrides

    findings: list[Finding] = []

    def masked(f: Finding) -> Finding:
        return Finding(f.check, f.state, mask_secrets(f.detail, known), mask_secrets(f.fix, known), f.cause)

    def add(ok: bool, check: str, detail: str, fix: str = "", cause: Any = None) -> bool:
        state = State.OK if ok else State.FAIL
        findings.append(masked(Finding(check, state, detail, fix if not ok else "", cause if not ok else None)))
        return ok

    try:
        config = load_engine_config_with_overrides(config_file_path=str(config_path))
    except Exception as exc:  # LMCache raises many kinds here
        add(False, "LMCache config", f"{config_path} does not load: {exc}", "fix the YAML (see docs/quickstart.md)")
        return findings
    add(True, "LMCache config", f"{config_path} loads")
    if float(config.max_local_cpu_size) > 0:
        configured = int(float(config.max_local_cpu_size) * GIB)
        findings.append(check_cache_size("LMCache memory", "max_local_cpu_size", configured, memory_limit()))
    plugins = [str(p) for p in (config.remote_storage_plugins or [])]
    names = [p for p in plugins if p.split(".", 1)[0] == PLUGIN_NAME]
    remote_url = str(config.remote_url or "")
    if names:
        pool_config, loads = _check_plugin_form(config, names[0], add)
        backend_name, label = f"RemoteBackend-{names[0]}", "plugin loaded"
        url_key = url_config_key(names[0])
        url_text = str((config.extra_config or {}).get(url_key) or os.environ.get("KVPOOL_URL", ""))
        pool_override: dict[str, Any] = {
            "extra_config": {**(config.extra_config or {}), url_key: _without_shm(url_text)}
        }
    elif remote_url:
        pool_config, loads = _check_remote_url_form(remote_url, add), True
        backend_name, label = "RemoteBackend", "connector loaded"
        pool_override = {"remote_url": _without_shm(remote_url)}
    else:
        add(
            False,
            "kvpool enabled",
            f"remote_storage_plugins = {plugins} and remote_url is unset",
            f'set remote_storage_plugins: ["{PLUGIN_NAME}"] (`kvpool lmcache-config` prints the config), or '
            "remote_url (`kvpool lmcache-config --form remote_url`)",
            PLUGIN_NOT_LOADED,
        )
        return findings
    if pool_config is None:
        return findings
    known += [secret for secret in (pool_config.token, pool_config.redis_password) if len(secret) >= MIN_MASKED]

    async def probe_pool() -> list[Finding]:
        client = PoolClient(pool_config)  # not opened: check_pool names what opening would refuse
        try:
            return await check_pool(client)
        finally:
            await client.close()

    pool = [masked(f) for f in asyncio.run(probe_pool())]
    findings += pool
    if not loads:  # a consequence of the failure above, not a second cause
        findings.append(Finding.skipped("round trip", "not run: LMCache cannot load the plugin (above)"))
    elif all(f.ok for f in pool):
        overrides = {**probe_overrides(int(config.chunk_size)), **pool_override}
        probe_config = load_engine_config_with_overrides(config_file_path=str(config_path), overrides=overrides)
        _round_trip(probe_config, backend_name, label, add)
    return findings


def _without_shm(url: str) -> str:
    """``url`` with ``shm=false``: the probe's client neither maps a same-host node's arena (its whole DRAM
    tier, counted in the probe's resident memory) nor makes a put stage, and goes over TCP."""
    parts = urlsplit(url.strip())
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "shm"]
    return urlunsplit(parts._replace(query=urlencode([*query, ("shm", "false")], safe="/:,")))


def probe_chunk_shape(chunk_tokens: int) -> tuple[int, int, int, int]:
    """The probe chunk's KV_2LTD shape: K and V, layers, tokens, hidden size."""
    return (2, PROBE_KV_LAYERS, chunk_tokens, PROBE_KV_HEADS * PROBE_HEAD_SIZE)


def probe_overrides(chunk_tokens: int) -> dict[str, Any]:
    """The memory settings the probe's LMCache is built with, whatever the config asks for: a CPU buffer of
    a few probe chunks, no reserve (which would shrink it to nothing on a small host), no huge pages."""
    chunk_bytes = 2 * math.prod(probe_chunk_shape(chunk_tokens))  # bfloat16
    cpu_bytes = max(PROBE_MIN_CPU_BYTES, PROBE_CHUNKS * chunk_bytes)
    return {
        "max_local_cpu_size": cpu_bytes / GIB,
        "reserve_local_cpu_size": 0.0,
        "local_cpu_use_hugepages": False,
        "enable_lazy_memory_allocator": False,
    }


def _check_plugin_form(config: Any, plugin: str, add: Any) -> tuple[PoolConfig | None, bool]:
    """The plugin entry's module, class and pool URL: (the pool, or None when the URL is unusable; whether
    LMCache can load the plugin). A class or module that does not load is one failure, whose fix names the
    key to correct; a consequence of it (LMCache building no kvpool backend) is not a second."""
    extra = config.extra_config or {}
    module_path = extra.get(f"remote_storage_plugin.{plugin}.module_path")
    class_name = extra.get(f"remote_storage_plugin.{plugin}.class_name")
    wrong = [
        (key, allowed[0])
        for suffix, allowed in (("module_path", CONNECTOR_MODULES), ("class_name", (ADAPTER_CLASS,)))
        if extra.get(key := f"remote_storage_plugin.{plugin}.{suffix}") not in allowed
    ]
    loads, check, detail = _plugin_import(plugin, module_path, class_name)
    if loads:
        add(True, check, detail)
        for key, right in wrong:  # it loads, from a path kvpool does not promise to keep
            add(False, key, f"is {extra.get(key)!r}", f"set extra_config['{key}'] = {right!r}", PLUGIN_NOT_LOADED)
    else:
        fix = " and ".join(f"set extra_config['{key}'] = {right!r}" for key, right in wrong) or (
            "install kvpool in the engine's Python environment (`pip install -e '.[lmcache]'` from the kvpool "
            "checkout): `python -c 'import kvpool.lmcache_connector'` there must work"
        )
        add(False, check, detail, fix, PLUGIN_NOT_LOADED)
    if config.remote_url:
        add(
            False,
            "remote_url",
            f"is also set ({_shown(str(config.remote_url))}): LMCache builds a second remote "
            "backend and writes every chunk twice",
            "remove remote_url (and LMCACHE_REMOTE_URL); the plugin entry is enough",
        )
    try:
        pool_config = pool_config_from(
            extra.get(url_config_key(plugin)) or None, f"extra_config['{url_config_key(plugin)}']"
        )
    except ConfigError as exc:
        add(False, "pool URL", str(exc), f"set extra_config['{url_config_key(plugin)}'] = kvpool://HOST:PORT/NAMESPACE")
        return None, loads
    add(True, "pool URL", pool_config.to_url(with_token=False))
    return pool_config, loads


def _check_remote_url_form(remote_url: str, add: Any) -> PoolConfig | None:
    """``remote_url`` names kvpool's connector and a usable pool; None when it does not."""
    source = "LMCACHE_REMOTE_URL" if os.environ.get("LMCACHE_REMOTE_URL") else "remote_url"
    parts = urlsplit(remote_url.strip())
    module = parts.path.strip("/")
    connector = dict(parse_qsl(parts.query)).get("connector_name", "")
    named = module in CONNECTOR_MODULES and connector == REMOTE_URL_CLASS
    add(
        named,
        "remote_url connector",
        f"{source} is {_shown(remote_url)}",
        f"external://HOST:PORT/{ADAPTER_MODULE}/?connector_name={REMOTE_URL_CLASS}&namespace=NS "
        "(`kvpool lmcache-config --form remote_url` prints it)",
        PLUGIN_NOT_LOADED,
    )
    try:
        pool_config = remote_url_pool_config(remote_url, os.environ)
    except ConfigError as exc:
        add(False, "pool URL", str(exc), REMOTE_URL_FIX_HINT)
        return None
    add(True, "pool URL", f"{pool_config.to_url(with_token=False)} (from {source})")
    return pool_config if named else None


def _plugin_import(plugin: str, module_path: Any, class_name: Any) -> tuple[bool, str, str]:
    """Load the plugin's class as LMCache does, and say why not: LMCache logs a failed load once at start and
    runs without the plugin, so every lookup misses. ``(loaded, check, detail)``."""
    check = "plugin import"
    if not module_path or not class_name:
        return False, check, f"plugin {plugin!r} has no module_path or class_name: LMCache skips it"
    try:
        loaded = getattr(importlib.import_module(str(module_path)), str(class_name))
    except Exception as exc:  # what LMCache catches and only logs: ImportError, AttributeError, errors at import
        return False, check, f"LMCache cannot load {module_path}.{class_name}: {type(exc).__name__}: {exc}"
    return True, check, f"{module_path}.{class_name} is {loaded.__module__}.{loaded.__qualname__}"


def _shown(url: str) -> str:
    return without_inline_secrets(url)[0]


def _round_trip(config: Any, backend_name: str, label: str, add: Any) -> None:
    """Build LMCache's storage from ``config`` and move one chunk through its ``backend_name``."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    chunk = int(config.chunk_size)
    metadata = LMCacheMetadata(
        model_name=DOCTOR_MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(2, PROBE_KV_LAYERS, chunk, PROBE_KV_HEADS, PROBE_HEAD_SIZE),
    )
    loop = LoopThread("kvpool-doctor")
    backends: dict[str, Any] = {}
    try:
        backends = CreateStorageBackends(config, metadata, loop.loop)
        remote: Any = backends.get(backend_name)
        if not add(
            remote is not None and remote.connection is not None,
            label,
            f"LMCache built {backend_name}"
            if remote is not None and remote.connection is not None
            else "LMCache has no working kvpool backend (LMCache hides why: `kvpool doctor --verbose` shows its log)",
            "check that kvpool is installed in the engine's Python environment "
            "(`pip install -e '.[lmcache]'` from the kvpool checkout)",
            PLUGIN_NOT_LOADED,
        ):
            return
        local = backends["LocalCPUBackend"]
        shape = torch.Size(probe_chunk_shape(chunk))
        obj = local.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        if obj is None:
            add(False, "round trip", "LMCache could not allocate a probe chunk", "raise max_local_cpu_size")
            return
        built = getattr(local.memory_allocator, "size", None)  # MixedMemoryAllocator's, the one a CPU engine gets
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
        add(
            same,
            "round trip",
            "put and get through LMCache's RemoteBackend, byte-identical "
            f"(LMCache built with a CPU buffer of {format_size(built) if built else 'unknown size'} for the probe)"
            if same
            else "the probe chunk came back different or not at all",
            "run `kvpool check --deep`",
        )
    finally:
        closer = threading.Thread(target=lambda: [b.close() for b in backends.values()], daemon=True)
        closer.start()
        closer.join(5.0)
        loop.stop(5.0, close=False)  # LMCache's threads may still hold the loop
