"""The pool as one client sees it: Redis with these credentials, live nodes, each node's answer.

:func:`reach` is the short check a client makes before it relies on the pool (the LMCache
connector at start, ``kvpool lmcache-config``, ``kvpool selftest``): Redis answers and
accepts the credentials, and a node is alive in the namespace (else which namespaces do
have live nodes). :func:`check_pool` is ``kvpool doctor``'s: that, plus Redis's version,
memory and clock, and a handshake with every live node. Every failure names its cause
(``backend.doctor.findings``). Nothing here imports LMCache.
"""

from __future__ import annotations

import ipaddress
import socket
import time

from backend.client import PoolClient
from backend.config import PoolConfig
from backend.config.values import ms_to_s
from backend.doctor.findings import (
    CLOCK_SKEW,
    EVERY_LOOKUP_MISSES,
    NOT_ADVERTISED,
    REDIS_FULL,
    REDIS_SLOW,
    REDIS_UNREACHABLE,
    TLS_NAME,
    TLS_UNTRUSTED,
    VERSION_MISMATCH,
    WRONG_NAMESPACE,
    WRONG_PASSWORD,
    WRONG_TOKEN,
    Cause,
    Finding,
)
from backend.errors import (
    AuthError,
    KVPoolError,
    MetadataError,
    NodeUnavailable,
    ProtocolError,
    RedisAuthError,
    RedisSlowError,
)
from backend.metadata import MIN_REDIS_VERSION, LiveNamespaces, NodeInfo, RedisFacts
from backend.redis_topology import mask_url

__all__ = [
    "CLOCK_SKEW_LIMIT_S",
    "MIN_REDIS_VERSION",
    "check_pool",
    "check_redis",
    "nodes_finding",
    "reach",
    "redis_failure",
]

# A wall clock further off than this from Redis's is reported. Liveness never reads wall clocks
# (Redis TTLs do), but TLS certificate dates and every time kvpool shows are read on them.
CLOCK_SKEW_LIMIT_S = 30.0
HEARTBEAT_TTL_S = 5.0  # a live node's last heartbeat is at most this old (its default TTL)

# What Python's ssl module says when the certificate is good but names another host.
_TLS_NAME_TEXTS = ("Hostname mismatch", "IP address mismatch")
_TLS_VERIFY_TEXT = "certificate verify failed"
_HANDSHAKE_VERSION_TEXT = "handshake version"
_OLD_REDIS_TEXT = "kvpool needs Redis"


def _tls_cause(text: str) -> Cause | None:
    if any(t in text for t in _TLS_NAME_TEXTS):
        return TLS_NAME
    if _TLS_VERIFY_TEXT in text:
        return TLS_UNTRUSTED
    return None


def redis_failure(exc: MetadataError, config: PoolConfig) -> Finding:
    """Why Redis did not answer this client, as a finding naming its cause."""
    where = mask_url(config.redis_url)
    text = str(exc)
    if isinstance(exc, RedisAuthError):
        if not exc.password_given:
            return Finding.failed(
                "Redis",
                "Redis asks for a password: add redis_password_file=PATH to the URL (or set KVPOOL_REDIS_PASSWORD)",
                "name a file holding the password Redis was started with (requirepass, or the ACL user's); "
                "nodes take the same file as --redis-password-file",
                WRONG_PASSWORD,
            )
        user = f"ACL user {config.redis_user!r}" if config.redis_user else "Redis's default user"
        source = (
            f"read from {config.redis_password_file}" if config.redis_password_file else "from the URL or environment"
        )
        return Finding.failed(
            "Redis",
            f"Redis at {where} refused the password ({source}) for {user}: {text}",
            "put the password Redis was started with in that file (and redis_user=USER for an ACL user)",
            WRONG_PASSWORD,
        )
    tls = _tls_cause(text)
    if tls is TLS_NAME:
        return Finding.failed(
            "Redis",
            f"Redis's TLS certificate does not name {config.redis_host}, the host the URL dials: {text}",
            "dial Redis by a name its certificate carries, or reissue the certificate with this name",
            TLS_NAME,
        )
    if tls is TLS_UNTRUSTED:
        return Finding.failed(
            "Redis",
            f"Redis's TLS certificate is not trusted here: {text}",
            "give tls_ca=PATH naming the CA that signed it (and check this host's clock: an expired or "
            "not-yet-valid certificate reads the same)",
            TLS_UNTRUSTED,
        )
    if _OLD_REDIS_TEXT in text:
        return Finding.failed("Redis", text, "run Redis 7.0 or newer", VERSION_MISMATCH)
    if isinstance(exc, RedisSlowError):
        return Finding.failed(
            "Redis",
            f"Redis at {where} took too long: {text}",
            "Redis is paused (CLIENT PAUSE), stopped, overloaded or cut off: nodes keep serving what they hold and "
            "lookups read as misses meanwhile; see Redis's log and `redis-cli --latency`",
            REDIS_SLOW,
        )
    return Finding.failed(
        "Redis",
        f"Redis at {where} does not answer: {text}",
        f"start Redis (or the whole pool: `kvpool up`), or fix the host and port in the URL; `redis-cli -h "
        f"{config.redis_host} -p {config.redis_port} ping` from this host should answer",
        REDIS_UNREACHABLE,
    )


