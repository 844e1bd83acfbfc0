"""The Redis metadata layer: key schema, node registry, index, Lua scripts.

Redis holds metadata only -- which key lives on which node and tier, node liveness,
epochs. Bytes never pass through it, and it can be rebuilt: a node that finds the
namespace marker missing republishes what it holds.

Key schema (``NS`` is the namespace)::

    kvp:{NS}:marker          namespace generation; missing or changed means Redis lost our state
    kvp:NS:m:{NS.<n>}        Redis Cluster only: the same, on each other primary (see marker_keys)
    kvp:{NS}:epoch           counter; every node start takes a new epoch from it
    kvp:{NS}:nodes           hash node_id -> NodeInfo JSON (the registry)
    kvp:{NS}:hb:<node_id>    liveness; value = epoch, expires after the heartbeat TTL
    kvp:{NS}:draining        set of node ids placement skips (kvpool drain)
    kvp:{NS}:beats           sorted set node_id -> when its heartbeat expires (Redis server time, ms)
    kvp:{NS}:regv            registry version: bumped whenever what clients keep of a node changes
    kvp:{NS}:regchanges      list, newest first, of "version|node_id" per bump (the last REGISTRY_LOG_MAX)
    kvp:NS:k:{<key>}         index entry: hash node_id -> "epoch|tier|nbytes|checksum|written_at"
    kvp:{NS}:rdv:<session>   channel rendezvous offer (JSON), read once by the peer; expires (TTL)

Registry keys share the hash tag ``{NS}`` (one Redis Cluster slot, small); index keys
are tagged by their own key so the index spreads over every shard.

A client's registry refresh costs one command while nothing changed: it compares its
version with ``regv`` and reads only the nodes the change log names since then (the
whole registry only when it is new, fell behind the log, or Redis lost the log). The
version is bumped when a node joins, restarts (new epoch), comes back, leaves, dies
(the first heartbeat of any node after its beat expired notices), starts or stops
draining, or reports a change clients rely on (address, arena, load by tenths).

The same code runs on one Redis, a Redis Cluster and a Sentinel-managed master
(``backend.redis_topology`` builds the client). On a cluster a pipeline is split by
redis-py into one pipeline per shard, sent in parallel; multi-key DEL is split by
slot, SCAN walks every primary. Every call is bounded by ``timeout_s``: a Redis that
is down, paused or failing over costs at most that long, then raises MetadataError.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from redis import exceptions as redis_exceptions

from backend.errors import MetadataError
from backend.redis_topology import CLUSTER, RedisTarget, connect

__all__ = ["MetadataStore", "NodeInfo", "Location", "IndexEntry", "Beat"]

logger = logging.getLogger(__name__)

LOOKUP_BATCH = 1000  # keys per pipeline flush on republish/removal
REGISTRY_LOG_MAX = 1000  # registry changes a client may be behind and still read only what changed
DEAD_PER_BEAT = 100  # expired beats one heartbeat collects (the next ones take the rest)
MARKER_TAG_SEARCH = 100_000  # hash tags tried to find one per cluster primary (16384 slots)

# Atomic commit of one location. A replica elsewhere whose checksum differs holds
# other bytes under the same key: drop it so readers never mix two versions.
_COMMIT_LUA = """
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] ~= ARGV[1] then
    local sum = string.match(fields[i + 1], '^[^|]*|[^|]*|[^|]*|([^|]*)')
    if sum ~= ARGV[3] then redis.call('HDEL', KEYS[1], fields[i]) end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Remove a location only if it is still the one this node epoch wrote.
