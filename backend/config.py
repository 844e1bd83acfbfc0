"""PoolConfig: the one value object that says how to reach a pool.

A pool is named by a URL::

    kvpool://[:TOKEN@]REDIS_HOST:REDIS_PORT/NAMESPACE?option=value&...

The URL points at the metadata Redis; nodes are discovered from its registry. With
``redis_mode=cluster`` REDIS_HOST:REDIS_PORT is any member of a Redis Cluster; with
``sentinel=MASTER`` it is a Redis Sentinel that knows the master by that name
(``redis_hosts=`` adds more members or sentinels). ``tls=on`` encrypts both: node
connections (verified against ``tls_ca`` or the system trust) and Redis (``rediss://``).
Redis ACL credentials are the ``redis_user`` and ``redis_password`` options; the
userinfo of the URL is the pool token, for nodes only.

Secrets belong in files or the environment, not in the URL: LMCache logs its whole
configuration, pool URL included, at INFO. ``token_file=PATH`` and
``redis_password_file=PATH`` (or ``KVPOOL_TOKEN`` / ``KVPOOL_REDIS_PASSWORD``) keep them
out of every URL and config that is shown; a file, when named, wins over the other
sources. :func:`without_inline_secrets` strips secrets written into a URL.
Options may also come from ``KVPOOL_<OPTION>`` environment variables (which win over
the URL) and from a YAML file. Everything is validated once, here; an unknown or
malformed option raises :class:`ConfigError` naming it. An unknown ``KVPOOL_*``
variable is logged (once) and ignored: inside LMCache an error would turn the cache off.

:class:`NodeConfig` is a pool node's settings: flags (``kvpool node``/``kvpool up``),
a YAML file and the environment go through one table of options, :data:`NODE_OPTIONS`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from backend.errors import ConfigError
from backend.protocol import DEFAULT_LIMITS, Limits
from backend.redis_topology import CLUSTER, REDIS_MODES, SINGLE, RedisTarget, mask_url, parse_hosts

__all__ = [
    "PoolConfig",
    "NodeConfig",
    "NodeOption",
    "NODE_OPTIONS",
    "node_options",
    "warn_unknown_env",
    "parse_size",
    "format_size",
    "SCHEME",
    "DEFAULT_NAMESPACE",
    "without_inline_secrets",
    "SECRET_NAMES",
    "OPTION_NAMES",
]

logger = logging.getLogger(__name__)

SCHEME = "kvpool"
DEFAULT_NAMESPACE = "default"
ENV_PREFIX = "KVPOOL_"
# Environment variables kvpool reads that are not PoolConfig options.
# KVPOOL_FULL selects the long fault suite (`make faults`); it must not make every client refuse to start.
ENV_NOT_OPTIONS = frozenset({"KVPOOL_URL", "KVPOOL_NCCL_LIBRARY", "KVPOOL_DEBUG", "KVPOOL_FULL"})

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CLUSTER_RE = re.compile(r"^[A-Za-z0-9_.-]{0,64}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "B": 1,
    "K": 1024, "KB": 1000, "KI": 1024, "KIB": 1024,
    "M": 1024**2, "MB": 1000**2, "MI": 1024**2, "MIB": 1024**2,
    "G": 1024**3, "GB": 1000**3, "GI": 1024**3, "GIB": 1024**3,
    "T": 1024**4, "TB": 1000**4, "TI": 1024**4, "TIB": 1024**4,
}  # fmt: skip

MAX_REPLICAS = 8
MAX_CONNECTIONS_PER_NODE = 64
MAX_TIMEOUT_MS = 600_000
# What nccl=on moves bytes over: libnccl between GPUs, or the CPU transport (sockets, same contract).
CHANNEL_TRANSPORTS = ("nccl", "cpu")


def parse_size(text: str, *, name: str = "size") -> int:
    """Parse ``"4GiB"``, ``"512MiB"``, ``"1.5G"`` or ``"1048576"`` into bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(name, f"{text!r} is not a size (examples: 4GiB, 512MiB, 1048576)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").upper()])


