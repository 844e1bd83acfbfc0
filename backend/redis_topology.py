"""Which Redis holds the metadata: one server, a Redis Cluster, or a Sentinel-managed master.

Nodes take the metadata Redis as a URL (``kvpool node --redis URL``); clients derive
it from their ``kvpool://`` URL (:attr:`PoolConfig.redis_url`). Three forms::

    redis://[USER[:PASSWORD]@]HOST:PORT[/DB]          one server (any redis-py URL: rediss://, unix://)
    redis+cluster://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]     Redis Cluster; any members, as seeds
    redis+sentinel://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]/MASTER   sentinels, and the master's name

``rediss+cluster://`` and ``rediss+sentinel://`` are the TLS forms (as ``rediss://`` is
for one server): every connection, sentinels included, is TLS.

:func:`connect` builds the redis-py client for a target; it is called only by
:class:`backend.metadata.MetadataStore`, so every Redis connection kvpool makes has the
same timeouts and retry policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import quote, unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff

from backend.errors import ConfigError

__all__ = [
    "RedisTarget",
    "SINGLE",
    "CLUSTER",
    "SENTINEL",
    "REDIS_MODES",
    "connect",
    "parse_hosts",
    "render_hosts",
    "mask_url",
    "CLUSTER_HINT",
]

SINGLE = "single"
CLUSTER = "cluster"
SENTINEL = "sentinel"
REDIS_MODES = (SINGLE, CLUSTER)  # sentinel mode is chosen by naming the master (sentinel=NAME)
_SCHEMES = {
    "redis+cluster": (CLUSTER, False),
    "redis+sentinel": (SENTINEL, False),
    "rediss+cluster": (CLUSTER, True),
    "rediss+sentinel": (SENTINEL, True),
}

# A RedisCluster retries a failed command 10 times by default, up to 1 s apart,
# re-reading the slot map each time: far past kvpool's timeouts, and every lookup
# during an outage would pay it. One quick retry (every topology alike) rides over a
# connection that died with a restarted Redis; MetadataStore's deadline bounds the rest.
RETRIES = 1
# redis-py's RedisClusterException (not a RedisError) says a cluster could not be found at all.
CLUSTER_HINT = (
    " (redis_mode=cluster, or redis+cluster://, needs a Redis Cluster: check that a member is reachable and "
    "runs with cluster-enabled yes, or drop redis_mode=cluster for one Redis)"
)
RETRY_BASE_S = 0.01
RETRY_CAP_S = 0.05


def mask_url(url: str) -> str:
    """``url`` with the password of its userinfo shown as ``***`` (``USER:***@``), for errors and logs."""
    scheme, sep, rest = url.partition("://")
    auth, at, after = rest.rpartition("@")  # as parse() splits: a '/' or '@' in a password stays masked
    if not sep or not at or ":" not in auth:
        return url
    return f"{scheme}://{auth.partition(':')[0]}:***@{after}"


def parse_hosts(text: str, *, key: str) -> tuple[tuple[str, int], ...]:
    """``"h1:p1,h2:p2"`` into ``(("h1", p1), ("h2", p2))``; ``key`` names the option in errors."""
    hosts: list[tuple[str, int]] = []
    for item in (part.strip() for part in text.split(",")):
        host, sep, port_text = item.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(key, f"{item!r} is not HOST:PORT (e.g. 10.0.0.5:6379)")
        hosts.append((host, int(port_text)))
    return tuple(hosts)


def render_hosts(hosts: tuple[tuple[str, int], ...] | list[tuple[str, int]]) -> str:
    """The inverse of :func:`parse_hosts`."""
    return ",".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in hosts)


@dataclasses.dataclass(frozen=True)
class RedisTarget:
    """A parsed metadata-Redis URL. ``url`` keeps the original for the single-server form."""

    mode: str
    url: str = ""  # single: handed to redis-py as is
    hosts: tuple[tuple[str, int], ...] = ()  # cluster seeds or sentinels
    master: str = ""  # sentinel: the monitored master's name
    password: str = dataclasses.field(default="", repr=False)
    user: str = ""  # Redis ACL user (cluster and sentinel forms; the single form keeps it in ``url``)
    tls: bool = False  # cluster and sentinel forms: rediss+...; the single form: a rediss:// ``url``

    @classmethod
    def parse(cls, url: str, *, key: str = "redis") -> RedisTarget:
        """Parse one of the three forms; a malformed URL raises ConfigError naming ``key`` (password masked)."""
        shown = mask_url(url)
        scheme, sep, rest = url.partition("://")
        form = _SCHEMES.get(scheme.lower())
        if not sep or form is None:
            if scheme.lower() in {"redis", "rediss", "unix"} and sep:
                return cls(SINGLE, url=url, tls=scheme.lower() == "rediss")
            raise ConfigError(
                key,
                f"{shown!r} is not redis://HOST:PORT, redis+cluster://HOST:PORT or redis+sentinel://HOST:PORT/MASTER",
            )
        mode, tls = form
        auth, at, after = rest.rpartition("@")  # the userinfo ends at the last '@', wherever a '/' is
        hosts_text, _, path = after.partition("/")
        user_text, _, password_text = auth.partition(":")
        user, password = (unquote(user_text), unquote(password_text)) if at else ("", "")
        if "?" in path or "?" in hosts_text:
            raise ConfigError(key, f"{scheme}:// URLs take no query options: {shown!r}")
        try:
            hosts = parse_hosts(hosts_text, key=key)
        except ConfigError as exc:
            raise ConfigError(key, f"{str(exc).removeprefix(key + ': ')} in {shown!r}") from None
        master = unquote(path.strip("/"))
        if mode == SENTINEL and not master:
            raise ConfigError(key, f"name the master: redis+sentinel://HOST:PORT/MASTER, got {shown!r}")
        if mode == CLUSTER and master:
            raise ConfigError(key, f"Redis Cluster has no database or master name in the path: {shown!r}")
        return cls(mode, hosts=hosts, master=master, password=password, user=user, tls=tls)

    @classmethod
    def build(
        cls,
        mode: str,
        hosts: tuple[tuple[str, int], ...],
        *,
        master: str = "",
        db: int = 0,
        tls: bool = False,
        user: str = "",
    ) -> RedisTarget:
        """The target for a ``kvpool://`` URL's Redis part (no password: it travels apart from URLs)."""
        if master:
            return cls(SENTINEL, hosts=hosts, master=master, user=user, tls=tls)
        if mode == CLUSTER:
            return cls(CLUSTER, hosts=hosts, user=user, tls=tls)
        host, port = hosts[0]
        who = f"{quote(user, safe='')}@" if user else ""
        return cls(SINGLE, url=f"{'rediss' if tls else 'redis'}://{who}{render_hosts([(host, port)])}/{db}", tls=tls)

    def render(self) -> str:
        """The URL form of this target, password masked."""
        if self.mode == SINGLE:
            return mask_url(self.url)
        who = quote(self.user, safe="") if self.user else ""
        auth = f"{who}:***@" if self.password else (f"{who}@" if who else "")
        hosts = render_hosts(self.hosts)
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.mode == CLUSTER else "+sentinel")
        tail = f"/{quote(self.master, safe='')}" if self.mode == SENTINEL else ""
        return f"{scheme}://{auth}{hosts}{tail}"