_REMOVE_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and string.sub(v, 1, #ARGV[2] + 1) == ARGV[2] .. '|' then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""

# Change a location's tier, only if this node epoch still holds the key (never resurrects).
_MOVE_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and string.sub(v, 1, #ARGV[2] + 1) == ARGV[2] .. '|' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
"""

_EPOCH_FLOOR_LUA = """
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""

# Remove a location whatever epoch wrote it, if it still says what the caller saw.
_REMOVE_EXACT_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


# A heartbeat's liveness part, atomic: refresh this node's beat (expiry by Redis's clock,
# so node clocks may differ), collect beats that expired, and log a registry change for
# this node (new, back, or ARGV[3] == '1') and for each dead one.
_BEAT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local changed = {}
if redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) == 1 or ARGV[3] == '1' then
  changed[1] = ARGV[1]
end
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, tonumber(ARGV[5]))) do
  redis.call('ZREM', KEYS[1], dead)
  changed[#changed + 1] = dead
end
for _, node in ipairs(changed) do
  redis.call('LPUSH', KEYS[3], redis.call('INCR', KEYS[2]) .. '|' .. node)
end
if #changed > 0 then redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1) end
return #changed
"""

# A registry change not seen by a heartbeat (deregister, forget, drain): log it for ARGV[1].
_CHANGE_LUA = """
redis.call('LPUSH', KEYS[2], redis.call('INCR', KEYS[1]) .. '|' .. ARGV[1])
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[2]) - 1)
return 1
"""

# What changed since version ARGV[1] under namespace marker ARGV[3]: {version, marker, node ids...};
# {version, marker, '*'} when the log cannot say (the caller is new or behind the log, or Redis
# lost the namespace since: a new marker, and versions count again from 1): read everything.
# Nodes whose beat expired count as changed even before a heartbeat collects them: a pool
# whose last node froze is seen as empty, not waited on.
_CHANGES_LUA = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local marker = redis.call('GET', KEYS[3]) or ''
local mine = tonumber(ARGV[1])
if mine <= 0 or marker ~= ARGV[3] or v < mine or v - mine > tonumber(ARGV[2]) then return {v, marker, '*'} end
local out = {v, marker}
if v > mine then
  local items = redis.call('LRANGE', KEYS[2], 0, v - mine - 1)
  if #items ~= v - mine or tonumber(string.match(items[#items], '^(%d+)|')) ~= mine + 1 then
    return {v, marker, '*'}
  end
  for _, item in ipairs(items) do out[#out + 1] = string.match(item, '^%d+|(.*)$') end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. now, 'LIMIT', 0, tonumber(ARGV[4]))) do
  out[#out + 1] = dead
end
return out
"""


@dataclasses.dataclass(frozen=True)
class Location:
    """One copy of a key: which node and epoch wrote it, on which tier, how big, when."""

    node_id: str
    epoch: int
    tier: str
    nbytes: int
    checksum: int
    written_at: int = dataclasses.field(default_factory=lambda: int(time.time()), compare=False)

    def encode(self) -> str:
        return f"{self.epoch}|{self.tier}|{self.nbytes}|{self.checksum}|{self.written_at}"

    @classmethod
    def decode(cls, node_id: str, value: str) -> Location:
        try:
            epoch, tier, nbytes, item_sum, written_at = value.split("|")
            return cls(node_id, int(epoch), tier, int(nbytes), int(item_sum), int(written_at))
        except ValueError:
            raise MetadataError(f"index entry for node {node_id!r} is malformed: {value!r}") from None


IndexEntry = list[Location]


@dataclasses.dataclass(frozen=True)
class Beat:
    """What a heartbeat found: the namespace marker's generation (None if missing), and
    whether the node's registry entry had to be created (a live node collected it as dead)."""

    generation: str | None
    registered_anew: bool


