"""``kvpool doctor``: an LMCache config checked end to end, the way LMCache itself would use it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import torch
from lmcache.v1.memory_management import MemoryFormat

from backend.client import PoolClient
from backend.config import PoolConfig, mask_secrets, without_inline_secrets
from backend.doctor import Finding, check_pool
from backend.doctor.findings import PLUGIN_NOT_LOADED, State
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
MIN_MASKED = 4  # a shorter secret is not searched for in text (it would mask ordinary words); URLs are masked anyway


def diagnose(config_path: Path) -> list[Finding]:
    """Check an LMCache config end to end, the way LMCache itself would use it.

    Loads the file with LMCache's loader (``LMCACHE_*`` variables included, as an engine
    would), checks whichever form enables kvpool (the plugin entry or ``remote_url``),
    builds LMCache's storage backends from it (so a connector that fails to load shows
    here, not as silent misses), checks Redis and the nodes, and makes one put/get round
    trip through LMCache's RemoteBackend. The pool's checks are ``backend.doctor.check_pool``'s,
    so a failure names its cause (docs/troubleshooting.md).
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
    if all(f.ok for f in pool):
        _round_trip(config, backend_name, label, add)
    return findings


def _check_plugin_form(config: Any, plugin: str, add: Any) -> PoolConfig | None:
    """The plugin entry's module, class and pool URL; None when the URL is unusable."""
    extra = config.extra_config or {}
    module_path = extra.get(f"remote_storage_plugin.{plugin}.module_path")
    class_name = extra.get(f"remote_storage_plugin.{plugin}.class_name")
    add(
        *_plugin_import(plugin, module_path, class_name),
        f"set extra_config['remote_storage_plugin.{plugin}.module_path'] = {ADAPTER_MODULE!r} and "
        f"['remote_storage_plugin.{plugin}.class_name'] = {ADAPTER_CLASS!r}, in the engine's Python "
        "environment kvpool installed (`python -c 'import kvpool.lmcache_connector'` there must work)",
        PLUGIN_NOT_LOADED,
    )
    for suffix, allowed in (("module_path", CONNECTOR_MODULES), ("class_name", (ADAPTER_CLASS,))):
        key = f"remote_storage_plugin.{plugin}.{suffix}"
        add(
            extra.get(key) in allowed,
            key,
            f"is {extra.get(key)!r}",
            f"set extra_config['{key}'] = {allowed[0]!r}",
            PLUGIN_NOT_LOADED,
        )
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
        return None
    add(True, "pool URL", pool_config.to_url(with_token=False))
    return pool_config


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
        kv_shape=(2, 2, chunk, 1, 64),
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
            else "LMCache has no working kvpool backend (LMCache hides why: see its log above)",
            "check that kvpool is installed in the engine's Python environment "
            "(`pip install -e '.[lmcache]'` from the kvpool checkout)",
            PLUGIN_NOT_LOADED,
        ):
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
        add(
            same,
            "round trip",
            "put and get through LMCache's RemoteBackend, byte-identical"
            if same
            else "the probe chunk came back different or not at all",
            "run `kvpool check --deep`",
        )
    finally:
        closer = threading.Thread(target=lambda: [b.close() for b in backends.values()], daemon=True)
        closer.start()
        closer.join(5.0)
        loop.stop(5.0, close=False)  # LMCache's threads may still hold the loop