def format_size(num_bytes: float) -> str:
    """Render a byte count for people: ``4.0 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} TiB"


def _parse_bool(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"on", "true", "1", "yes"}:
        return True
    if lowered in {"off", "false", "0", "no"}:
        return False
    raise ConfigError(key, f"{text!r} is not on/off")


def _parse_int(key: str, text: str, low: int, high: int) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(key, f"{text!r} is not an integer") from None
    if not low <= value <= high:
        raise ConfigError(key, f"{value} is out of range [{low}, {high}]")
    return value


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """How a client reaches a pool. Build with :meth:`from_url`; the token is masked in repr."""

    redis_host: str = "127.0.0.1"
    redis_port: int = 6379
    namespace: str = DEFAULT_NAMESPACE
    token: str = dataclasses.field(default="", repr=False)
    replicas: int = 1
    timeout_ms: int = 2000
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
    pair_timeout_ms: int = 30_000  # deadline of one channel pairing (a cold NCCL init takes seconds)

    def __post_init__(self) -> None:
        if not _NAMESPACE_RE.match(self.namespace):
            raise ConfigError("namespace", f"{self.namespace!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
        if not self.redis_host:
            raise ConfigError("url", "missing Redis host")
        if not 0 < self.redis_port < 65536:
            raise ConfigError("url", f"Redis port {self.redis_port} is out of range")
        if not _CLUSTER_RE.match(self.cluster):
            raise ConfigError("cluster", f"{self.cluster!r} must be A-Z a-z 0-9 _ . -")
        if self.tls_ca and not self.tls:
            raise ConfigError("tls_ca", "a CA bundle only matters with TLS: add tls=on")
        if self.channel_transport not in CHANNEL_TRANSPORTS:
            raise ConfigError(
                "channel_transport", f"{self.channel_transport!r} is not one of {', '.join(CHANNEL_TRANSPORTS)}"
            )
        if self.redis_mode == "sentinel":
            raise ConfigError("redis_mode", "a Sentinel is chosen by naming its master: sentinel=MASTER")
        if self.redis_mode not in REDIS_MODES:
            raise ConfigError("redis_mode", f"{self.redis_mode!r} is not one of {', '.join(REDIS_MODES)}")
        if self.sentinel and self.redis_mode == CLUSTER:
            raise ConfigError("sentinel", "Sentinel does not manage a Redis Cluster: give redis_mode=cluster or "
                              "sentinel=MASTER, not both")  # fmt: skip
        if self.redis_hosts:
            if self.redis_mode == SINGLE and not self.sentinel:
                raise ConfigError("redis_hosts", "more Redis hosts need redis_mode=cluster or sentinel=MASTER")
            parse_hosts(self.redis_hosts, key="redis_hosts")

    def __repr__(self) -> str:
        token = "'***'" if self.token else "''"
        password = "'***'" if self.redis_password else "''"
        return (
            f"PoolConfig(redis={self.redis_host}:{self.redis_port}, namespace={self.namespace!r}, "
            f"token={token}, replicas={self.replicas}, timeout_ms={self.timeout_ms}, "
            f"connections_per_node={self.connections_per_node}, nccl={self.nccl}, "
            f"cluster={self.cluster!r}, tls={self.tls}, tls_ca={self.tls_ca!r}, "
            f"redis_user={self.redis_user!r}, redis_password={password}, shm={self.shm}, "
            f"channel_transport={self.channel_transport!r}, redis_mode={self.redis_mode!r}, "
            f"sentinel={self.sentinel!r}, redis_hosts={self.redis_hosts!r}, token_file={self.token_file!r}, "
            f"redis_password_file={self.redis_password_file!r}, pair_timeout_ms={self.pair_timeout_ms})"
        )

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000.0

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
        parts = urlsplit(url.strip())
        if parts.scheme != SCHEME:
            raise ConfigError("url", f"scheme {parts.scheme or '(none)'!r} is not {SCHEME}:// in {_mask(url)}")
        if parts.username:
            raise ConfigError("url", "user names are not supported; put the token as kvpool://:TOKEN@HOST:PORT/NS")
        try:
            port = parts.port
        except ValueError:
            raise ConfigError("url", f"port is not a number in 0-65535 in {_mask(url)}") from None
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
            raise ConfigError(sorted(unknown)[0], f"unknown option; known: url, {', '.join(_OPTION_PARSERS)}")
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


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _mask(url: str) -> str:
    url = re.sub(r"//[^/@]*@", "//:***@", url)  # userinfo is the token (a user name is an error, masked too)
    return re.sub(r"([?&](?:" + "|".join(_SECRET_OPTIONS) + r")=)[^&#]*", r"\1***", url)


_SECRET_OPTIONS = ("redis_password",)  # masked wherever a URL or config is shown
SECRET_NAMES = ("token", *_SECRET_OPTIONS)  # what without_inline_secrets can find in a URL
_SECRET_FILES = {"token_file": "token", "redis_password_file": "redis_password"}


def without_inline_secrets(url: str) -> tuple[str, list[str]]:
    """``url`` with the secrets written into it removed, and their names (of :data:`SECRET_NAMES`).

    Everything else is kept as written. For configs that get logged: the secrets then
    come from ``token_file=`` / ``redis_password_file=`` or ``KVPOOL_TOKEN`` / ``KVPOOL_REDIS_PASSWORD``.
    """
    parts = urlsplit(url.strip())
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
        if not path:
            continue
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(option, f"cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(option, f"{path} is not text") from None
        if not text:
            raise ConfigError(option, f"{path} is empty")
        values[secret] = text
    return values


_OPTION_PARSERS: dict[str, Any] = {
    "replicas": lambda k, v: _parse_int(k, v, 1, MAX_REPLICAS),
    "timeout_ms": lambda k, v: _parse_int(k, v, 1, MAX_TIMEOUT_MS),
    "connections_per_node": lambda k, v: _parse_int(k, v, 1, MAX_CONNECTIONS_PER_NODE),
    "nccl": _parse_bool,
    "cluster": lambda k, v: str(v),
    "tls": _parse_bool,
    "tls_ca": lambda k, v: str(v),
    "redis_user": lambda k, v: str(v),
    "redis_password": lambda k, v: str(v),
    "shm": _parse_bool,
    "channel_transport": lambda k, v: str(v).strip().lower(),
    "redis_mode": lambda k, v: str(v).strip().lower(),
    "sentinel": lambda k, v: str(v).strip(),
    "redis_hosts": lambda k, v: str(v).replace(" ", ""),
    "token_file": lambda k, v: str(v),
    "redis_password_file": lambda k, v: str(v),
    "pair_timeout_ms": lambda k, v: _parse_int(k, v, 1, MAX_TIMEOUT_MS),
}
OPTION_NAMES = tuple(_OPTION_PARSERS)  # what a URL query, YAML or KVPOOL_* may set, in canonical order


def _parse_options(options: Mapping[str, str], *, source: str) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for key, value in options.items():
        parser = _OPTION_PARSERS.get(key)
        if parser is None:
            raise ConfigError(key, f"unknown option in the {source}; known: {', '.join(_OPTION_PARSERS)}")
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
    warn_unknown_env(environ)
    parsed = _parse_options(options, source="environment")
    parsed.update(token)
    return parsed


# -- the environment ------------------------------------------------------------------
ENV_URL = "KVPOOL_URL"  # the pool URL where none is given (the CLI's --url, the LMCache plugin)
ENV_DEBUG = "KVPOOL_DEBUG"  # the CLI's --debug
_warned_env: set[str] = set()


def known_env_names() -> tuple[str, ...]:
    """Every ``KVPOOL_*`` variable kvpool reads."""
    options = [f"{ENV_PREFIX}{name.upper()}" for name in _OPTION_PARSERS]
    return ("KVPOOL_TOKEN", *options, *sorted(ENV_NOT_OPTIONS))


def warn_unknown_env(environ: Mapping[str, str]) -> list[str]:
    """Warn once per process about each ``KVPOOL_*`` variable kvpool does not read; returns them.

    A warning, not an error: inside LMCache a raise while the connector is made turns
    the cache off without a word, which is worse than an ignored typo.
    """
    known = set(known_env_names())
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)
    for name in unknown:
        if name not in _warned_env:
            _warned_env.add(name)
            logger.warning("%s: unknown kvpool environment variable, ignored; known: %s", name,
                           ", ".join(known_env_names()))  # fmt: skip
    return unknown


def env_flag(environ: Mapping[str, str], name: str) -> bool:
    """A yes/no switch from the environment (``1``, ``true``, ``on``, ``yes``); unset or anything else: no."""
    return environ.get(name, "").strip().lower() in {"1", "true", "on", "yes"}


# -- NodeConfig -------------------------------------------------------------------------
DEFAULT_SHM_DIR = "/dev/shm"
DEFAULT_NODE_PAIR_TIMEOUT_MS = 60_000  # a node waits longer than a client: it serves many pairings
DEFAULT_DEAD_NODE_GRACE_MS = 300_000
MAX_NODE_MS = 2**31 - 1
_CHANNELS = ("off", "nccl", "cpu")


@dataclasses.dataclass(frozen=True)
class NodeOption:
    """One node setting: YAML key ``name``, flag ``--name-with-dashes``, and optionally a ``KVPOOL_*`` variable."""

    name: str
    parse: Callable[[str, Any], Any]  # (the option as the user wrote it, raw value) -> value; ConfigError naming it
    default: Any
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    env: str = ""  # the environment variable that sets it (flags win over it, it wins over YAML)
    flag: bool = True  # False for secrets: from a file or the environment, never from argv

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")


def _text(key: str, value: Any) -> str:
    if value is None or isinstance(value, (dict, list)):
        raise ConfigError(key, f"{value!r} is not a value for this option")
    return str(value)


def _optional(parse: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``parse``, except that an empty value (YAML ``null``, ``""``) means "not set"."""
    return lambda key, value: None if value is None or value == "" else parse(key, value)