@dataclasses.dataclass
class NodeInfo:
    """A pool node as the registry knows it."""

    node_id: str
    host: str
    port: int
    epoch: int
    cluster: str = ""
    hostname: str = ""
    pid: int = 0
    started_at: float = 0.0
    capacity_bytes: int = 0
    used_bytes: int = 0
    object_count: int = 0
    tiers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    heartbeat_at: float = 0.0
    shm_path: str = ""  # the node's shared-memory arena, readable by same-host clients
    shm_token: str = ""  # written in the arena's header: proves a client opened this node's file
    channel: str = ""  # channel transport this node serves ("nccl", "cpu"), empty if none
    tls: bool = False  # the node protocol is served over TLS only
    draining: bool = False  # filled by MetadataStore.nodes() from the draining set
    alive: bool = False  # filled by MetadataStore.nodes(), never stored

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)

    def view(self) -> tuple[Any, ...]:
        """What clients keep of this node; when it changes, the registry version is bumped.

        Load counts in tenths of capacity: clients weigh placement and pick replicas by
        it, and it moves on every put, far more often than it matters.
        """
        tenth = self.used_bytes * 10 // self.capacity_bytes if self.capacity_bytes else 0
        return (self.epoch, self.host, self.port, self.cluster, self.channel, self.tls, self.shm_path,
                self.shm_token, self.capacity_bytes, tenth)  # fmt: skip

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data.pop("alive")
        data.pop("draining")  # kept in the draining set, so heartbeats cannot undo a drain
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeInfo:
        try:
            data = json.loads(text)
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (ValueError, TypeError) as exc:
            raise MetadataError(f"registry entry is malformed: {exc}") from None


@contextlib.contextmanager
def _redis_errors(action: str) -> Iterator[None]:
    try:
        yield
    except (redis_exceptions.AuthenticationError, redis_exceptions.NoPermissionError) as exc:
        raise MetadataError(
            f"Redis {action} failed: Redis authentication refused ({exc}); check the ACL user and password "
            "(redis_user / redis_password in the pool URL, or the node's --redis URL and --redis-password-file)"
        ) from None
    except redis_exceptions.RedisError as exc:
        raise MetadataError(f"Redis {action} failed: {exc}") from None
    except OSError as exc:
        raise MetadataError(f"Redis {action} failed: {exc}") from None


@contextlib.asynccontextmanager
async def _bounded(action: str, timeout_s: float) -> AsyncIterator[None]:
    """Redis errors as MetadataError, and the whole call within ``timeout_s``.

    redis-py retries and, on a cluster, re-reads the topology; this deadline is what
    keeps a Redis that is down or failing over from costing a caller more than its
    timeout. redis-py drops a connection whose command was cancelled mid-reply.
    """
    try:
        async with asyncio.timeout(timeout_s):
            with _redis_errors(action):
                yield
    except TimeoutError:
        raise MetadataError(f"Redis {action} failed: no answer within {timeout_s * 1000:.0f} ms") from None


