"""PoolConfig: the one value object that says how to reach a pool (see the package docstring)."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from backend.config.suggest import did_you_mean, renamed_to
from backend.config.values import (
    CLUSTER_RE,
    NAMESPACE_RE,
    check_token,
    format_seconds,
    parse_bool,
    parse_int,
    parse_seconds,
    read_secret_file,
    split_url,
)
from backend.errors import ConfigError
from backend.redis_topology import CLUSTER, REDIS_MODES, SINGLE, RedisTarget, parse_hosts, render_hosts
from backend.tenants import check_tag_name, check_tenant

__all__ = [
    "PoolConfig",
    "pool_config_of_redis",
    "SCHEME",
    "DEFAULT_NAMESPACE",
    "without_inline_secrets",
    "mask_secrets",
    "SECRET_NAMES",
    "OPTION_NAMES",
    "ENV_URL",
    "ENV_DEBUG",
    "check_env",
    "env_flag",
    "known_env_names",
]

logger = logging.getLogger("backend.config")

SCHEME = "kvpool"
DEFAULT_NAMESPACE = "default"
ENV_PREFIX = "KVPOOL_"
# Environment variables kvpool reads that are not PoolConfig options.
# KVPOOL_FULL selects the long fault suite (`make faults`); it must not make every client refuse to start.
ENV_NOT_OPTIONS = frozenset({"KVPOOL_URL", "KVPOOL_NCCL_LIBRARY", "KVPOOL_DEBUG", "KVPOOL_FULL", "KVPOOL_PREFAULT"})

MAX_REPLICAS = 8
MAX_CONNECTIONS_PER_NODE = 64
MAX_TIMEOUT_S = 600.0
MIN_TIMEOUT_S = 0.001
# What nccl=on moves bytes over: libnccl between GPUs, or the CPU transport (sockets, same contract).
CHANNEL_TRANSPORTS = ("nccl", "cpu")
# Whether lookups' found prefixes are told to the nodes (backend/client/touch.py): auto, to the nodes whose
# eviction order uses them (their registry entry says: NodeInfo.takes_touches); on, to every node; off.
TOUCH_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """How a client reaches a pool. Build with :meth:`from_url`; the token is masked in repr."""

    redis_host: str = "127.0.0.1"
    redis_port: int = 6379
    namespace: str = DEFAULT_NAMESPACE
    token: str = dataclasses.field(default="", repr=False)
    replicas: int = 1
    connect_timeout_s: float = 2.0  # opening a connection to a node: TCP and TLS
    # A node connection that moves no byte this long is given up; also each Redis call's bound (docs/configuration.md)
    progress_timeout_s: float = 2.0
    connections_per_node: int = 2
    nccl: bool = False
    cluster: str = ""
    tls: bool = False  # TLS to nodes and rediss:// to Redis
    tls_ca: str = ""  # PEM CA bundle that verifies nodes and Redis; empty: the system trust store
    redis_user: str = ""  # Redis ACL user; empty: Redis's default user
    redis_password: str = dataclasses.field(default="", repr=False)
    shm: bool = True  # read through a same-host node's shared-memory arena when there is one
    channel_transport: str = "nccl"
    redis_mode: str = SINGLE  # "cluster": REDIS_HOST:REDIS_PORT is one member of a Redis Cluster
    sentinel: str = ""  # the master's name: REDIS_HOST:REDIS_PORT is a Redis Sentinel
    redis_hosts: str = ""  # more cluster members or sentinels, "h1:p1,h2:p2"
    token_file: str = ""  # the token is this file's content (whitespace stripped); a path, never the secret
    redis_password_file: str = ""  # likewise for redis_password
    pair_timeout_s: float = 30.0  # deadline of one channel pairing (a cold NCCL init takes seconds)
    touch: str = "auto"  # tell the nodes what lookups found: one of TOUCH_MODES (backend/client/touch.py)
    tenant: str = ""  # every key this client names is the tenant's (backend/tenants.py); empty: no tenant
    # The LMCache connector: the value of each key's request tag lmcache.tag.<tenant_tag> names its tenant
    # (backend/lmcache/tenant_names.py); ``tenant`` is then the tenant of a key without the tag.
    tenant_tag: str = ""
    tenant_from_salt: bool = False  # the L2 adapter: a key's cache_salt names its tenant (``tenant``: empty salts')
    event_tokens: bool = False  # the LMCache connector sends each chunk's token ids to nodes with an event ring

    def __post_init__(self) -> None:
        if not NAMESPACE_RE.match(self.namespace):
            raise ConfigError("namespace", f"{self.namespace!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
        if not self.redis_host:
            raise ConfigError("url", "missing Redis host")
        if not 0 < self.redis_port < 65536:
            raise ConfigError("url", f"Redis port {self.redis_port} is out of range")
        if not CLUSTER_RE.match(self.cluster):
            raise ConfigError("cluster", f"{self.cluster!r} must be A-Z a-z 0-9 _ . -")
        if self.token_file:
            check_token(self.token, "token_file", self.token_file)
        else:
            check_token(self.token, "token", "KVPOOL_TOKEN or the URL's :TOKEN@")
        if self.tls_ca and not self.tls:
            raise ConfigError("tls_ca", "a CA bundle only matters with TLS: add tls=on")
        if self.tenant:
            check_tenant(self.tenant)
        if self.tenant_tag:
            check_tag_name(self.tenant_tag)
        if self.tenant_tag and self.tenant_from_salt:
            raise ConfigError(
                "tenant_tag",
                "the tenant comes from a request tag (the LMCache connector) or from the cache_salt (the "
                "multiprocess-mode adapter), not both",
            )
        if self.touch not in TOUCH_MODES:
            raise ConfigError("touch", f"{self.touch!r} is not one of {', '.join(TOUCH_MODES)}")
        if self.channel_transport not in CHANNEL_TRANSPORTS:
            raise ConfigError(
                "channel_transport", f"{self.channel_transport!r} is not one of {', '.join(CHANNEL_TRANSPORTS)}"
            )
        if self.redis_mode == "sentinel":
            raise ConfigError("redis_mode", "a Sentinel is chosen by naming its master: sentinel=MASTER")
        if self.redis_mode not in REDIS_MODES:
            raise ConfigError("redis_mode", f"{self.redis_mode!r} is not one of {', '.join(REDIS_MODES)}")
        if self.sentinel and self.redis_mode == CLUSTER:
            raise ConfigError(
                "sentinel",
                "Sentinel does not manage a Redis Cluster: give redis_mode=cluster or sentinel=MASTER, not both",
            )
        if self.nccl and not self.cluster and "nccl" not in _warned_options:
            _warned_options.add("nccl")  # once per process: configs are rebuilt (dataclasses.replace)
            logger.warning(
                "nccl: nccl=on needs cluster=NAME (no node counts as same-cluster without it); every read goes over TCP"
            )
        if self.redis_hosts:
            if self.redis_mode == SINGLE and not self.sentinel:
                raise ConfigError("redis_hosts", "more Redis hosts need redis_mode=cluster or sentinel=MASTER")
            parse_hosts(self.redis_hosts, key="redis_hosts")

    def __repr__(self) -> str:
        token = "'***'" if self.token else "''"
        password = "'***'" if self.redis_password else "''"
        return (
            f"PoolConfig(redis={self.redis_host}:{self.redis_port}, namespace={self.namespace!r}, "
            f"token={token}, replicas={self.replicas}, connect_timeout_s={self.connect_timeout_s}, "
            f"progress_timeout_s={self.progress_timeout_s}, "
            f"connections_per_node={self.connections_per_node}, nccl={self.nccl}, "
            f"cluster={self.cluster!r}, tls={self.tls}, tls_ca={self.tls_ca!r}, "
            f"redis_user={self.redis_user!r}, redis_password={password}, shm={self.shm}, "
            f"channel_transport={self.channel_transport!r}, redis_mode={self.redis_mode!r}, "
            f"sentinel={self.sentinel!r}, redis_hosts={self.redis_hosts!r}, token_file={self.token_file!r}, "
            f"redis_password_file={self.redis_password_file!r}, pair_timeout_s={self.pair_timeout_s}, "
            f"tenant={self.tenant!r}, tenant_tag={self.tenant_tag!r}, tenant_from_salt={self.tenant_from_salt}, "
            f"event_tokens={self.event_tokens})"
        )

    @property
    def _host_for_url(self) -> str:
        return f"[{self.redis_host}]" if ":" in self.redis_host else self.redis_host

    @property
    def redis_target(self) -> RedisTarget:
        hosts: tuple[tuple[str, int], ...] = ((self.redis_host, self.redis_port),)
        if self.redis_hosts:
            hosts += parse_hosts(self.redis_hosts, key="redis_hosts")
        return RedisTarget.build(self.redis_mode, hosts, master=self.sentinel, tls=self.tls, user=self.redis_user)

    @property
    def redis_url(self) -> str:
        """The metadata Redis as a URL nodes take (``--redis``): ``rediss`` with TLS, the ACL user, never a secret."""
        return self.redis_target.render()

    def to_url(self, *, with_token: bool = True) -> str:
        """The canonical ``kvpool://`` URL for this config; ``with_token=False`` masks every secret.

        A secret read from a file is never written out: its ``*_file`` option stands for it.
        """
        token = "" if self.token_file else self.token
        auth = f":{quote(token, safe='')}@" if token and with_token else ""
        if token and not with_token:
            auth = ":***@"
        defaults = PoolConfig()
        from_files = {"redis_password"} if self.redis_password_file else set()
        query = [
            f"{name}={'***' if name in _SECRET_OPTIONS and not with_token else quote(_render(getattr(self, name)))}"
            for name in _OPTION_PARSERS
            if getattr(self, name) != getattr(defaults, name) and name not in from_files
        ]
        tail = ("?" + "&".join(query)) if query else ""
        return f"{SCHEME}://{auth}{self._host_for_url}:{self.redis_port}/{self.namespace}{tail}"

    @classmethod
    def from_url(cls, url: str, environ: Mapping[str, str] | None = None) -> PoolConfig:
        """Parse a ``kvpool://`` URL; ``KVPOOL_*`` variables in ``environ`` override it."""
        if not isinstance(url, str) or not url.strip():
            raise ConfigError("url", "empty pool URL; expected kvpool://HOST:PORT/NAMESPACE")
        parts = split_url(url.strip(), lambda reason: ConfigError("url", f"malformed URL {_mask(url)}: {reason}"))
        if parts.scheme != SCHEME:
            raise ConfigError("url", f"scheme {parts.scheme or '(none)'!r} is not {SCHEME}:// in {_mask(url)}")
        if parts.username:
            raise ConfigError("url", "user names are not supported; put the token as kvpool://:TOKEN@HOST:PORT/NS")
        port = parts.port
        if not parts.hostname:
            raise ConfigError("url", f"missing Redis host in {_mask(url)}")
        if port is None:
            raise ConfigError("url", f"missing Redis port in {_mask(url)} (e.g. :6379)")
        namespace = unquote(parts.path.lstrip("/")) or DEFAULT_NAMESPACE
        if "/" in namespace:
            raise ConfigError("namespace", f"{namespace!r} must not contain '/'")
        options: dict[str, str] = {}
        for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
            if key in options:
                raise ConfigError(key, "given twice in the URL")
            options[key] = value
        if parts.fragment:
            raise ConfigError("url", f"unexpected fragment '#{parts.fragment}'")
        values: dict[str, Any] = {
            "redis_host": parts.hostname,
            "redis_port": port,
            "namespace": namespace,
            "token": unquote(parts.password or ""),
        }
        values.update(_parse_options(options, source="URL"))
        values.update(_env_options(environ or {}))
        return cls(**_read_secret_files(values))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> PoolConfig:
        """Build from a mapping with ``url`` plus options (the YAML form)."""
        if not isinstance(data, Mapping):
            raise ConfigError("config", "expected a mapping of options")
        unknown = set(data) - {"url", *_OPTION_PARSERS}
        if unknown:
            raise _unknown_option(str(sorted(unknown)[0]), "config", ("url", *_OPTION_PARSERS))
        base = cls.from_url(str(data.get("url", "")))
        options = _parse_options({k: _render(v) for k, v in data.items() if k != "url"}, source="config")
        options.update(_env_options(environ or {}))
        return dataclasses.replace(base, **_read_secret_files(options))

    @classmethod
    def from_yaml(cls, path: str | Path, environ: Mapping[str, str] | None = None) -> PoolConfig:
        """Load a YAML file holding ``url:`` and options."""
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError("config", f"{path} is not valid YAML: {exc}") from None
        return cls.from_mapping(data or {}, environ)


