"""LiveLookup: the index read every request pays, done where the index is (one Lua call).

A client hands Redis its live view (node id -> epoch, sent as each node's slot and its
epoch as a varint: ``records.NodeSlots``) with the keys; the script
(``scripts.LIVE_LOOKUP_LUA``) reads each key's hash, keeps the copies on a live node
epoch, and for a hit prefix stops at the first key with none. What comes back is one
flag per key examined, the live copies only when the caller reads them next, and the
copies outside the view (for cleanup, or for a view that missed a node's restart).

One Redis or a Sentinel-managed master: one EVALSHA, one round trip (a lookup of more
than ``LOOKUP_BATCH`` keys is several calls in one pipeline, so no call holds Redis
long). A Redis Cluster: every index key has its own hash tag, so the keys are grouped
by the primary that serves them and each group is one call to that primary
(``allow-cross-slot-keys`` lets it read several slots there); the groups run at once,
each examines its own keys in order, and the answers combine: a prefix ends at the
first key any group found missing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from redis import exceptions as redis_exceptions

from backend.errors import MetadataError
from backend.metadata.connection import RedisConnection
from backend.metadata.records import IndexEntry, LiveCopies, Location, NodeSlots, varint
from backend.metadata.scripts import LIVE_LOOKUP_LUA, LOOKUP_BATCH

__all__ = ["LiveLookup"]

logger = logging.getLogger("backend.metadata")

_Reply = list[Any]  # [hit flags, live copies, other copies], as the script returns them
_Part = tuple[list[int], Any]  # key positions, in order, and the cluster node they go to (None: one Redis)


class LiveLookup:
    """Which keys have a live copy, read in Redis against the caller's view (see the module docstring)."""

    def __init__(self, conn: RedisConnection) -> None:
        self._conn = conn
        self._redis = conn.redis
        self._call = conn.call
        # Not among the scripts a lost one reloads (RedisConnection.load_scripts): redis-py reloads
        # it on a single call, and a call in parts loads it itself.
        self._live_lookup = conn.redis.register_script(LIVE_LOOKUP_LUA)

    async def lookup_live(
        self, keys: Sequence[str], live: Mapping[str, int], *, prefix: bool, copies: bool
    ) -> LiveCopies:
        """Read ``keys`` against ``live`` (node id -> epoch) in one round trip (one per primary on a cluster).

        ``prefix``: stop after the first key with no live copy. ``copies``: also return the
        live copies (what a get reads next); otherwise only which keys hit.
        """
        if not keys:
            return LiveCopies([], [], [])
        # As bytes: redis-py then packs a thousand keys without encoding each one again.
        prefix_bytes = self._conn.index_prefix.encode()
        names = [prefix_bytes + key.encode() for key in keys]
        if any(self._conn.slots.slot_of(node_id) is None for node_id in live):
            await self._conn.learn_slots(list(live))  # a view read through this store knows them all already
        view: list[str | bytes] = []
        for node_id, epoch in live.items():
            slot = self._conn.slots.slot_of(node_id)
            if slot is not None:  # an id that holds no slot (a node of the release before) has no field
                view += [str(slot), varint(epoch)]
        args: list[str | bytes] = ["1" if prefix else "0", "1" if copies else "0", str(len(view) // 2), *view]
        async with self._call("index lookup"):
            parts = await self._parts(names)
            replies = await self._run_parts(parts, names, args)
        return _combine(len(keys), parts, replies, prefix, copies, self._conn.slots)

    async def _parts(self, names: list[bytes]) -> list[_Part]:
        """Split the keys into calls: batches of ``LOOKUP_BATCH``, per cluster primary on a cluster."""
        if not self._conn.is_cluster:
            return [
                (list(range(i, min(i + LOOKUP_BATCH, len(names)))), None) for i in range(0, len(names), LOOKUP_BATCH)
            ]
        await self._redis.initialize()  # the slot map; a no-op once it is known
        groups: dict[str, tuple[list[int], Any]] = {}
        for position, name in enumerate(names):
            node = self._redis.get_node_from_key(name)
            groups.setdefault(node.name, ([], node))[0].append(position)
        return [
            (positions[i : i + LOOKUP_BATCH], node)
            for positions, node in groups.values()
            for i in range(0, len(positions), LOOKUP_BATCH)
        ]

    async def _run_parts(self, parts: list[_Part], names: list[bytes], args: list[str | bytes]) -> list[_Reply]:
        script = self._live_lookup
        if (
            not self._conn.is_cluster and len(parts) == 1
        ):  # the usual lookup: one EVALSHA (redis-py reloads a lost script)
            return [await script(keys=names, args=args)]
        try:
            return await self._send_parts(parts, names, args)
        except redis_exceptions.NoScriptError:
            await self._redis.script_load(LIVE_LOOKUP_LUA)  # on every primary of a cluster
            return await self._send_parts(parts, names, args)

    async def _send_parts(self, parts: list[_Part], names: list[bytes], args: list[str | bytes]) -> list[_Reply]:
        sha = self._live_lookup.sha
        if not self._conn.is_cluster:  # several batches: one pipeline, one round trip
            async with self._redis.pipeline(transaction=False) as pipe:
                for positions, _ in parts:
                    pipe.evalsha(sha, len(positions), *[names[i] for i in positions], *args)
                return list(await pipe.execute())
        calls = [self._evalsha_on(node, sha, [names[i] for i in positions], args) for positions, node in parts]
        return list(await asyncio.gather(*calls))

    async def _evalsha_on(self, node: Any, sha: str, names: list[bytes], args: list[str | bytes]) -> _Reply:
        """One call on one cluster primary: its keys are all served there, whatever their slots.

        Redis refuses declared keys of several slots even under ``allow-cross-slot-keys``
        (that flag covers the keys a script reads, not those it declares), so the first key
        is declared and the others follow the arguments.
        """
        reply = await self._redis.execute_command("EVALSHA", sha, 1, names[0], *args, *names[1:], target_nodes=node)
        return list(reply)


def _combine(
    count: int, parts: list[_Part], replies: list[_Reply], prefix: bool, copies: bool, slots: NodeSlots
) -> LiveCopies:
    """One answer from the calls' answers; a prefix ends at the first key any call found missing.

    Every key before that one was examined by its own call: each call stops only at its own
    first miss, which cannot come earlier.
    """
    if len(parts) == 1:  # one call over every key, in order
        hits = [flag == "1" for flag in replies[0][0]]
    else:
        seen: list[bool | None] = [None] * count
        for (positions, _), (flags, _, _) in zip(parts, replies):
            for position, flag in zip(positions, flags):
                seen[position] = flag == "1"
        end = next((i + 1 for i, hit in enumerate(seen) if hit is not True), count) if prefix else count
        hits = [bool(hit) for hit in seen[:end]]
    found: list[IndexEntry] = [[] for _ in hits]
    others: list[tuple[int, Location]] = []
    for (positions, _), (_, live_raw, other_raw) in zip(parts, replies):
        if copies:
            for position, loc in _decode(live_raw, positions, slots):
                if position < len(hits):
                    found[position].append(loc)
        others += [(position, loc) for position, loc in _decode(other_raw, positions, slots) if position < len(hits)]
    return LiveCopies(hits, found, others)


def _decode(flat: list[Any], positions: list[int], slots: NodeSlots) -> list[tuple[int, Location]]:
    """``{k, slot, value, ...}`` (k counts a call's keys from 1) as ``(key position, copy)``; a slot no
    node id this reader knows holds reads as node ``#<slot>`` (``Location.attributed`` is False)."""
    out = []
    for i in range(0, len(flat), 3):
        field = str(flat[i + 1])
        try:
            if not field.isdigit():
                raise MetadataError(f"index field {field!r} is not a node slot")
            slot = int(field)
            out.append((positions[int(flat[i]) - 1], Location.decode(slots.node_of(slot), flat[i + 2], slot)))
        except MetadataError as exc:
            logger.warning("ignoring %s", exc)
    return out
