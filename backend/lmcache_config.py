"""The LMCache configuration that enables kvpool, as data, YAML and environment.

Kept apart from ``lmcache_connector`` so the CLI can print it without importing
LMCache (which takes seconds).

LMCache logs its whole configuration at INFO ("LMCache Configuration: {...}"), pool
URL and adapter parameters included: a secret written into that URL ends up in every
engine log. What ``kvpool`` prints carries none (see ``backend.cli``), and
:func:`warn_if_secrets_inline` tells, once and masked, when a URL given to LMCache does.
"""

from __future__ import annotations

import json
import logging
import shlex
from typing import Any

import yaml

from backend.config import without_inline_secrets

__all__ = [
    "PLUGIN_NAME",
    "ADAPTER_MODULE",
    "ADAPTER_CLASS",
    "url_config_key",
    "lmcache_config",
    "render_yaml",
    "render_env",
    "L2_ADAPTER_MODULE",
    "L2_ADAPTER_CLASS",
    "L2_ADAPTER_CONFIG_CLASS",
    "lmcache_mp_adapter",
    "lmcache_mp_server_args",
    "render_mp_command",
    "warn_if_secrets_inline",
    "SECRET_SOURCES",
]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "kvpool"
ADAPTER_MODULE = "backend.lmcache_connector"
ADAPTER_CLASS = "KVPoolConnectorAdapter"
L2_ADAPTER_MODULE = "backend.lmcache_l2_adapter"
L2_ADAPTER_CLASS = "KVPoolL2Adapter"
L2_ADAPTER_CONFIG_CLASS = "KVPoolL2AdapterConfig"
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_LOCAL_CPU_GIB = 5.0
# Where each secret should come from instead of the URL.
SECRET_SOURCES = {
    "token": "token_file=PATH in the URL or KVPOOL_TOKEN in the environment",
    "redis_password": "redis_password_file=PATH in the URL or KVPOOL_REDIS_PASSWORD in the environment",
}
_warned: set[tuple[str, ...]] = set()


def warn_if_secrets_inline(url: str, where: str) -> None:
    """Warn once per process and place (masked) when ``url``, given to LMCache as ``where``, carries a secret."""
    shareable, found = without_inline_secrets(url)
    if not found or (where, *found) in _warned:
        return
    _warned.add((where, *found))
    logger.warning(
        "kvpool: the pool URL in %s (%s, secrets left out here) carries the %s inline; LMCache logs its whole "
        "configuration at INFO, so it is in this process's log. Give %s instead (`kvpool lmcache-config` prints "
        "such a config)",
        where, shareable, " and the ".join(found), "; ".join(f"the {n} as {SECRET_SOURCES[n]}" for n in found),
    )  # fmt: skip


def url_config_key(plugin_name: str = PLUGIN_NAME) -> str:
    """The ``extra_config`` key holding the pool URL for a plugin instance."""
    return f"remote_storage_plugin.{plugin_name}.url"


def lmcache_config(
    url: str, *, chunk_size: int = DEFAULT_CHUNK_TOKENS, local_cpu_gib: float = DEFAULT_LOCAL_CPU_GIB
) -> dict[str, Any]:
    """LMCache engine config that stores through the kvpool plugin at ``url``.

    The plugin list is the only way LMCache 0.5 reaches a third-party connector;
    ``remote_url`` is deliberately absent (setting both builds two remote backends).
    """
    return {
        "chunk_size": chunk_size,
        "local_cpu": True,
        "max_local_cpu_size": local_cpu_gib,
        "remote_serde": "naive",
        "remote_storage_plugins": [PLUGIN_NAME],
        "extra_config": {
            f"remote_storage_plugin.{PLUGIN_NAME}.module_path": ADAPTER_MODULE,
            f"remote_storage_plugin.{PLUGIN_NAME}.class_name": ADAPTER_CLASS,
            url_config_key(): url,
        },
    }


def render_yaml(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def render_env(config: dict[str, Any]) -> str:
    """The same config as ``LMCACHE_*`` variables, one ``export`` per line."""
    lines = []
    for key, value in config.items():
        if isinstance(value, dict):
            text = json.dumps(value, separators=(",", ":"))
        elif isinstance(value, list):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = str(value)
        lines.append(f"export LMCACHE_{key.upper()}={shlex.quote(text)}")
    return "\n".join(lines) + "\n"


def lmcache_mp_adapter(url: str) -> dict[str, Any]:
    """The ``--l2-adapter`` spec that makes an LMCache multiprocess server store in kvpool.

    LMCache's ``plugin`` adapter type imports ``module_path``, builds
    ``config_class_name`` from ``adapter_params`` and hands it to ``class_name``.
    """
    return {
        "type": "plugin",
        "module_path": L2_ADAPTER_MODULE,
        "class_name": L2_ADAPTER_CLASS,
        "config_class_name": L2_ADAPTER_CONFIG_CLASS,
        "adapter_params": {"url": url},
    }


def lmcache_mp_server_args(
    url: str, *, chunk_size: int = DEFAULT_CHUNK_TOKENS, l1_size_gib: float = DEFAULT_LOCAL_CPU_GIB
) -> list[str]:
    """Arguments of ``lmcache server`` (multiprocess mode) with kvpool as its only L2.

    No ``eviction`` key in the adapter spec: the pool evicts on its own nodes, so
    LMCache's L2 eviction stays off for it. ``--eviction-policy`` is L1's.
    """
    return [
        "--chunk-size", str(chunk_size),
        "--l1-size-gb", str(l1_size_gib),
        "--eviction-policy", "LRU",
        "--l2-adapter", json.dumps(lmcache_mp_adapter(url), separators=(",", ":")),
    ]  # fmt: skip


def render_mp_command(args: list[str]) -> str:
    """``lmcache server`` with ``args``, one option per line, quoted for a POSIX shell."""
    pairs = [" ".join(shlex.quote(a) for a in args[i : i + 2]) for i in range(0, len(args), 2)]
    return "lmcache server \\\n  " + " \\\n  ".join(pairs) + "\n"