def _path(key: str, value: Any) -> Path:
    return Path(_text(key, value))


def _named(pattern: re.Pattern[str], rule: str) -> Callable[[str, Any], str]:
    def parse(key: str, value: Any) -> str:
        text = _text(key, value)
        if not pattern.match(text):
            raise ConfigError(key, f"{text!r} must be {rule}")
        return text

    return parse


def _choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def parse(key: str, value: Any) -> str:
        text = "off" if value is False else _text(key, value).strip().lower()  # YAML reads a bare off as False
        if text not in choices:
            raise ConfigError(key, f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse


def _size(positive: bool) -> Callable[[str, Any], int]:
    def parse(key: str, value: Any) -> int:
        size = parse_size(_text(key, value), name=key)
        if positive and size <= 0:
            raise ConfigError(key, f"{value!r} is not a positive size")
        return size

    return parse


def _int_in(low: int, high: int) -> Callable[[str, Any], int]:
    return lambda key, value: _parse_int(key, _text(key, value), low, high)


def _shm_dir(key: str, value: Any) -> Path | None:
    text = "off" if value is False or value is None else _text(key, value)
    if text.lower() == "off":
        return None
    if not Path(text).is_dir():
        if text != DEFAULT_SHM_DIR:
            raise ConfigError(key, f"{text} is not a directory (use 'off' for no arena)")
        return None  # a system without /dev/shm: private memory, TCP for everyone
    return Path(text)


def parse_advertise(key: str, value: Any) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``:PORT``, ``[V6]:PORT`` or a bare IPv6 address -> (host or "", port or 0)."""
    text = "" if value is None else _text(key, value)
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or not host or (rest and not rest.startswith(":")):
            raise ConfigError(key, f"{text!r} is not HOST, HOST:PORT or [IPV6]:PORT")
        port_text = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""  # a name, or an IPv6 address without a port
    if not port_text:
        return host, 0
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(key, f"{text!r}: the port must be a number in 1..65535")
    return host, int(port_text)


def _redis(key: str, value: Any) -> str:
    text = _text(key, value)
    RedisTarget.parse(text, key=key)  # the form is checked now, the server when the node starts
    return text


REDIS_HELP = ("the pool's metadata Redis (required): redis://HOST:PORT, redis+cluster://HOST:PORT[,HOST:PORT] or "
              "redis+sentinel://HOST:PORT[,HOST:PORT]/MASTER; TLS: rediss://, rediss+cluster://, rediss+sentinel://; "
              "an ACL user as USER@HOST:PORT")  # fmt: skip
# Every node setting, in the order of `kvpool node --help`. The help strings of dram, nvme_dir and
# nvme name {default}: `kvpool up` and `kvpool node` differ there (NODE_VERB_DEFAULTS).
NODE_OPTIONS: tuple[NodeOption, ...] = (
    NodeOption("redis", _optional(_redis), "", REDIS_HELP, metavar="URL"),
    NodeOption("namespace", _named(_NAMESPACE_RE, "1-64 characters of A-Z a-z 0-9 _ . -"), DEFAULT_NAMESPACE,
               f"pool namespace (default {DEFAULT_NAMESPACE})"),
    NodeOption("dram", _size(positive=True), parse_size("4GiB"), "DRAM tier size (default {default})"),
    NodeOption("nvme_dir", _optional(_path), None, "NVMe tier directory ({default})"),
    NodeOption("nvme", _size(positive=False), parse_size("100GiB"),
               "NVMe tier size; 0 turns it off (default {default})"),
    NodeOption("host", _text, "127.0.0.1", "address to listen on (default 127.0.0.1)"),
    NodeOption("port", _int_in(0, 65535), 0, "port to listen on (default: any free port)"),
    NodeOption("advertise", parse_advertise, ("", 0), "address clients should use, published in the registry (default: "
               "--host, or the hostname for 0.0.0.0; the port defaults to the one listened on)",
               metavar="HOST[:PORT]"),
    NodeOption("node_id", _text, "", "stable node id (default: kept in the NVMe dir, else HOSTNAME-PORT)"),
    NodeOption("cluster", _named(_CLUSTER_RE, "A-Z a-z 0-9 _ . -"), "", "cluster label for same-cluster reads"),
    NodeOption("channel", _choice(_CHANNELS), "off", "serve same-cluster clients over the channel: nccl (GPU), "
               "cpu (its socket twin, for tests) or off (default); needs --cluster", choices=_CHANNELS),
    NodeOption("device", _text, "cuda:0", "CUDA device of --channel nccl (default cuda:0)"),
    NodeOption("pair_timeout_ms", _int_in(1, MAX_NODE_MS), DEFAULT_NODE_PAIR_TIMEOUT_MS,
               "deadline of one channel pairing; a cold NCCL init takes seconds "
               f"(default {DEFAULT_NODE_PAIR_TIMEOUT_MS})", metavar="MS"),
    NodeOption("dead_node_grace_ms", _int_in(1, MAX_NODE_MS), DEFAULT_DEAD_NODE_GRACE_MS,
               "a node dead this long loses its registry entry and index entries, collected by a live node "
               f"(default {DEFAULT_DEAD_NODE_GRACE_MS})", metavar="MS"),
    NodeOption("token_file", _optional(_path), None, "file holding the pool token (or set KVPOOL_TOKEN)"),
    NodeOption("tls_cert", _optional(_path), None, "serve the node protocol over TLS only, with this PEM "
               "certificate chain (it must name the address clients use: --advertise or --host); needs --tls-key",
               metavar="FILE"),
    NodeOption("tls_key", _optional(_path), None, "the PEM private key of --tls-cert", metavar="FILE"),
    NodeOption("redis_ca", _optional(_path), None,
               "CA bundle that verifies a rediss:// Redis (default: the system trust store)", metavar="FILE"),
    NodeOption("redis_password_file", _optional(_path), None, "file holding the Redis ACL password (or set "
               "KVPOOL_REDIS_PASSWORD); the user goes in the --redis URL: rediss://USER@HOST:PORT", metavar="FILE"),
    NodeOption("metrics_port", _optional(_int_in(0, 65535)), None,
               "serve /metrics and /health on this port (0: any free port; default: off)"),
    NodeOption("metrics_host", _text, "127.0.0.1", "address for --metrics-port (default 127.0.0.1)"),
    NodeOption("shm_dir", _shm_dir, Path(DEFAULT_SHM_DIR) if Path(DEFAULT_SHM_DIR).is_dir() else None,
               f"keep DRAM in a shared-memory arena here so same-host clients read without TCP "
               f"(default {DEFAULT_SHM_DIR}; off: private memory)", metavar="DIR|off"),
    NodeOption("token", _text, "", "the pool token clients must prove", env="KVPOOL_TOKEN", flag=False),
    NodeOption("redis_password", _text, "", "the Redis ACL password", env="KVPOOL_REDIS_PASSWORD", flag=False),
)  # fmt: skip
NODE_OPTION_NAMES = tuple(option.name for option in NODE_OPTIONS)
# What `kvpool up` and `kvpool node` default to where they differ, as the user would write it.
NODE_VERB_DEFAULTS: dict[str, dict[str, Any]] = {
    "node": {"dram": "4GiB", "nvme_dir": None, "nvme": "100GiB"},
    "up": {"dram": "1GiB", "nvme_dir": str(Path(".kvpool") / "nvme"), "nvme": "8GiB"},
}


def node_options(
    flags: Mapping[str, Any],
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Each node option's value, parsed and checked on its own: flag, else environment, else YAML, else default.

    ``flags`` maps option names to what was given on the command line (None: not given);
    ``defaults`` overrides the table's defaults (raw, as a user would write them). An
    error names the option as its source spells it: ``--dram``, ``KVPOOL_TOKEN``, or
    ``dram (in FILE)``; an unknown YAML key is an error, an unknown ``KVPOOL_*`` variable a warning.
    """
    environ = environ if environ is not None else {}
    warn_unknown_env(environ)
    from_file = _node_yaml(config_file) if config_file is not None else {}
    values: dict[str, Any] = {}
    for option in NODE_OPTIONS:
        if option.flag and flags.get(option.name) is not None:
            values[option.name] = option.parse(option.flag_name, flags[option.name])
        elif option.env and option.env in environ:
            values[option.name] = option.parse(option.env, environ[option.env])
        elif option.name in from_file:
            values[option.name] = option.parse(f"{option.name} (in {config_file})", from_file[option.name])
        elif defaults is not None and option.name in defaults:
            raw = defaults[option.name]
            values[option.name] = None if raw is None else option.parse(option.flag_name, raw)
        else:
            values[option.name] = option.default
    return values


def _node_yaml(path: str | Path) -> dict[str, Any]:
    """The options of a node's YAML file, keys with dashes or underscores; unknown or secret keys are errors."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of options")
    settable = [option.name for option in NODE_OPTIONS if option.flag]
    options = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in ("token", "redis_password"):
            raise ConfigError(str(key), f"a secret does not belong in {path}: give {name}_file, or set "
                              f"KVPOOL_{name.upper()}")  # fmt: skip
        if name not in settable:
            raise ConfigError(str(key), f"unknown option in {path}; known: {', '.join(sorted(settable))}")
        options[name] = value
    return options


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Everything a pool node needs to run; checked once, here. Build with :meth:`from_sources` or directly."""

    redis_url: str
    namespace: str
    dram_bytes: int
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    advertise_port: int = 0  # 0: the port listened on; else a forwarder's (NAT, container, proxy)
    node_id: str = ""
    token: str = dataclasses.field(default="", repr=False)
    cluster: str = ""
    heartbeat_interval_ms: int = 1000
    heartbeat_ttl_ms: int = 5000
    redis_timeout_ms: int = 2000
    limits: Limits = DEFAULT_LIMITS
    nvme_dir: Path | None = None
    nvme_bytes: int = 0
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    frame_timeout_s: float = 30.0  # once a header arrived, the rest of its frame must follow
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    shm_dir: Path | None = None  # shared-memory arena for same-host clients; None: off
    channel: str = "off"  # serve CHANNEL_GET over this transport: "off", "cpu" or "nccl" (nccl_channel)
    device: str = "cuda:0"  # the CUDA device of the NCCL channel
    tls_cert: Path | None = None  # PEM certificate chain: serve the node protocol over TLS only
    tls_key: Path | None = None  # its private key (PEM)
    redis_password: str = dataclasses.field(default="", repr=False)  # Redis ACL password, if not in redis_url
    redis_ca_file: str = ""  # CA bundle verifying a rediss:// Redis; empty: the system trust store
    dead_node_grace_ms: int = DEFAULT_DEAD_NODE_GRACE_MS  # a dead node's Redis entries go after this long
    pair_timeout_ms: int = DEFAULT_NODE_PAIR_TIMEOUT_MS  # deadline of one channel pairing (a cold NCCL init: seconds)
    token_file: str = ""  # where the token came from, if a file (so `kvpool up` can name it, never print it)
    redis_password_file: str = ""  # likewise for redis_password

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ConfigError("--redis", "the pool's metadata Redis is required: --redis redis://HOST:PORT "
                              "(or redis: in --config)")  # fmt: skip
        redis_tls = RedisTarget.parse(self.redis_url, key="--redis").tls
        if not _NAMESPACE_RE.match(self.namespace):
            raise ConfigError("--namespace", f"{self.namespace!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
        if not _CLUSTER_RE.match(self.cluster):
            raise ConfigError("--cluster", f"{self.cluster!r} must be A-Z a-z 0-9 _ . -")
        if self.dram_bytes <= 0:
            raise ConfigError("--dram", f"{self.dram_bytes} is not a positive size")
        if self.channel not in _CHANNELS:
            raise ConfigError("--channel", f"{self.channel!r} is not one of {', '.join(_CHANNELS)}")
        if self.channel != "off" and not self.cluster:
            raise ConfigError("--channel", "the channel serves clients of the same cluster: give --cluster NAME too")
        for flag, value in (("--pair-timeout-ms", self.pair_timeout_ms),
                            ("--dead-node-grace-ms", self.dead_node_grace_ms)):  # fmt: skip
            if value <= 0:
                raise ConfigError(flag, f"{value} is not a positive number of milliseconds")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert", "TLS needs both --tls-cert and --tls-key")
        if self.tls_cert is not None and not redis_tls:
            # Clients reach a TLS node with tls=on, which also means rediss:// to the registry.
            raise ConfigError("--tls-cert", f"a TLS node needs a TLS Redis (rediss://), not {mask_url(self.redis_url)}")
        if self.redis_ca_file and not redis_tls:
            raise ConfigError("--redis-ca", f"a CA bundle only matters for a rediss:// Redis, not "
                              f"{mask_url(self.redis_url)}")  # fmt: skip

    @classmethod
    def from_sources(
        cls,
        flags: Mapping[str, Any],
        *,
        config_file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> NodeConfig:
        """Flags, environment and YAML file through :data:`NODE_OPTIONS` (see :func:`node_options`)."""
        return cls.from_options(node_options(flags, config_file=config_file, environ=environ, defaults=defaults))

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> NodeConfig:
        """Build from parsed option values (:func:`node_options`); reads the secret files it names."""
        token, token_file = values["token"], values["token_file"]
        if token_file is not None:
            token = _read_node_secret(token_file, "--token-file")
        password, password_file = values["redis_password"], values["redis_password_file"]
        if password_file is not None:
            password = _read_node_secret(password_file, "--redis-password-file")
        nvme_bytes = values["nvme"] if values["nvme_dir"] is not None else 0
        advertise_host, advertise_port = values["advertise"]
        return cls(
            redis_url=values["redis"] or "", namespace=values["namespace"], dram_bytes=values["dram"],
            nvme_dir=values["nvme_dir"] if nvme_bytes else None, nvme_bytes=nvme_bytes,
            host=values["host"], port=values["port"], advertise_host=advertise_host, advertise_port=advertise_port,
            node_id=values["node_id"], token=token, cluster=values["cluster"],
            metrics_host=values["metrics_host"], metrics_port=values["metrics_port"], shm_dir=values["shm_dir"],
            channel=values["channel"], device=values["device"], tls_cert=values["tls_cert"], tls_key=values["tls_key"],
            redis_password=password, redis_ca_file=str(values["redis_ca"] or ""),
            pair_timeout_ms=values["pair_timeout_ms"], dead_node_grace_ms=values["dead_node_grace_ms"],
            token_file=str(token_file.resolve()) if token_file is not None else "",
            redis_password_file=str(password_file.resolve()) if password_file is not None else "",
        )  # fmt: skip


def _read_node_secret(path: Path, flag: str) -> str:
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(flag, f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(flag, f"{path} is not text") from None
    if not secret:
        why = "; a node without a token accepts anyone" if flag == "--token-file" else ""
        raise ConfigError(flag, f"{path} is empty{why}")
    return secret
