"""RedisConnection: one namespace's Redis client, its key names, scripts and deadlines.

The registry (``registry.py``), the index (``index.py``), the lookup (``lookup.py``) and the
rendezvous (``rendezvous.py``) each hold one and share it; every call goes through ``call``, which turns Redis errors into MetadataError and bounds the
call by ``timeout_s`` (or a shorter deadline its caller owes someone else). Two kinds of
trouble are named, so that logs and answers say what is wrong rather than "dead":

* :class:`RedisFullError`: Redis refused a write for lack of memory (``OOM``: at
  ``maxmemory`` under ``maxmemory-policy noeviction``).
* :class:`RedisSlowError`: no answer in time (Redis paused by ``CLIENT PAUSE``, stopped,
  overloaded, or cut off by the network: from here they look the same).
* :class:`RedisUnreachableError`: nothing answers at the URL (refused, no route, no such host).
* :class:`RedisAuthError`: the password was refused, or none given; the message names the file it
  was read from (:class:`RedisCredentials`), never the password.
* :class:`RedisPermissionError`: the ACL refused the user a command or a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

from redis import exceptions as redis_exceptions

from backend.errors import (
    MetadataError,
    RedisAuthError,
    RedisFullError,
    RedisPermissionError,
    RedisSlowError,
    RedisUnreachableError,
)
from backend.metadata.breaker import RedisBreaker
from backend.metadata.records import MIN_REDIS_VERSION, NodeSlots, RedisFacts, RedisMemory, redis_version_key
from backend.metadata.scripts import GIVE_SLOT_LUA
from backend.redis_topology import CLUSTER, CLUSTER_HINT, RedisTarget, connect, mask_url

__all__ = ["MIN_REDIS_VERSION", "RedisConnection", "RedisCredentials", "RedisFullError", "RedisSlowError"]


_NodeStep = Callable[[Any, int], Awaitable[tuple[int, Any]]]  # (cluster node or None, its cursor) -> (next, result)

FULL_HINT = (
    "Redis is full: it refuses writes that need memory (used_memory above maxmemory, "
    "maxmemory-policy noeviction); raise maxmemory or free memory"
)


# What redis-py's ConnectionError says when a TLS handshake, not the connection, failed.
_TLS_TEXTS = ("SSL", "certificate")

# What Redis answers a client that gave no password (RESP2 NOAUTH, or RESP3's HELLO refusal).
_NO_PASSWORD_GIVEN = ("NOAUTH", "Authentication required", "HELLO must be called with the client already authenticated")


def _per_node(info: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """An INFO answer as one mapping per node: a cluster's is keyed by node when more than one node
    answered, but a cluster of one primary answers with that node's fields alone (redis-py)."""
    if info and all(isinstance(value, Mapping) for value in info.values()):
        return list(info.values())
    return [info]


@dataclasses.dataclass(frozen=True)
class RedisCredentials:
    """What Redis errors may say of where this connection points and of its password, never the password:
    ``where`` the URL with any secret masked, ``password_file`` the file the password was read from
    (empty: none, or given another way), ``password_given`` whether any password was given."""

    where: str = ""
    password_file: str = ""
    password_given: bool = False

    def password_refused(self, exc: Exception) -> RedisAuthError:
        text = str(exc)
        at = f"Redis at {self.where}" if self.where else "Redis"
        if any(s in text for s in _NO_PASSWORD_GIVEN):
            return RedisAuthError(
                f"Redis authentication refused: {at} asks for a password and none was given; add "
                "redis_password_file=PATH to the pool URL (or set KVPOOL_REDIS_PASSWORD), and redis_user=USER "
                "for an ACL user; a node takes --redis-password-file and USER@ in its --redis URL",
                "it requires a password, none was given",
                password_given=False,
            )
        if self.password_file:
            which, fix = f"the password in {self.password_file}", "put the password Redis was started with in that file"
        else:
            which = (
                "the password given (KVPOOL_REDIS_PASSWORD, or redis_password in the URL)"
                if self.password_given
                else "this client (no password given)"
            )
            fix = "name a file holding the password Redis was started with as redis_password_file=PATH"
        return RedisAuthError(
            f"Redis authentication refused: {at} refused {which} ({text}); {fix} (requirepass, or the ACL "
            "user's), and redis_user=USER for an ACL user",
            text,
        )