def pool_config_of_redis(redis_url: str, namespace: str = DEFAULT_NAMESPACE, **options: Any) -> PoolConfig:
    """How a client reaches the pool whose nodes were given ``--redis redis_url``: the same Redis, ACL user
    and TLS, in ``namespace``; ``options`` are more PoolConfig fields (secrets, ``tls_ca``). A password
    written into ``redis_url`` is kept unless ``options`` give one."""
    target = RedisTarget.parse(redis_url, key="--redis")
    if target.mode == SINGLE:
        parts = urlsplit(redis_url)
        where: dict[str, Any] = {
            "redis_host": parts.hostname or "127.0.0.1",
            "redis_port": parts.port or 6379,
            "redis_user": unquote(parts.username or ""),
        }
        inline_password = unquote(parts.password or "")
    else:
        (host, port), *more = target.hosts
        where = {
            "redis_host": host,
            "redis_port": port,
            "redis_mode": target.mode if not target.master else SINGLE,
            "sentinel": target.master,
            "redis_hosts": render_hosts(more),
            "redis_user": target.user,
        }
        inline_password = target.password
    if inline_password and not options.get("redis_password"):
        options = {**options, "redis_password": inline_password}
    return PoolConfig(**where, tls=target.tls, namespace=namespace, **options)