def connect(target: RedisTarget, timeout_s: float, *, password: str = "", ca_file: str = "") -> Any:
    """A redis-py asyncio client for ``target`` (``Redis`` or ``RedisCluster``), decoding replies.

    ``password`` is used when the target carries none; ``ca_file`` verifies a TLS Redis
    (empty: the system trust store). Replies are UTF-8 text, and bytes that are not UTF-8
    decode losslessly as surrogates: an index value is binary (``backend.metadata.records``),
    and ``text.encode("utf-8", "surrogateescape")`` gives its bytes back.
    """
    retry = Retry(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S), retries=RETRIES)
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "decode_responses": True,
        "encoding_errors": "surrogateescape",
        "retry": retry,
    }
    if target.password or password:
        common["password"] = target.password or password
    if target.user:
        common["username"] = target.user
    tls: dict[str, Any] = {}
    if target.tls and ca_file:
        tls["ssl_ca_certs"] = ca_file
    if target.tls and target.mode != SINGLE:
        tls["ssl"] = True  # the single form says so with its rediss:// scheme
    common.update(tls)
    if target.mode == CLUSTER:
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        return RedisCluster(startup_nodes=nodes, **common)
    if target.mode == SENTINEL:
        sentinel_kwargs = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, **tls}
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs)
        return sentinel.master_for(target.master, redis_class=aioredis.Redis, health_check_interval=0, **common)
    return aioredis.Redis.from_url(target.url, health_check_interval=0, **common)
