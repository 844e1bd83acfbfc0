"""The LMCache configuration that enables kvpool, as data, YAML and environment.

It imports neither LMCache nor torch, so the CLI can print it where LMCache is not
installed (a pool node's install) and without the seconds LMCache takes to import.

LMCache reaches kvpool in one of two forms, never both (LMCache would then build two
remote backends and write every chunk twice):

- the plugin form: ``remote_storage_plugins: ["kvpool"]`` plus the adapter's module,
  class and pool URL in ``extra_config`` (LMCache's recommended way);
- the ``remote_url`` form: one string, ``external://HOST:PORT/MODULE/?connector_name=CLASS&namespace=NS&...``,
  which LMCache's ``ExternalConnectorAdapter`` turns into exactly one RemoteBackend.
  :func:`lmcache_remote_url` writes it for a pool URL and :func:`remote_url_pool_config`
  reads it back.

LMCache logs its whole configuration at INFO ("LMCache Configuration: {...}"), pool
URL and adapter parameters included: a secret written into that URL ends up in every
engine log. What ``kvpool`` prints carries none (see ``backend.cli.lmcache``), and
:func:`warn_if_secrets_inline` tells, once and masked, when a URL given to LMCache does.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import yaml

from backend.config import DEFAULT_NAMESPACE, OPTION_NAMES, SCHEME, PoolConfig, split_url, without_inline_secrets
from backend.config.suggest import did_you_mean
from backend.errors import ConfigError

__all__ = [
    "PLUGIN_NAME",
    "ADAPTER_MODULE",
    "ADAPTER_CLASS",
    "url_config_key",
    "PLUGIN_FORM",
    "REMOTE_URL_FORM",
    "FORMS",
    "REMOTE_URL_CLASS",
    "lmcache_remote_url",
    "remote_url_pool_config",
    "check_tenant_source",
    "lmcache_config",
    "render_yaml",
    "render_env",
    "L2_ADAPTER_MODULE",
    "KEPT_ADAPTER_MODULES",
    "L2_ADAPTER_CLASS",
    "L2_ADAPTER_CONFIG_CLASS",
    "lmcache_mp_adapter",
    "lmcache_mp_server_args",
    "render_mp_command",
    "warn_if_secrets_inline",
    "SECRET_SOURCES",
    "pool_config_from",
]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "kvpool"
# The module paths configs name: the public ones of the kvpool package (docs/api.md),
# re-exports of backend.lmcache.connector and backend.lmcache.l2. A config may also name
# the implementation's module itself, which holds the same classes.
ADAPTER_MODULE = "kvpool.lmcache_connector"
ADAPTER_CLASS = "KVPoolConnectorAdapter"
L2_ADAPTER_MODULE = "kvpool.lmcache_l2_adapter"
KEPT_ADAPTER_MODULES = ("backend.lmcache.connector",)
L2_ADAPTER_CLASS = "KVPoolL2Adapter"
L2_ADAPTER_CONFIG_CLASS = "KVPoolL2AdapterConfig"
PLUGIN_FORM = "plugin"
REMOTE_URL_FORM = "remote_url"
FORMS = (PLUGIN_FORM, REMOTE_URL_FORM)
REMOTE_URL_SCHEME = "external"  # LMCache's ExternalConnectorAdapter
REMOTE_URL_CLASS = "KVPoolRemoteURLConnector"
CONNECTOR_NAME_KEY = "connector_name"  # LMCache's query key naming the class
NAMESPACE_KEY = "namespace"
# LMCache reads one host per comma in a remote_url and refuses more: a comma in a value
# (redis_hosts=h1:p1,h2:p2) is written as %2C. ':' and '/' stay readable (host lists, paths).
_QUERY_SAFE = "/:"
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
        where,
        shareable,
        " and the ".join(found),
        "; ".join(f"the {n} as {SECRET_SOURCES[n]}" for n in found),
    )


def pool_config_from(
    url: object, where: str, environ: Mapping[str, str] | None = None, *, multiprocess: bool = False
) -> PoolConfig:
    """The pool a ``kvpool://`` URL given to LMCache as ``where`` names, else the one in ``KVPOOL_URL``.

    ``KVPOOL_*`` variables override the URL's options, as everywhere. A URL written into
    LMCache's config that carries a secret is warned about (:func:`warn_if_secrets_inline`).
    Raises :class:`ConfigError` naming ``where`` when there is no URL or it is not a string,
    and naming the option when it names the tenant from what this layer's keys lack
    (``multiprocess``: the L2 adapter's; else the connector's: :func:`check_tenant_source`).
    """
    env = os.environ if environ is None else environ
    if url is not None and not isinstance(url, str):
        raise ConfigError(where, f"must be a string, got {type(url).__name__}")
    if url:
        warn_if_secrets_inline(url, where)
    text = url or env.get("KVPOOL_URL")
    if not text:
        raise ConfigError(where, "no pool URL given (nor KVPOOL_URL); e.g. kvpool://HOST:PORT/NAMESPACE")
    return check_tenant_source(PoolConfig.from_url(text, env), multiprocess=multiprocess)


def check_tenant_source(config: PoolConfig, *, multiprocess: bool) -> PoolConfig:
    """``config``, unless it names each key's tenant from what the keys of this LMCache layer do not carry: a
    request tag (``tenant_tag``) in multiprocess mode, a ``cache_salt`` (``tenant_from_salt``) in process."""
    if multiprocess and config.tenant_tag:
        raise ConfigError(
            "tenant_tag",
            "multiprocess-mode keys carry no request tag: name the tenant by the cache_salt (tenant_from_salt=on)",
        )
    if not multiprocess and config.tenant_from_salt:
        raise ConfigError(
            "tenant_from_salt",
            "LMCache 0.5.6 hands the connector keys without a cache_salt: name the tenant by a request tag "
            "(tenant_tag=NAME, the request's kv_transfer_params lmcache.tag.NAME)",
        )
    return config


def url_config_key(plugin_name: str = PLUGIN_NAME) -> str:
    """The ``extra_config`` key holding the pool URL for a plugin instance."""
    return f"remote_storage_plugin.{plugin_name}.url"


def lmcache_remote_url(url: str) -> str:
    """The LMCache ``remote_url`` that reaches the pool at ``url`` (a ``kvpool://`` URL).

    ``external://HOST:PORT/kvpool.lmcache_connector/?connector_name=KVPoolRemoteURLConnector&namespace=NS&OPTIONS``:
    the Redis host and port stay in the authority, the namespace and the URL's options
    move into the query, written as given (secrets are the caller's to leave out).
    """
    parts = urlsplit(url.strip())
    if parts.scheme != SCHEME:
        raise ConfigError("url", f"scheme {parts.scheme or '(none)'!r} is not {SCHEME}://")
    namespace = unquote(parts.path.lstrip("/")) or DEFAULT_NAMESPACE
    query = [
        (CONNECTOR_NAME_KEY, REMOTE_URL_CLASS),
        (NAMESPACE_KEY, namespace),
        *parse_qsl(parts.query, keep_blank_values=True),
    ]
    return urlunsplit((REMOTE_URL_SCHEME, parts.netloc, f"/{ADAPTER_MODULE}/", _encode_query(query), ""))


def remote_url_pool_config(remote_url: str, environ: Mapping[str, str] | None = None) -> PoolConfig:
    """The pool an LMCache ``remote_url`` names, read as :func:`lmcache_remote_url` writes it.

    ``KVPOOL_*`` variables in ``environ`` override its options, as for a pool URL. A
    mistake raises :class:`ConfigError` naming the part (``remote_url``, ``namespace``
    or the option) and showing the URL without its secrets.
    """
    text = (remote_url or "").strip()
    if not text:
        raise ConfigError("remote_url", "is empty; expected external://HOST:PORT/MODULE/?connector_name=CLASS&...")
    shown, _ = without_inline_secrets(text)

    def bad(key: str, message: str) -> ConfigError:
        return ConfigError(key, f"{message}, in remote_url {shown}")

    parts = split_url(text, lambda reason: bad("remote_url", f"malformed URL: {reason}"))
    if parts.scheme != REMOTE_URL_SCHEME:
        raise bad("remote_url", f"scheme {parts.scheme or '(none)'!r} is not {REMOTE_URL_SCHEME}://")
    if "," in text:
        raise bad(
            "remote_url",
            "a comma makes LMCache read several hosts, which it refuses; write a comma inside a value as %2C",
        )
    if parts.username:
        raise bad("remote_url", "a user name is not supported; give the token as token_file=PATH or KVPOOL_TOKEN")
    port = parts.port
    if not parts.hostname:
        raise bad("remote_url", "missing Redis host (external://HOST:PORT/...)")
    if port is None:
        raise bad("remote_url", "missing Redis port (external://HOST:PORT/..., e.g. :6379)")
    namespace = DEFAULT_NAMESPACE
    options: list[tuple[str, str]] = []
    seen: set[str] = set()
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in seen:
            raise bad(key, "given twice")
        seen.add(key)
        if key == CONNECTOR_NAME_KEY:
            continue
        if key == NAMESPACE_KEY:
            if not value:
                raise bad(key, f"is empty (leave it out for {DEFAULT_NAMESPACE!r})")
            namespace = value
        elif key in OPTION_NAMES:
            options.append((key, value))
        else:
            known = (CONNECTOR_NAME_KEY, NAMESPACE_KEY, *OPTION_NAMES)
            hint = did_you_mean(key, known)
            raise bad(key, f"unknown option; {hint + ' ' if hint else ''}known: {', '.join(known)}")
    pool_url = urlunsplit(
        (SCHEME, parts.netloc, "/" + quote(namespace, safe=""), _encode_query(options), parts.fragment)
    )
    try:
        return check_tenant_source(PoolConfig.from_url(pool_url, environ), multiprocess=False)
    except ConfigError as exc:
        raise bad(exc.key, str(exc).removeprefix(f"{exc.key}: ")) from None


def _encode_query(pairs: Sequence[tuple[str, str]]) -> str:
    return urlencode(pairs, quote_via=quote, safe=_QUERY_SAFE)


def lmcache_config(
    url: str,
    *,
    form: str = PLUGIN_FORM,
    chunk_size: int = DEFAULT_CHUNK_TOKENS,
    local_cpu_gib: float = DEFAULT_LOCAL_CPU_GIB,
) -> dict[str, Any]:
    """LMCache engine config that stores in the kvpool pool at ``url``, in one of :data:`FORMS`.

    The plugin form lists the plugin and leaves ``remote_url`` out; the ``remote_url``
    form is that one key. Never both: LMCache would build two remote backends.
    """
    config: dict[str, Any] = {
        "chunk_size": chunk_size,
        "local_cpu": True,
        "max_local_cpu_size": local_cpu_gib,
        "remote_serde": "naive",
    }
    if form == REMOTE_URL_FORM:
        config["remote_url"] = lmcache_remote_url(url)
    elif form == PLUGIN_FORM:
        config["remote_storage_plugins"] = [PLUGIN_NAME]
        config["extra_config"] = {
            f"remote_storage_plugin.{PLUGIN_NAME}.module_path": ADAPTER_MODULE,
            f"remote_storage_plugin.{PLUGIN_NAME}.class_name": ADAPTER_CLASS,
            url_config_key(): url,
        }
    else:
        raise ConfigError("form", f"{form!r} is not one of {', '.join(FORMS)}")
    return config


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
        "--chunk-size",
        str(chunk_size),
        "--l1-size-gb",
        str(l1_size_gib),
        "--eviction-policy",
        "LRU",
        "--l2-adapter",
        json.dumps(lmcache_mp_adapter(url), separators=(",", ":")),
    ]


def render_mp_command(args: list[str]) -> str:
    """``lmcache server`` with ``args``, one option per line, quoted for a POSIX shell."""
    pairs = [" ".join(shlex.quote(a) for a in args[i : i + 2]) for i in range(0, len(args), 2)]
    return "lmcache server \\\n  " + " \\\n  ".join(pairs) + "\n"