class MetadataStore:
    """Async access to one namespace's metadata in Redis (redis-py + hiredis)."""

    def __init__(
        self, redis_url: str, namespace: str, timeout_s: float = 2.0, *, password: str = "", ca_file: str = ""
    ) -> None:
        """``redis_url`` is ``redis://`` or ``rediss://`` (TLS, verified against ``ca_file`` or the system
        trust), optionally with an ACL user; ``password`` is used when the URL carries none."""
        self.namespace = namespace
        self.redis_url = redis_url
        self.target = RedisTarget.parse(redis_url)
        self.timeout_s = timeout_s
        # redis.asyncio Redis or RedisCluster
        self._redis: Any = connect(self.target, timeout_s, password=password, ca_file=ca_file)
        self._commit = self._redis.register_script(_COMMIT_LUA)
        self._remove = self._redis.register_script(_REMOVE_LUA)
        self._remove_exact = self._redis.register_script(_REMOVE_EXACT_LUA)
        self._move = self._redis.register_script(_MOVE_LUA)
        self._epoch_floor = self._redis.register_script(_EPOCH_FLOOR_LUA)
        self._beat = self._redis.register_script(_BEAT_LUA)
        self._change = self._redis.register_script(_CHANGE_LUA)
        self._changes = self._redis.register_script(_CHANGES_LUA)
        tag = "{" + namespace + "}"
        self.marker_key = f"kvp:{tag}:marker"
        self.epoch_key = f"kvp:{tag}:epoch"
        self.nodes_key = f"kvp:{tag}:nodes"
        self.draining_key = f"kvp:{tag}:draining"
        self.beats_key = f"kvp:{tag}:beats"
        self.version_key = f"kvp:{tag}:regv"
        self.changes_key = f"kvp:{tag}:regchanges"
        self._hb_prefix = f"kvp:{tag}:hb:"
        self._rendezvous_prefix = f"kvp:{tag}:rdv:"
        self._index_prefix = f"kvp:{namespace}:k:"
        self._shard_marker_prefix = f"kvp:{namespace}:m:"
        self._scripts = (self._commit, self._remove, self._remove_exact, self._move, self._epoch_floor, self._beat,
                         self._change, self._changes)  # fmt: skip

    @property
    def is_cluster(self) -> bool:
        return self.target.mode == CLUSTER

    def _call(self, action: str) -> contextlib.AbstractAsyncContextManager[None]:
        return _bounded(action, self.timeout_s)

    # -- keys -------------------------------------------------------------------------
    def index_key(self, key: str) -> str:
        return self._index_prefix + "{" + key + "}"

    def key_from_index(self, index_key: str) -> str:
        return index_key[len(self._index_prefix) + 1 : -1]

    def heartbeat_key(self, node_id: str) -> str:
        return self._hb_prefix + node_id

    # -- lifecycle --------------------------------------------------------------------
    async def close(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):  # a hung Redis must not hold up a shutdown
                await self._redis.aclose()

    async def ping(self) -> float:
        """Round-trip time to Redis in milliseconds."""
        start = time.perf_counter()
        async with self._call("PING"):
            await self._redis.ping()
        return (time.perf_counter() - start) * 1000

    # -- namespace and registry -------------------------------------------------------
    async def ensure_marker(self) -> str:
        """The namespace marker's generation, creating it if missing.

        A node publishes its inventory under a generation; a different or missing
        one later means Redis lost (or was flushed of) what it had published. On a
        cluster there is one marker per primary (see :meth:`marker_keys`), so a shard
        that restarts empty changes the generation even though the others kept theirs.
        """
        async with self._call("SET marker"):
            keys = await self.marker_keys()
            fresh = f"{time.time():.3f}-{uuid.uuid4().hex[:12]}"
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.set(key, fresh, nx=True)
                for key in keys:
                    pipe.get(key)
                results = await pipe.execute()
        return "/".join(str(value) for value in results[len(keys) :])

    async def marker_keys(self) -> list[str]:
        """The keys whose loss means the index was lost: one per shard.

        One Redis: the namespace marker. A cluster: the marker, and for every other
        primary a key whose hash tag falls in a slot that primary serves (the first
        ``NS.N`` that does, so every node of the pool picks the same keys).
        """
        if not self.is_cluster:
            return [self.marker_key]
        await self._redis.initialize()  # the slot map; a no-op once it is known
        keys = {self._redis.get_node_from_key(self.marker_key).name: self.marker_key}
        primaries = {node.name for node in self._redis.get_primaries()}
        for n in range(MARKER_TAG_SEARCH):
            if primaries <= keys.keys():
                break
            key = f"{self._shard_marker_prefix}{{{self.namespace}.{n}}}"
            keys.setdefault(self._redis.get_node_from_key(key).name, key)
        return sorted(keys.values())

    async def ensure_epoch_at_least(self, epoch: int) -> None:
        """Raise the epoch counter to ``epoch`` (after Redis lost it, epochs must keep growing)."""
        async with self._call("epoch floor"):
            await self._epoch_floor(keys=[self.epoch_key], args=[str(epoch)])

    async def new_epoch(self) -> int:
        async with self._call("INCR epoch"):
            return int(await self._redis.incr(self.epoch_key))

    async def heartbeat(self, info: NodeInfo, ttl_ms: int, changed: bool = False) -> Beat:
        """Publish ``info`` and refresh liveness; says whether the marker and the registry entry were there.

        ``changed``: what clients keep of this node changed (``NodeInfo.view``); they are
        told through the registry version, as they are of nodes that join, come back or die.
        """
        async with self._call("heartbeat"):
            markers = await self.marker_keys()
            try:
                results = await self._beat_pipeline(info, ttl_ms, changed, markers)
            except redis_exceptions.NoScriptError:
                await self._load_scripts()  # a cluster pipeline does not load scripts
                results = await self._beat_pipeline(info, ttl_ms, changed, markers)
        generations = results[3:]
        generation = None if None in generations else "/".join(str(value) for value in generations)
        # HSET answers 1 for a field it created: the entry was missing (first beat, or collected as dead)
        return Beat(generation, registered_anew=int(results[0]) == 1)

    async def _beat_pipeline(self, info: NodeInfo, ttl_ms: int, changed: bool, markers: list[str]) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.nodes_key, info.node_id, info.to_json())
            pipe.set(self.heartbeat_key(info.node_id), str(info.epoch), px=ttl_ms)
            await self._beat(keys=[self.beats_key, self.version_key, self.changes_key],
                             args=[info.node_id, ttl_ms, int(changed), REGISTRY_LOG_MAX, DEAD_PER_BEAT],
                             client=pipe)  # fmt: skip
            for key in markers:
                pipe.get(key)
            return list(await pipe.execute())

    async def _log_change(self, node_id: str) -> None:
        await self._change(keys=[self.version_key, self.changes_key], args=[node_id, REGISTRY_LOG_MAX])

    async def registry_changes(self, since: int, marker: str) -> tuple[int, str, list[str] | None]:
        """The registry version and namespace marker now, and the nodes changed since version ``since``
        under ``marker`` (None: the change log cannot tell, read the whole registry)."""
        async with self._call("registry version"):
            answer = await self._changes(keys=[self.version_key, self.changes_key, self.marker_key, self.beats_key],
                                         args=[since, REGISTRY_LOG_MAX, marker, DEAD_PER_BEAT])  # fmt: skip
        version, now_marker, changed = int(answer[0]), str(answer[1]), [str(node) for node in answer[2:]]
        return version, now_marker, None if changed == ["*"] else list(dict.fromkeys(changed))

    async def deregister(self, node_id: str) -> None:
        async with self._call("deregister"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hdel(self.nodes_key, node_id)
                pipe.delete(self.heartbeat_key(node_id))
                pipe.zrem(self.beats_key, node_id)
                await pipe.execute()
            await self._log_change(node_id)

    async def set_draining(self, node_id: str, draining: bool) -> None:
        """Mark a node draining (placement skips it) or not; kept apart from its heartbeats."""
        async with self._call("HEXISTS node"):
            known = await self._redis.hexists(self.nodes_key, node_id)
        if not known:
            raise MetadataError(f"node {node_id!r} is not registered in namespace {self.namespace!r}")
        async with self._call("draining set"):
            if draining:
                await self._redis.sadd(self.draining_key, node_id)
            else:
                await self._redis.srem(self.draining_key, node_id)
            await self._log_change(node_id)

    async def forget_node(self, node_id: str) -> None:
        """Remove a dead node from the registry (``kvpool check --fix``)."""
        async with self._call("forget node"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hdel(self.nodes_key, node_id)
                pipe.delete(self.heartbeat_key(node_id))
                pipe.srem(self.draining_key, node_id)
                pipe.zrem(self.beats_key, node_id)
                await pipe.execute()
            await self._log_change(node_id)

    async def nodes(self, only: Sequence[str] | None = None) -> list[NodeInfo]:
        """Every registered node (or those of ``only``), with ``alive`` set from its heartbeat key."""
        if only is not None:
            if not only:
                return []
            async with self._call("HMGET nodes"):
                texts = await self._redis.hmget(self.nodes_key, list(only))
            raw = {node_id: text for node_id, text in zip(only, texts) if text is not None}
        else:
            async with self._call("HGETALL nodes"):
                raw = await self._redis.hgetall(self.nodes_key)
        infos = [NodeInfo.from_json(text) for text in raw.values()]
        if not infos:
            return []
        async with self._call("MGET heartbeats"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.smembers(self.draining_key)
                for info in infos:
                    pipe.get(self.heartbeat_key(info.node_id))
                draining, *beats = await pipe.execute()
        for info, beat in zip(infos, beats):
            info.alive = beat is not None and beat == str(info.epoch)
            info.draining = info.node_id in draining
        return sorted(infos, key=lambda i: i.node_id)

    # -- index ------------------------------------------------------------------------
    async def _run_per_key(self, action: str, script: Any, calls: Sequence[tuple[str, list[str]]]) -> None:
        """Run a one-key Lua script for each ``(key, args)``, pipelined in batches.

        One script per key keeps every call inside one Redis Cluster slot. Each batch
        has its own deadline, so publishing a large inventory is not cut short.
        """
        for start in range(0, len(calls), LOOKUP_BATCH):
            batch = calls[start : start + LOOKUP_BATCH]
            async with self._call(action):
                try:
                    await self._run_batch(script, batch)
                except redis_exceptions.NoScriptError:
                    # A cluster pipeline does not load scripts (a single-server one does):
                    # load them on every primary and run the batch again. Every script
                    # is idempotent, so the calls that already ran may run twice.
                    await self._load_scripts()
                    await self._run_batch(script, batch)

    async def _run_batch(self, script: Any, batch: Sequence[tuple[str, list[str]]]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key, args in batch:
                await script(keys=[self.index_key(key)], args=args, client=pipe)
            await pipe.execute()

    async def _load_scripts(self) -> None:
        """SCRIPT LOAD every script (on a cluster redis-py sends it to every primary)."""
        for script in self._scripts:
            await self._redis.script_load(script.script)

    async def commit(self, locations: Sequence[tuple[str, Location]]) -> None:
        """Make ``(key, location)`` pairs visible, in one pipelined round trip per batch."""
        calls = [(key, [loc.node_id, loc.encode(), str(loc.checksum)]) for key, loc in locations]
        await self._run_per_key("index commit", self._commit, calls)

    async def remove(self, node_id: str, epoch: int, keys: Sequence[str]) -> None:
        """Drop this node epoch's locations for ``keys`` (eviction, delete, shutdown)."""
        await self._run_per_key("index remove", self._remove, [(key, [node_id, str(epoch)]) for key in keys])

    async def move(self, locations: Sequence[tuple[str, Location]]) -> None:
        """Record that keys moved tier on their node (same node and epoch)."""
        calls = [(key, [loc.node_id, str(loc.epoch), loc.encode()]) for key, loc in locations]
        await self._run_per_key("index move", self._move, calls)

    async def remove_stale(self, stale: Sequence[tuple[str, Location]]) -> None:
        """Drop locations a reader found stale, unless they changed since it looked."""
        calls = [(key, [loc.node_id, loc.encode()]) for key, loc in stale]
        await self._run_per_key("stale cleanup", self._remove_exact, calls)

    async def lookup(self, keys: Sequence[str]) -> list[IndexEntry]:
        """Every recorded location of every key, in one pipelined round trip."""
        if not keys:
            return []
        async with self._call("index lookup"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(self.index_key(key))
                raw: list[dict[str, str]] = await pipe.execute()
        entries: list[IndexEntry] = []
        for fields in raw:
            entry: IndexEntry = []
            for node_id, value in fields.items():
                try:
                    entry.append(Location.decode(node_id, value))
                except MetadataError as exc:
                    logger.warning("ignoring %s", exc)
            entries.append(entry)
        return entries

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove index entries outright; returns how many existed."""
        if not keys:
            return 0
        async with self._call("index delete"):
            return int(await self._redis.delete(*[self.index_key(k) for k in keys]))

    async def scan_entries(
        self, match: str = "*", batch: int = LOOKUP_BATCH
    ) -> AsyncIterator[list[tuple[str, IndexEntry]]]:
        """Stream ``(key, locations)`` in batches: SCAN plus one pipelined lookup per batch."""
        async for keys in self.scan_key_batches(match, batch):
            yield list(zip(keys, await self.lookup(keys)))

    async def scan_key_batches(self, match: str = "*", batch: int = LOOKUP_BATCH) -> AsyncIterator[list[str]]:
        """Stream pool keys (SCAN) in lists of at most ``batch``."""
        keys: list[str] = []
        async for key in self.scan_keys(match, count=batch):
            keys.append(key)
            if len(keys) >= batch:
                yield keys
                keys = []
        if keys:
            yield keys

    async def scan_keys(self, match: str = "*", count: int = 1000) -> AsyncIterator[str]:
        """Stream pool keys (SCAN, never KEYS). ``match`` is a glob on the pool key.

        Each SCAN step has its own deadline (``timeout_s``), so a hung Redis ends the
        stream with MetadataError while a long walk over a large index still finishes.
        """
        cursor = 0
        while True:
            cursor, keys = await self.scan_step(cursor, match, count)
            for key in keys:
                yield key
            if cursor == 0:
                return

    async def scan_step(self, cursor: int, match: str = "*", count: int = 1000) -> tuple[int, list[str]]:
        """One SCAN step over pool keys: ``(next cursor, keys)``; the cursor is 0 at the start and the end.

        On a cluster the cursor also says which primary is being walked: the primary's
        place in name order times 2**64, plus that primary's own SCAN cursor.
        """
        next_cursor, names = await self._scan_step(cursor, self._index_prefix + "{" + match + "}", count)
        return next_cursor, [self.key_from_index(name) for name in names]

    async def _scan_step(self, cursor: int, pattern: str, count: int) -> tuple[int, list[str]]:
        """One bounded SCAN step over raw Redis key names matching ``pattern`` (see :meth:`scan_step`)."""
        async with self._call("SCAN"):
            if not self.is_cluster:
                next_cursor, names = await self._redis.scan(cursor, match=pattern, count=count)
                return int(next_cursor), list(names)
            await self._redis.initialize()  # the slot map; a no-op once it is known
            primaries = sorted(self._redis.get_primaries(), key=lambda node: node.name)
            place, node_cursor = divmod(cursor, 1 << 64)
            if place >= len(primaries):
                raise MetadataError(f"SCAN cursor {cursor} names primary {place}; the cluster has {len(primaries)}")
            node = primaries[place]
            cursors, names = await self._redis.scan(node_cursor, match=pattern, count=count, target_nodes=node)
            node_next = int(cursors[node.name])
            if node_next == 0:
                place, node_next = place + 1, 0
                if place == len(primaries):
                    return 0, list(names)
            return (place << 64) + node_next, list(names)

    async def flush_namespace(self) -> int:
        """Delete every key of this namespace; returns how many were removed. Each step is bounded."""
        removed = 0
        tag = "{" + self.namespace + "}"
        for pattern in (self._index_prefix + "*", self._shard_marker_prefix + "*", f"kvp:{tag}:*"):
            cursor = 0
            while True:
                cursor, names = await self._scan_step(cursor, pattern, LOOKUP_BATCH)
                if names:
                    async with self._call("flush"):
                        removed += int(await self._redis.delete(*names))
                if cursor == 0:
                    break
        return removed

    # -- channel rendezvous -----------------------------------------------------------
    def rendezvous_key(self, session: str) -> str:
        return self._rendezvous_prefix + session

    async def offer_rendezvous(self, session: str, value: str, ttl_ms: int) -> None:
        """Publish a channel rendezvous offer that expires after ``ttl_ms``."""
        async with self._call("rendezvous offer"):
            await self._redis.set(self.rendezvous_key(session), value, px=ttl_ms)

    async def take_rendezvous(self, session: str) -> str | None:
        """Read and delete an offer (one peer joins it once); None if missing or expired."""
        async with self._call("rendezvous take"):
            value = await self._redis.getdel(self.rendezvous_key(session))
        return None if value is None else str(value)

    async def raw(self) -> Any:
        """The underlying redis-py client (tests and the CLI's inspection verbs)."""
        return self._redis
