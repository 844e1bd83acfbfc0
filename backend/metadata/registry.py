"""NodeRegistry: the namespace marker, epochs, node id claims, heartbeats and the registry's change log.

A node id is held by one process at a time: its heartbeat key holds the epoch of the run
that claimed it (epochs are unique: one ``INCR`` per start), and only that run renews it
(``CLAIM_LUA``, ``BEAT_LUA``: compare and set in one script). Another process may take the
id only once that key expired: its holder stopped beating for a whole TTL.

The claim also gives the id its *slot*, the number its index fields go under
(``records.NodeSlots``): the id keeps it across restarts, until it is forgotten.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from redis import exceptions as redis_exceptions

from backend.errors import MetadataError
from backend.metadata.connection import (
    NODES_KEY_PATTERN,
    RedisConnection,
    heartbeat_prefix_of,
    namespace_of_nodes_key,
    nodes_key_of,
)
from backend.metadata.records import Beat, ClaimHeld, ClaimHolder, LiveNamespaces, NodeInfo
from backend.metadata.scripts import (
    BEAT_LUA,
    CHANGE_LUA,
    CHANGES_LUA,
    CLAIM_LUA,
    DEAD_PER_BEAT,
    DEREGISTER_LUA,
    EPOCH_FLOOR_LUA,
    FORGET_LUA,
    FORGET_SLOT_LUA,
    MARKER_TAG_SEARCH,
    REGISTRY_LOG_MAX,
    SCAN_PAGE,
)

__all__ = ["NAMESPACE_SEARCH_S", "NodeRegistry"]


# How long a search for the namespaces that have live nodes may walk Redis's keys: a few thousand
# SCAN pages, so an index of millions of keys is walked in part and the answer says so.
NAMESPACE_SEARCH_S = 2.0


class NodeRegistry:
    """Which nodes exist, which are alive, and what changed since a client last looked."""

    def __init__(self, conn: RedisConnection) -> None:
        self._conn = conn
        self._redis = conn.redis
        self._call = conn.call
        self._epoch_floor = conn.script(EPOCH_FLOOR_LUA)
        self._beat = conn.script(BEAT_LUA)
        self._claim = conn.script(CLAIM_LUA)
        self._deregister = conn.script(DEREGISTER_LUA)
        self._change = conn.script(CHANGE_LUA)
        self._changes = conn.script(CHANGES_LUA)
        self._forget = conn.script(FORGET_LUA)
        self._forget_slot = conn.script(FORGET_SLOT_LUA)

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
        if not self._conn.is_cluster:
            return [self._conn.marker_key]
        await self._redis.initialize()  # the slot map; a no-op once it is known
        keys = {self._redis.get_node_from_key(self._conn.marker_key).name: self._conn.marker_key}
        primaries = {node.name for node in self._redis.get_primaries()}
        for n in range(MARKER_TAG_SEARCH):
            if primaries <= keys.keys():
                break
            key = f"{self._conn.shard_marker_prefix}{{{self._conn.namespace}.{n}}}"
            keys.setdefault(self._redis.get_node_from_key(key).name, key)
        return sorted(keys.values())

    async def ensure_epoch_at_least(self, epoch: int) -> None:
        """Raise the epoch counter to ``epoch`` (after Redis lost it, epochs must keep growing)."""
        async with self._call("epoch floor"):
            await self._epoch_floor(keys=[self._conn.epoch_key], args=[str(epoch)])

    async def new_epoch(self) -> int:
        async with self._call("INCR epoch"):
            return int(await self._redis.incr(self._conn.epoch_key))

    async def claim(self, node_id: str, holder: ClaimHolder, ttl_ms: int) -> ClaimHeld | None:
        """Take ``node_id`` for ``holder.epoch`` (or renew it) for ``ttl_ms``; None when it is this epoch's now.

        Held by another epoch whose heartbeat has not expired: nothing is written, and the
        answer says who holds it and how long its heartbeat has left (a renewal makes that
        grow: ``backend.node.index.claim`` watches it to tell a live holder from a crashed one).
        """
        keys = [
            self._conn.heartbeat_key(node_id),
            self._conn.holder_key(node_id),
            self._conn.slots_key,
            self._conn.slot_counter_key,
        ]
        async with self._call("node id claim"):
            answer = await self._claim(keys=keys, args=[str(holder.epoch), ttl_ms, holder.to_json(), node_id])
        if int(answer[0]) == 1:
            self._conn.slots.learn(node_id, int(answer[1]))
            return None
        epoch = int(answer[1])
        return ClaimHeld(ClaimHolder.from_json(epoch, str(answer[3])), ttl_left_ms=int(answer[2]))

    async def heartbeat(
        self, info: NodeInfo, ttl_ms: int, changed: bool = False, holder: ClaimHolder | None = None
    ) -> Beat:
        """Publish ``info`` and renew this node's claim on its id; says whether the marker and the registry
        entry were there, or that another process holds the id now (then nothing was written).

        ``changed``: what clients keep of this node changed (``NodeInfo.view``); they are
        told through the registry version, as they are of nodes that join, come back or die.
        ``holder``: what the claim says of this node (its epoch, address, pid).
        """
        holder = holder or ClaimHolder(info.epoch, info.host, info.port, info.pid, info.hostname)
        async with self._call("heartbeat"):
            markers = await self.marker_keys()
            try:
                results = await self._beat_pipeline(info, ttl_ms, changed, holder, markers)
            except redis_exceptions.NoScriptError:
                await self._conn.load_scripts()  # Redis lost the script (restarted, flushed)
                results = await self._beat_pipeline(info, ttl_ms, changed, holder, markers)
        beat, generations = results[0], results[1:]
        generation = None if None in generations else "/".join(str(value) for value in generations)
        if int(beat[0]) == -1:
            return Beat(generation, False, lost_to=ClaimHolder.from_json(int(beat[1]), str(beat[2])))
        self._conn.slots.learn(info.node_id, int(beat[2]))
        # HSET answers 1 for a field it created: the entry was missing (first beat, or collected as dead).
        # A slot given now: Redis had lost the id's, and what the node published names another.
        return Beat(generation, registered_anew=int(beat[0]) == 1 or int(beat[3]) == 1)

    async def _beat_pipeline(
        self, info: NodeInfo, ttl_ms: int, changed: bool, holder: ClaimHolder, markers: list[str]
    ) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            # Every write of the beat in one script (allow-oom: it lands on a full Redis too). EVALSHA
            # straight into the pipeline, as the index does (a Script object there makes redis-py send
            # SCRIPT EXISTS first: one more round trip per beat); a lost script is loaded and the beat
            # run again, which only logs its changes twice.
            keys = [
                self._conn.heartbeat_key(info.node_id),
                self._conn.holder_key(info.node_id),
                self._conn.nodes_key,
                self._conn.beats_key,
                self._conn.version_key,
                self._conn.changes_key,
                self._conn.slots_key,
                self._conn.slot_counter_key,
            ]
            args = [info.node_id, info.epoch, ttl_ms, int(changed), REGISTRY_LOG_MAX, DEAD_PER_BEAT]
            pipe.evalsha(self._beat.sha, len(keys), *keys, *args, info.to_json(), holder.to_json())
            for key in markers:
                pipe.get(key)
            return list(await pipe.execute())

    async def _log_change(self, node_id: str) -> None:
        await self._change(keys=[self._conn.version_key, self._conn.changes_key], args=[node_id, REGISTRY_LOG_MAX])

    async def registry_changes(self, since: int, marker: str) -> tuple[int, str, list[str] | None]:
        """The registry version and namespace marker now, and the nodes changed since version ``since``
        under ``marker`` (None: the change log cannot tell, read the whole registry)."""
        async with self._call("registry version"):
            answer = await self._changes(
                keys=[self._conn.version_key, self._conn.changes_key, self._conn.marker_key, self._conn.beats_key],
                args=[since, REGISTRY_LOG_MAX, marker, DEAD_PER_BEAT],
            )
        version, now_marker, changed = int(answer[0]), str(answer[1]), [str(node) for node in answer[2:]]
        return version, now_marker, None if changed == ["*"] else list(dict.fromkeys(changed))

    async def deregister(self, node_id: str, epoch: int | None = None) -> bool:
        """Remove a node that stops cleanly; a drain of it ends with it (the flag does not outlive the node).

        With ``epoch``, only while the id's claim is still that epoch's (or nobody's): a node
        whose id another process took meanwhile leaves that process's entries alone.
        Returns whether the node was removed.
        """
        keys = [self._conn.heartbeat_key(node_id), self._conn.holder_key(node_id)]
        keys += [self._conn.nodes_key, self._conn.draining_key, self._conn.beats_key, self._conn.held_key(node_id)]
        async with self._call("deregister"):
            left = await self._deregister(keys=keys, args=[node_id, "" if epoch is None else str(epoch)])
            if int(left):
                await self._log_change(node_id)
        return bool(int(left))

    async def set_draining(self, node_id: str, draining: bool) -> bool:
        """Mark a node draining (placement skips it) or not; kept apart from its heartbeats.

        Returns whether the mark changed. Marking needs a registered node; clearing also
        takes the id of a node no longer registered, so a stale mark can always be removed.
        """
        async with self._call("draining set"):
            known = await self._redis.hexists(self._conn.nodes_key, node_id)
            if draining and not known:
                raise MetadataError(f"node {node_id!r} is not registered in namespace {self._conn.namespace!r}")
            if draining:
                changed = await self._redis.sadd(self._conn.draining_key, node_id)
            else:
                changed = await self._redis.srem(self._conn.draining_key, node_id)
            if not known and not changed:
                raise MetadataError(f"node {node_id!r} is not registered in namespace {self._conn.namespace!r}")
            if changed:
                await self._log_change(node_id)
        return bool(changed)

    async def forget_node(self, node_id: str) -> None:
        """Remove a dead node from the registry (``kvpool check --fix``, the dead-node reaper), and its slot.

        Its heartbeat key is left to expire: a run that claimed the id since (its beat not yet
        in the registry) keeps its claim, and its slot.
        """
        keys = [
            self._conn.nodes_key,
            self._conn.draining_key,
            self._conn.beats_key,
            self._conn.slots_key,
            self._conn.heartbeat_key(node_id),
        ]
        async with self._call("forget node"):
            await self._forget(keys=keys, args=[node_id])
            await self._log_change(node_id)

    async def forget_slot(self, node_id: str) -> None:
        """Take the slot back from a node id the registry no longer lists (it stopped cleanly and has not
        come back), unless a run claimed the id since. Its fields left in the index then name no id."""
        async with self._call("forget slot"):
            await self._forget_slot(
                keys=[self._conn.nodes_key, self._conn.slots_key, self._conn.heartbeat_key(node_id)], args=[node_id]
            )

    async def nodes(self, only: Sequence[str] | None = None) -> list[NodeInfo]:
        """Every registered node (or those of ``only``), with ``alive`` set from its heartbeat key."""
        if only is not None:
            if not only:
                return []
            async with self._call("HMGET nodes"):
                texts = await self._redis.hmget(self._conn.nodes_key, list(only))
            raw = {node_id: text for node_id, text in zip(only, texts) if text is not None}
        else:
            async with self._call("HGETALL nodes"):
                raw = await self._redis.hgetall(self._conn.nodes_key)
        infos = [NodeInfo.from_json(text) for text in raw.values()]
        if not infos:
            return []
        async with self._call("MGET heartbeats"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.smembers(self._conn.draining_key)
                pipe.hmget(self._conn.slots_key, [info.node_id for info in infos])
                for info in infos:
                    pipe.get(self._conn.heartbeat_key(info.node_id))
                draining, slots, *beats = await pipe.execute()
        for info, slot, beat in zip(infos, slots, beats):
            info.alive = beat is not None and beat == str(info.epoch)
            info.draining = info.node_id in draining
            if slot is not None and str(slot).isdigit():
                info.slot = int(slot)
                self._conn.slots.learn(info.node_id, info.slot)
        return sorted(infos, key=lambda i: i.node_id)

    async def live_namespaces(self, budget_s: float = NAMESPACE_SEARCH_S) -> LiveNamespaces:
        """Every namespace of this Redis that has live nodes (this one too), with how many.

        The registries are found by SCAN (``kvp:{NS}:nodes``; there is no list of namespaces),
        for at most ``budget_s``; then each one's heartbeats are read, as :meth:`nodes` does.
        """
        deadline = time.monotonic() + budget_s
        found: set[str] = set()
        cursor, complete = 0, True
        while True:
            cursor, names = await self._conn.scan_names(cursor, NODES_KEY_PATTERN, SCAN_PAGE)
            found.update(ns for ns in map(namespace_of_nodes_key, names) if ns is not None)
            if cursor == 0:
                break
            if time.monotonic() > deadline:
                complete = False
                break
        live = {}
        for namespace in sorted(found):
            count = await self._live_count(namespace)
            if count:
                live[namespace] = count
        return LiveNamespaces(live, complete)

    async def _live_count(self, namespace: str) -> int:
        """How many of ``namespace``'s registered nodes are alive: their heartbeat holds their epoch."""
        async with self._call("HGETALL nodes"):
            raw = await self._redis.hgetall(nodes_key_of(namespace))
        infos = [NodeInfo.from_json(text) for text in raw.values()]
        if not infos:
            return 0
        prefix = heartbeat_prefix_of(namespace)
        async with self._call("MGET heartbeats"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for info in infos:
                    pipe.get(prefix + info.node_id)
                beats = await pipe.execute()
        return sum(1 for info, beat in zip(infos, beats) if beat is not None and beat == str(info.epoch))