def _parse_touch(key: str, text: str) -> str:
    """auto, or on/off (and their spellings: true/false, yes/no, 1/0)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return "on" if parse_bool(key, str(text)) else "off"
    except ConfigError:
        raise ConfigError(key, f"{text!r} is not auto, on or off") from None


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return format_seconds(value)
    return str(value)


def _mask(url: str) -> str:
    url = re.sub(r"//[^/@]*@", "//:***@", url)  # userinfo is the token (a user name is an error, masked too)
    return re.sub(r"([?&](?:" + "|".join(_SECRET_OPTIONS) + r")=)[^&#]*", r"\1***", url)


_SECRET_OPTIONS = ("redis_password",)  # masked wherever a URL or config is shown
# A secret written into a URL anywhere in a text: the password of a userinfo (a pool token,
# a Redis password), or a secret option in a query (remote_url spells the token token=).
_INLINE_SECRET_RE = re.compile(
    r"(?P<keep>://[^/@\s'\"]*?:)[^/@\s'\"]+@|(?P<opt>[?&](?:token|" + "|".join(_SECRET_OPTIONS) + r")=)[^&#\s'\"]+"
)
SECRET_NAMES = ("token", *_SECRET_OPTIONS)  # what without_inline_secrets can find in a URL
_SECRET_FILES = {"token_file": "token", "redis_password_file": "redis_password"}


def mask_secrets(text: str, known: Sequence[str] = ()) -> str:
    """``text`` (a log line, a config dump) with every secret written into a URL in it shown as
    ``***``, and every string of ``known`` (secrets read from files or the environment) too."""
    shown = _INLINE_SECRET_RE.sub(lambda m: f"{m['keep']}***@" if m["keep"] else f"{m['opt']}***", text)
    for secret in known:
        if secret:
            shown = shown.replace(secret, "***")
    return shown


def without_inline_secrets(url: str) -> tuple[str, list[str]]:
    """``url`` with the secrets written into it removed, and their names (of :data:`SECRET_NAMES`).

    Everything else is kept as written. For configs that get logged: the secrets then
    come from ``token_file=`` / ``redis_password_file=`` or ``KVPOOL_TOKEN`` / ``KVPOOL_REDIS_PASSWORD``.
    """
    try:
        parts = urlsplit(url.strip())
    except ValueError:  # not a URL: nothing of it is kept, the parse that follows names the problem
        return _mask(url), []
    found: list[str] = []
    netloc = parts.netloc
    auth, at, hostport = netloc.rpartition("@")
    if at:
        if auth:
            found.append("token")
        netloc = hostport
    kept = []
    for pair in parts.query.split("&") if parts.query else []:
        name, _, value = pair.partition("=")
        if name in _SECRET_OPTIONS:
            if value:
                found.append(name)
            continue
        kept.append(pair)
    return urlunsplit((parts.scheme, netloc, parts.path, "&".join(kept), parts.fragment)), found


def _read_secret_files(values: dict[str, Any]) -> dict[str, Any]:
    """Fill ``token`` / ``redis_password`` from the files ``token_file`` / ``redis_password_file`` name."""
    for option, secret in _SECRET_FILES.items():
        path = values.get(option)
        if path:
            values[secret] = read_secret_file(path, option)
    return values


_OPTION_PARSERS: dict[str, Any] = {
    "replicas": lambda k, v: parse_int(k, v, 1, MAX_REPLICAS),
    "connect_timeout_s": lambda k, v: parse_seconds(k, v, MIN_TIMEOUT_S, MAX_TIMEOUT_S),
    "progress_timeout_s": lambda k, v: parse_seconds(k, v, MIN_TIMEOUT_S, MAX_TIMEOUT_S),
    "connections_per_node": lambda k, v: parse_int(k, v, 1, MAX_CONNECTIONS_PER_NODE),
    "nccl": parse_bool,
    "cluster": lambda k, v: str(v),
    "tls": parse_bool,
    "tls_ca": lambda k, v: str(v),
    "redis_user": lambda k, v: str(v),
    "redis_password": lambda k, v: str(v),
    "shm": parse_bool,
    "channel_transport": lambda k, v: str(v).strip().lower(),
    "redis_mode": lambda k, v: str(v).strip().lower(),
    "sentinel": lambda k, v: str(v).strip(),
    "redis_hosts": lambda k, v: str(v).replace(" ", ""),
    "token_file": lambda k, v: str(v),
    "redis_password_file": lambda k, v: str(v),
    "pair_timeout_s": lambda k, v: parse_seconds(k, v, MIN_TIMEOUT_S, MAX_TIMEOUT_S),
    "touch": _parse_touch,
    "tenant": lambda k, v: check_tenant(str(v).strip(), k),
    "tenant_tag": lambda k, v: check_tag_name(str(v).strip(), k),
    "tenant_from_salt": parse_bool,
    "event_tokens": parse_bool,
}
OPTION_NAMES = tuple(_OPTION_PARSERS)  # what a URL query, YAML or KVPOOL_* may set, in canonical order


def _unknown_option(key: str, source: str, known: Sequence[str]) -> ConfigError:
    """The error of an option ``source`` does not know: the close name (or the new name of an old one) first."""
    hint = did_you_mean(key, known)
    return ConfigError(key, f"unknown option in the {source}; {hint + ' ' if hint else ''}known: {', '.join(known)}")


def _parse_options(options: Mapping[str, str], *, source: str) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for key, value in options.items():
        parser = _OPTION_PARSERS.get(key)
        if parser is None:
            raise _unknown_option(key, source, OPTION_NAMES)
        parsed[key] = parser(key, value)
    return parsed


def _env_options(environ: Mapping[str, str]) -> dict[str, Any]:
    options: dict[str, str] = {}
    token: dict[str, str] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in ENV_NOT_OPTIONS:
            continue
        option = name[len(ENV_PREFIX) :].lower()
        if option == "token":
            token["token"] = value
            continue
        if option not in _OPTION_PARSERS:
            continue  # warned about below
        options[option] = value
    check_env(environ)
    parsed = _parse_options(options, source="environment")
    parsed.update(token)
    return parsed


# -- the environment ------------------------------------------------------------------
ENV_URL = "KVPOOL_URL"  # the pool URL where none is given (the CLI's --url, the LMCache plugin)
ENV_DEBUG = "KVPOOL_DEBUG"  # the CLI's --debug
_warned_env: set[str] = set()
_warned_options: set[str] = set()  # options that were warned about once in this process


def known_env_names() -> tuple[str, ...]:
    """Every ``KVPOOL_*`` variable kvpool reads."""
    options = [f"{ENV_PREFIX}{name.upper()}" for name in _OPTION_PARSERS]
    return ("KVPOOL_TOKEN", *options, *sorted(ENV_NOT_OPTIONS))


def check_env(environ: Mapping[str, str]) -> list[str]:
    """Warn once per process about each ``KVPOOL_*`` variable kvpool does not read; returns them.

    A warning, not an error: inside LMCache a raise while the connector is made turns
    the cache off without a word, which is worse than an ignored typo. A name kvpool read
    before 0.1 (``KVPOOL_TIMEOUT_MS``) is refused, naming the new one: it was set on purpose,
    and ignoring it would quietly change what it bounded.
    """
    known = known_env_names()
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)
    for name in unknown:
        if renamed_to(name, known):
            raise ConfigError(name, f"unknown kvpool environment variable; {did_you_mean(name, known)}")
    for name in unknown:
        if name not in _warned_env:
            _warned_env.add(name)
            hint = did_you_mean(name, known)
            logger.warning(
                "%s: unknown kvpool environment variable, ignored; %sknown: %s",
                name,
                hint + " " if hint else "",
                ", ".join(known),
            )
    return unknown


def env_flag(environ: Mapping[str, str], name: str) -> bool:
    """A yes/no switch from the environment (``1``, ``true``, ``on``, ``yes``); unset or anything else: no."""
    return environ.get(name, "").strip().lower() in {"1", "true", "on", "yes"}