async def check_redis(client: PoolClient) -> tuple[list[Finding], RedisFacts | None, bool]:
    """Redis: reachable with these credentials, then its version, clock and memory. Also what Redis said
    of itself (None if it would not say) and whether it answered at all."""
    config = client.config
    try:
        rtt_ms = await client.index.ping()
    except MetadataError as exc:
        return [redis_failure(exc, config)], None, False
    found = [Finding.passed("Redis", f"{mask_url(config.redis_url)} answers ({rtt_ms:.2f} ms)")]
    try:
        facts = await client.index.facts()
    except MetadataError:  # an ACL user without INFO or TIME: nothing more to learn here
        return found, None, True
    found.append(_version_finding(facts))
    found.append(_host_clock_finding(facts, rtt_ms))
    try:
        memory = await client.index.memory()
    except MetadataError:
        return found, facts, True
    if memory.full:
        found.append(
            Finding.failed(
                "Redis memory",
                f"Redis is full: {memory.describe()}: puts are refused",
                "raise maxmemory (CONFIG SET maxmemory, and in redis.conf) or free memory; nodes keep serving "
                "what they hold meanwhile",
                REDIS_FULL,
            )
        )
    else:
        found.append(Finding.passed("Redis memory", memory.describe()))
    return found, facts, True


def _version_finding(facts: RedisFacts) -> Finding:
    if facts.version_tuple < MIN_REDIS_VERSION:
        return Finding.failed(
            "Redis version",
            f"Redis {facts.version or '(unknown)'}: kvpool needs 7.0 or newer (its scripts declare flags)",
            "upgrade Redis",
            VERSION_MISMATCH,
        )
    return Finding.passed("Redis version", facts.version)


def _skew_text(skew_s: float) -> str:
    return f"{abs(skew_s):.0f} s {'ahead of' if skew_s > 0 else 'behind'}"


def _host_clock_finding(facts: RedisFacts, rtt_ms: float) -> Finding:
    skew_s = time.time() - facts.time_s - ms_to_s(rtt_ms) / 2
    if abs(skew_s) > CLOCK_SKEW_LIMIT_S:
        return Finding.failed(
            "clock",
            f"this host's clock is {_skew_text(skew_s)} Redis's",
            "run NTP (chrony, systemd-timesyncd) on every host: certificate dates and the times kvpool shows "
            "read the wall clock",
            CLOCK_SKEW,
        )
    return Finding.passed("clock", f"within {CLOCK_SKEW_LIMIT_S:.0f} s of Redis's")


async def nodes_finding(client: PoolClient, *, search_elsewhere: bool = True) -> tuple[Finding, list[NodeInfo]]:
    """Whether a node is alive in the client's namespace (else where nodes are); the live nodes.

    ``search_elsewhere``: with no live node here, look for the namespaces that have one (a SCAN of the
    whole keyspace for up to ``NAMESPACE_SEARCH_S``): once per question, never on a timer."""
    config = client.config
    nodes = await client.index.nodes()
    alive = [n for n in nodes if n.alive]
    if alive:
        return Finding.passed("nodes", f"{len(alive)} live in namespace {config.namespace!r}"), alive
    dead = f" ({len(nodes)} registered, none alive)" if nodes else ""
    start_one = (
        f"start one: kvpool node --redis {config.redis_url} --namespace {config.namespace}, with "
        "--redis-password-file and --token-file as the pool needs"
    )
    if not search_elsewhere:
        return Finding.failed(
            "nodes",
            f"no live node in namespace {config.namespace!r}{dead}",
            f"{start_one}; or name the namespace the nodes joined (`kvpool status` lists those with live nodes)",
            EVERY_LOOKUP_MISSES,
        ), []
    spaces = await client.index.live_namespaces()
    others = LiveNamespaces({k: v for k, v in spaces.live.items() if k != config.namespace}, spaces.complete)
    if others.live:
        first = sorted(others.live)[0]
        return Finding.failed(
            "nodes",
            f"no live node in namespace {config.namespace!r}{dead}; namespaces with live nodes: {others.describe()}",
            f"name the namespace the nodes joined (kvpool://{config.redis_host}:{config.redis_port}/{first}), "
            f"or start nodes with --namespace {config.namespace}",
            WRONG_NAMESPACE,
        ), []
    if spaces.complete:
        return Finding.failed(
            "nodes",
            f"no live node in namespace {config.namespace!r}{dead}, nor in any other namespace of this Redis",
            start_one,
            EVERY_LOOKUP_MISSES,
        ), []
    # A large Redis is not searched whole in the time allowed: the nodes may be in a namespace not reached.
    return Finding.failed(
        "nodes",
        f"no live node in namespace {config.namespace!r}{dead}, nor in the part of this Redis searched "
        "(not all of it: too many keys for the time allowed)",
        f"{start_one}; or name the namespace the nodes joined (`redis-cli --scan --pattern 'kvp:{{*}}:nodes'` "
        "lists every namespace's registry)",
        EVERY_LOOKUP_MISSES,
    ), []