def _permission_refused(action: str, exc: Exception) -> RedisPermissionError:
    return RedisPermissionError(
        f"Redis {action} refused by Redis's ACL ({exc}): the user needs kvpool's commands and the keys ~kvp:*",
        str(exc),
    )


def _unreachable(action: str, exc: Exception, credentials: RedisCredentials) -> RedisUnreachableError:
    at = f"Redis at {credentials.where}" if credentials.where else "Redis"
    reason = f"{action}: {exc}"
    return RedisUnreachableError(
        f"{at} is unreachable ({reason}); start redis-server there (or the whole pool: `kvpool up`), "
        "or fix the host and port of the pool URL",
        reason,
    )


@contextlib.contextmanager
def _redis_errors(
    action: str, breaker: RedisBreaker | None = None, credentials: RedisCredentials = RedisCredentials()
) -> Iterator[None]:
    try:
        yield
    except (redis_exceptions.TimeoutError, TimeoutError) as exc:  # redis-py's socket_timeout: no answer
        if breaker is not None:
            breaker.timed_out()
        raise RedisSlowError(f"Redis slow: {action} got no answer ({exc or 'timed out'})") from None
    except redis_exceptions.AuthenticationError as exc:
        raise credentials.password_refused(exc) from None
    except redis_exceptions.NoPermissionError as exc:
        raise _permission_refused(action, exc) from None
    except redis_exceptions.OutOfMemoryError:
        raise RedisFullError(f"Redis {action} refused: {FULL_HINT}") from None
    except redis_exceptions.ResponseError as exc:
        if "compiling script" in str(exc) or "shebang" in str(exc):  # Redis 6 knows no `#!lua flags=...`
            raise MetadataError(
                f"Redis {action} failed: Redis could not compile a kvpool script ({exc}): kvpool needs Redis 7.0 or "
                "newer (its scripts declare flags)"
            ) from None
        raise MetadataError(f"Redis {action} failed: {exc}") from None
    except redis_exceptions.ConnectionError as exc:  # after AuthenticationError, one of its kind
        if any(text in str(exc) for text in _TLS_TEXTS):  # it answered, but TLS failed: not unreachable
            raise MetadataError(f"Redis {action} failed: {exc}") from None
        raise _unreachable(action, exc, credentials) from None
    except redis_exceptions.RedisError as exc:
        raise MetadataError(f"Redis {action} failed: {exc}") from None
    except redis_exceptions.RedisClusterException as exc:  # not a RedisError: raised while finding the cluster
        raise MetadataError(f"Redis {action} failed: {exc}{CLUSTER_HINT}") from None
    except OSError as exc:
        raise _unreachable(action, exc, credentials) from None


@contextlib.asynccontextmanager
async def _bounded(
    action: str,
    timeout_s: float,
    breaker: RedisBreaker | None = None,
    *,
    opens_breaker: bool = True,
    credentials: RedisCredentials = RedisCredentials(),
) -> AsyncIterator[None]:
    """Redis errors as MetadataError, and the whole call within ``timeout_s``.

    redis-py retries and, on a cluster, re-reads the topology; this deadline is what
    keeps a Redis that is down or failing over from costing a caller more than its
    timeout. redis-py drops a connection whose command was cancelled mid-reply.
    A call that times out opens ``breaker`` (unless ``opens_breaker`` is False: a deadline
    shorter than Redis's own timeout says the caller could wait no longer, not that Redis
    stopped answering): later calls fail at once until Redis answers its probe
    (``backend.metadata.breaker``).
    """
    if breaker is not None:
        breaker.check(action)
    opened = breaker if opens_breaker else None
    try:
        async with asyncio.timeout(timeout_s):
            with _redis_errors(action, opened, credentials):
                yield
    except TimeoutError:
        if opened is not None:
            opened.timed_out()
        raise RedisSlowError(
            f"Redis slow: {action} got no answer within {timeout_s * 1000:.0f} ms (Redis paused, overloaded or cut off)"
        ) from None