async def reach(client: PoolClient, *, search_elsewhere: bool = True) -> list[Finding]:
    """Redis answers with these credentials and a node is alive in the namespace: what every client needs.
    ``search_elsewhere``: as :func:`nodes_finding` (False for a check repeated on a timer)."""
    try:
        rtt_ms = await client.index.ping()
    except MetadataError as exc:
        return [redis_failure(exc, client.config)]
    answered = Finding.passed("Redis", f"{mask_url(client.config.redis_url)} answers ({rtt_ms:.2f} ms)")
    try:
        finding, _ = await nodes_finding(client, search_elsewhere=search_elsewhere)
    except MetadataError as exc:
        return [answered, redis_failure(exc, client.config)]
    return [answered, finding]


async def check_pool(client: PoolClient) -> list[Finding]:
    """``kvpool doctor``'s pool checks: Redis, its version, clock and memory, the namespace, every live node."""
    found, facts, answered = await check_redis(client)
    if not answered:
        return [*found, Finding.skipped("nodes", "Redis did not answer")]
    try:
        finding, alive = await nodes_finding(client)
    except MetadataError as exc:
        return [*found, redis_failure(exc, client.config)]
    found.append(finding)
    here = socket.gethostname()
    for node in alive:
        found.append(await _node_finding(client, node, here))
        skew = _node_clock_finding(node, facts.time_s) if facts is not None else None
        if skew is not None:
            found.append(skew)
    return found


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _node_finding(client: PoolClient, node: NodeInfo, here: str) -> Finding:
    """One live node: reachable at the address it advertises, and agreeing with this client on token and version."""
    check = f"node {node.node_id}"
    try:
        await client.node_admin.stats(node)
    except AuthError as exc:
        return Finding.failed(
            check,
            f"refused this client's token: {exc}",
            "give the URL token_file=PATH naming a file with the token the nodes were started with (--token-file)",
            WRONG_TOKEN,
        )
    except ProtocolError as exc:
        cause = VERSION_MISMATCH if _HANDSHAKE_VERSION_TEXT in str(exc) else None
        return Finding.failed(
            check, f"at {node.address}: {exc}", "run the same kvpool release on nodes and clients", cause
        )
    except NodeUnavailable as exc:
        return _unreachable(check, node, here, str(exc))
    except KVPoolError as exc:
        return Finding.failed(check, f"at {node.address}: {exc}")
    return Finding.passed(check, f"answers at {node.address} (epoch {node.epoch}, host {node.hostname or '?'})")


def _unreachable(check: str, node: NodeInfo, here: str, text: str) -> Finding:
    tls = _tls_cause(text)
    if tls is TLS_NAME:
        return Finding.failed(
            check,
            f"its TLS certificate does not name {node.host}, the address it advertises: {text}",
            f"reissue the node's certificate for {node.host}, or start it with --advertise set to a name the "
            "certificate carries",
            TLS_NAME,
        )
    if tls is TLS_UNTRUSTED:
        return Finding.failed(
            check, f"its TLS certificate is not trusted here: {text}", "give tls_ca=PATH naming its CA", TLS_UNTRUSTED
        )
    elsewhere = node.hostname and node.hostname != here
    loopback = (
        f"; {node.host} is a loopback address of host {node.hostname}, not of this one"
        if _is_loopback(node.host) and elsewhere
        else ""
    )
    return Finding.failed(
        check,
        f"advertises {node.address}, which this host cannot reach{loopback}: {text}",
        "start the node with --advertise HOST[:PORT] that clients can reach, and --host 0.0.0.0 (or that "
        "address) so it listens there; open the port in the firewall",
        NOT_ADVERTISED,
    )


def _node_clock_finding(node: NodeInfo, redis_now_s: float) -> Finding | None:
    """A finding when the node's heartbeat stamp (its wall clock) is off Redis's clock; None when it is not."""
    if not node.heartbeat_at:
        return None
    skew_s = node.heartbeat_at - redis_now_s
    # A live node beat within its TTL: a stamp up to that old is not skew.
    if skew_s > CLOCK_SKEW_LIMIT_S or skew_s < -(CLOCK_SKEW_LIMIT_S + HEARTBEAT_TTL_S):
        return Finding.failed(
            f"node {node.node_id} clock",
            f"host {node.hostname or node.host}'s clock is {_skew_text(skew_s)} Redis's (by its last heartbeat)",
            "run NTP (chrony, systemd-timesyncd) on that host",
            CLOCK_SKEW,
        )
    return None