# Every namespace's registry hash matches this (SCAN), and nothing else of kvpool does: an index key
# is kvp:NS/<key>, and a namespace holds no brace.
NODES_KEY_PATTERN = "kvp:{*}:nodes"


def nodes_key_of(namespace: str) -> str:
    """``namespace``'s registry hash (node id -> NodeInfo JSON)."""
    return f"kvp:{{{namespace}}}:nodes"


def heartbeat_prefix_of(namespace: str) -> str:
    """What ``namespace``'s heartbeat keys start with (the node id follows)."""
    return f"kvp:{{{namespace}}}:hb:"


def namespace_of_nodes_key(key: str) -> str | None:
    """The namespace whose registry hash ``key`` is (None for any other key)."""
    if key.startswith("kvp:{") and key.endswith("}:nodes"):
        return key[len("kvp:{") : -len("}:nodes")]
    return None


class RedisConnection:
    """One namespace's Redis client (redis-py + hiredis): key names, scripts, bounded calls."""

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        timeout_s: float = 2.0,
        *,
        password: str = "",
        ca_file: str = "",
        password_file: str = "",
    ) -> None:
        """``redis_url`` is ``redis://`` or ``rediss://`` (TLS, verified against ``ca_file`` or the system
        trust), optionally with an ACL user; ``password`` is used when the URL carries none, and
        ``password_file`` (where it was read from) is what a refusal names."""
        self.namespace = namespace
        self.redis_url = redis_url
        self.target = RedisTarget.parse(redis_url)
        where = mask_url(redis_url)
        self.credentials = RedisCredentials(where, password_file, bool(password) or where != redis_url)
        self.timeout_s = timeout_s
        # redis.asyncio Redis or RedisCluster
        self.redis: Any = connect(self.target, timeout_s, password=password, ca_file=ca_file)
        self.breaker = RedisBreaker(self.redis.ping, mask_url(redis_url), timeout_s)
        self._scripts: list[Any] = []  # every script the parts registered (load_scripts loads them again)
        self._give_slot = self.script(GIVE_SLOT_LUA)
        self.slots = NodeSlots()  # node id <-> slot, as learnt from the registry (claims, beats, reads)
        tag = "{" + namespace + "}"
        self.tag_prefix = f"kvp:{tag}:"  # every registry key's name starts so (one Redis Cluster slot)
        self.marker_key = f"kvp:{tag}:marker"
        self.epoch_key = f"kvp:{tag}:epoch"
        self.nodes_key = nodes_key_of(namespace)
        self.draining_key = f"kvp:{tag}:draining"
        self.quotas_key = f"kvp:{tag}:quotas"  # hash tenant -> quota bytes on each node (kvpool quota)
        self.pool_quotas_key = f"kvp:{tag}:poolquotas"  # hash tenant -> quota bytes over the pool
        self._held_prefix = f"kvp:{tag}:held:"  # + node id: hash tenant -> bytes held (backend/metadata/quotas.py)
        self.beats_key = f"kvp:{tag}:beats"
        self.version_key = f"kvp:{tag}:regv"
        self.changes_key = f"kvp:{tag}:regchanges"
        self._hb_prefix = heartbeat_prefix_of(namespace)
        self._holder_prefix = f"kvp:{tag}:holder:"
        self.slots_key = f"kvp:{tag}:slots"
        self.slot_counter_key = f"kvp:{tag}:slotseq"
        self._probe_key = f"kvp:{tag}:probe"  # never set: a node deletes it at start to see it may write here
        # An index key is the namespace and the pool key after a '/', which no namespace holds: no
        # other key of kvpool (nor of the release before, kvp:NS:k:{key}) starts so. No hash tag:
        # the index spreads over a cluster's slots by the whole name.
        self.index_prefix = f"kvp:{namespace}/"
        self.legacy_index_prefix = f"kvp:{namespace}:k:"  # the release before 34's index keys (check --fix)
        self.shard_marker_prefix = f"kvp:{namespace}:m:"

    def script(self, lua: str) -> Any:
        """Register a Lua script (no I/O); :meth:`load_scripts` loads it again when Redis lost it."""
        registered = self.redis.register_script(lua)
        self._scripts.append(registered)
        return registered

    @property
    def is_cluster(self) -> bool:
        return self.target.mode == CLUSTER

    def call(self, action: str, timeout_s: float | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        """Bound a call by Redis's timeout, or by ``timeout_s`` when the caller owes an answer sooner."""
        if timeout_s is None or timeout_s >= self.timeout_s:
            return _bounded(action, self.timeout_s, self.breaker, credentials=self.credentials)
        return _bounded(action, timeout_s, self.breaker, opens_breaker=False, credentials=self.credentials)

    # -- keys -------------------------------------------------------------------------
    def index_key(self, key: str) -> str:
        return self.index_prefix + key

    def key_from_index(self, index_key: str) -> str:
        return index_key[len(self.index_prefix) :]

    def heartbeat_key(self, node_id: str) -> str:
        return self._hb_prefix + node_id

    def holder_key(self, node_id: str) -> str:
        """Who holds ``node_id``'s claim (``ClaimHolder``): written with its heartbeat, expiring with it."""
        return self._holder_prefix + node_id

    def held_key(self, node_id: str) -> str:
        """What ``node_id`` reported holding of the tenants with a pool quota, expiring with its heartbeat."""
        return self._held_prefix + node_id

    # -- lifecycle --------------------------------------------------------------------
    async def close(self) -> None:
        self.breaker.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):  # a hung Redis must not hold up a shutdown
                await self.redis.aclose()

    async def ping(self) -> float:
        """Round-trip time to Redis in milliseconds."""
        start = time.perf_counter()
        async with self.call("PING"):
            await self.redis.ping()
        return (time.perf_counter() - start) * 1000

    async def check_version(self) -> str:
        """Redis's version (``INFO server``; the oldest primary's on a cluster), or "" where this user may not
        ask (hardened ACLs take INFO away): MetadataError naming it if it is older than
        :data:`MIN_REDIS_VERSION`, which cannot run kvpool's scripts."""
        try:
            async with self.call("INFO server"):
                if self.is_cluster:
                    answers = _per_node(await self.redis.info("server", target_nodes=self.redis.PRIMARIES))
                else:
                    answers = [await self.redis.info("server")]
        except RedisPermissionError:
            return ""
        version = min((str(a.get("redis_version", "")) for a in answers), key=redis_version_key, default="")
        if version and redis_version_key(version) < MIN_REDIS_VERSION:
            needed = ".".join(map(str, MIN_REDIS_VERSION))
            raise MetadataError(
                f"Redis at {mask_url(self.redis_url)} is version {version}; kvpool needs Redis {needed} or newer "
                "(its scripts declare flags, which older versions cannot compile)"
            )
        return version

    async def check_writable(self) -> None:
        """That this namespace's keys may be written: a DEL of a registry key name (``kvp:{NS}:``) and of an
        index key name (``kvp:NS/``: the empty pool key) that no key of kvpool holds, so it changes nothing.
        A read-only replica refuses it, and so does an ACL user without those keys (``RedisPermissionError``); a full
        Redis does not (DEL takes no memory)."""
        for key in (self._probe_key, self.index_prefix):  # one at a time: on a cluster they are in two slots
            async with self.call("namespace write check"):
                await self.redis.delete(key)

    async def memory(self) -> RedisMemory:
        """Redis's ``used_memory``, ``maxmemory`` and policy (``INFO memory``): says whether it is full."""
        async with self.call("INFO memory"):
            if self.is_cluster:  # one answer per primary: the fullest of those with a limit speaks for all
                answers = _per_node(await self.redis.info("memory", target_nodes=self.redis.PRIMARIES))
                limited = [a for a in answers if int(a.get("maxmemory", 0))] or answers
                info = max(limited, key=lambda a: int(a["used_memory"]) / max(int(a["maxmemory"]), 1))
            else:
                info = await self.redis.info("memory")
        return RedisMemory(
            int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)), str(info.get("maxmemory_policy", ""))
        )

    async def facts(self) -> RedisFacts:
        """Redis's version (``INFO server``) and clock (``TIME``)."""
        async with self.call("INFO server"):
            info = _per_node(await self.redis.info("server"))[0]
            seconds, micros = await self.redis.time()
        return RedisFacts(str(info.get("redis_version", "")), int(seconds) + int(micros) / 1e6)

    # -- slots ------------------------------------------------------------------------
    async def slot_map(self) -> dict[str, int]:
        """Every node id that holds a slot, and its slot (``HGETALL`` of one small hash); learnt."""
        async with self.call("HGETALL slots"):
            raw = await self.redis.hgetall(self.slots_key)
        out = {node_id: int(slot) for node_id, slot in raw.items() if str(slot).isdigit()}
        for node_id, slot in out.items():
            self.slots.learn(node_id, slot)
        return out

    async def learn_slots(self, node_ids: Sequence[str]) -> None:
        """Read the slots of ``node_ids`` this reader does not know yet (those that hold none stay unknown)."""
        missing = [n for n in dict.fromkeys(node_ids) if self.slots.slot_of(n) is None]
        if not missing:
            return
        async with self.call("HMGET slots"):
            found = await self.redis.hmget(self.slots_key, missing)
        for node_id, slot in zip(missing, found):
            if slot is not None and str(slot).isdigit():
                self.slots.learn(node_id, int(slot))

    async def give_slots(self, node_ids: Sequence[str]) -> None:
        """Make sure each of ``node_ids`` holds a slot (a commit for a node id that never claimed one,
        as ``kvpool check --fix`` or a test may write): read, else given from the counter."""
        await self.learn_slots(node_ids)
        for node_id in dict.fromkeys(node_ids):
            if self.slots.slot_of(node_id) is None:
                async with self.call("slot"):
                    answer = await self._give_slot(keys=[self.slots_key, self.slot_counter_key], args=[node_id])
                self.slots.learn(node_id, int(answer))

    async def load_scripts(self) -> None:
        """SCRIPT LOAD every script (on a cluster redis-py sends it to every primary)."""
        for script in self._scripts:
            await self.redis.script_load(script.script)

    # -- walks ------------------------------------------------------------------------
    async def scan_names(self, cursor: int, pattern: str, count: int) -> tuple[int, list[str]]:
        """One bounded SCAN step over raw Redis key names matching ``pattern``: ``(next cursor, names)``.

        On a cluster the cursor also says which primary is being walked (:meth:`walk_step`).
        """

        async def scan(node: Any, node_cursor: int) -> tuple[int, list[str]]:
            if node is None:
                next_cursor, names = await self.redis.scan(node_cursor, match=pattern, count=count)
                return int(next_cursor), list(names)
            cursors, names = await self.redis.scan(node_cursor, match=pattern, count=count, target_nodes=node)
            return int(cursors[node.name]), list(names)

        async with self.call("SCAN"):
            next_cursor, names = await self.walk_step(cursor, scan)
        return next_cursor, names

    async def walk_step(self, cursor: int, step: _NodeStep) -> tuple[int, Any]:
        """One step of a walk over every primary: ``step`` runs on the primary the cursor names (None on
        one Redis) with that primary's own cursor; answers the walk's next cursor and what ``step`` found.
        The cursor is the primary's place in name order times 2**64, plus that primary's own cursor."""
        if not self.is_cluster:
            return await step(None, cursor)
        await self.redis.initialize()  # the slot map; a no-op once it is known
        primaries = sorted(self.redis.get_primaries(), key=lambda node: node.name)
        place, node_cursor = divmod(cursor, 1 << 64)
        if place >= len(primaries):
            raise MetadataError(f"SCAN cursor {cursor} names primary {place}; the cluster has {len(primaries)}")
        node_next, found = await step(primaries[place], node_cursor)
        if node_next == 0:
            place += 1
            if place == len(primaries):
                return 0, found
        return (place << 64) + node_next, found
