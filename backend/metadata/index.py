"""KeyIndex: which node holds which key, on which tier; commits, removals, walks and sweeps."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any

from redis import exceptions as redis_exceptions

from backend.errors import MetadataError
from backend.metadata.connection import RedisConnection
from backend.metadata.records import IndexEntry, Location, SweepPage, varint
from backend.metadata.scripts import (
    COMMIT_LUA,
    LOOKUP_BATCH,
    MOVE_LUA,
    REMOVE_EXACT_LUA,
    REMOVE_LUA,
    SCAN_PAGE,
    SWEEP_LUA,
    SWEEP_PAGE,
)

__all__ = ["KeyIndex"]

logger = logging.getLogger("backend.metadata")

SLOT_REREAD_S = 1.0  # a reader meeting slots it does not know re-reads the slots hash at most this often

_Call = tuple[str, list[str | bytes]]  # an index key and a one-key script's arguments


class KeyIndex:
    """The index: ``kvp:NS/<key>`` hashes of node slot -> location, one per pool key (``scripts.py``)."""

    def __init__(self, conn: RedisConnection) -> None:
        self._conn = conn
        self._redis = conn.redis
        self._call = conn.call
        self._commit = conn.script(COMMIT_LUA)
        self._remove = conn.script(REMOVE_LUA)
        self._remove_exact = conn.script(REMOVE_EXACT_LUA)
        self._move = conn.script(MOVE_LUA)
        self._sweep = conn.script(SWEEP_LUA)
        self._slots_read_at = 0.0

    async def _run_per_key(
        self, action: str, script: Any, calls: Sequence[_Call], timeout_s: float | None = None
    ) -> None:
        """Run a one-key Lua script for each ``(key, args)``, pipelined in batches.

        One script per key keeps every call inside one Redis Cluster slot. Each batch
        has its own deadline (``timeout_s``, else Redis's timeout), so publishing a large
        inventory is not cut short.
        """
        for start in range(0, len(calls), LOOKUP_BATCH):
            batch = calls[start : start + LOOKUP_BATCH]
            async with self._call(action, timeout_s):
                try:
                    await self._run_batch(script, batch)
                except redis_exceptions.NoScriptError:
                    # Redis lost the script (restarted, flushed): load it on every primary
                    # and run the batch again. Every script is idempotent, so the calls that
                    # already ran may run twice.
                    await self._conn.load_scripts()
                    await self._run_batch(script, batch)

    async def _run_batch(self, script: Any, batch: Sequence[_Call]) -> None:
        # EVALSHA straight into the pipeline: a Script object on a pipeline makes redis-py send
        # SCRIPT EXISTS first, one more round trip before every commit (and so before every put's ack).
        async with self._redis.pipeline(transaction=False) as pipe:
            for key, args in batch:
                pipe.evalsha(script.sha, 1, self._conn.index_key(key), *args)
            await pipe.execute()

    async def _slots_for(self, locations: Sequence[tuple[str, Location]]) -> list[tuple[str, Location, int]]:
        """Each ``(key, location)`` with its field (slot); those whose node id holds no slot are left out."""
        await self._conn.learn_slots([loc.node_id for _, loc in locations if not loc.slot])
        out = []
        for key, loc in locations:
            slot = self._conn.slots.slot_for(loc)
            if slot is not None:
                out.append((key, loc, slot))
        return out

    async def commit(self, locations: Sequence[tuple[str, Location]], timeout_s: float | None = None) -> None:
        """Make ``(key, location)`` pairs visible, in one pipelined round trip per batch.

        ``timeout_s``: how long each batch may wait for Redis, when less than its timeout (a
        put's commit answers its client before the client gives up on the node).
        """
        if not locations:
            return
        ids = [loc.node_id for _, loc in locations if not loc.slot]
        if any(self._conn.slots.slot_of(node_id) is None for node_id in ids):
            await self._conn.give_slots(ids)  # a node's own id holds one from its claim on: not on a put's path
        calls: list[_Call] = [(key, [str(slot), loc.encode()]) for key, loc, slot in await self._slots_for(locations)]
        await self._run_per_key("index commit", self._commit, calls, timeout_s)

    async def remove(self, node_id: str, epoch: int, keys: Sequence[str]) -> None:
        """Drop this node epoch's locations for ``keys`` (eviction, delete, shutdown)."""
        if not keys:
            return
        await self._conn.learn_slots([node_id])
        slot = self._conn.slots.slot_of(node_id)
        if slot is None:
            return  # an id that holds no slot has no field anywhere
        args: list[str | bytes] = [str(slot), varint(epoch)]
        calls: list[_Call] = [(key, args) for key in keys]
        await self._run_per_key("index remove", self._remove, calls)

    async def move(self, locations: Sequence[tuple[str, Location]]) -> None:
        """Record that keys moved tier on their node (same node and epoch)."""
        calls: list[_Call] = [
            (key, [str(slot), varint(loc.epoch), loc.encode()]) for key, loc, slot in await self._slots_for(locations)
        ]
        await self._run_per_key("index move", self._move, calls)

    async def remove_stale(self, stale: Sequence[tuple[str, Location]]) -> None:
        """Drop locations a reader found stale, unless they changed since it looked."""
        calls: list[_Call] = [(key, [str(slot), loc.encode()]) for key, loc, slot in await self._slots_for(stale)]
        await self._run_per_key("stale cleanup", self._remove_exact, calls)

    async def lookup(self, keys: Sequence[str]) -> list[IndexEntry]:
        """Every recorded location of every key, in one pipelined round trip (one more to read the
        slots hash when a copy names a slot this reader does not know, at most every ``SLOT_REREAD_S``)."""
        if not keys:
            return []
        async with self._call("index lookup"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(self._conn.index_key(key))
                raw: list[dict[str, str]] = await pipe.execute()
        slots = {field for fields in raw for field in fields}
        if any(field.isdigit() and not self._conn.slots.known(int(field)) for field in slots):
            await self._reread_slots()
        return [self._entry(fields) for fields in raw]

    async def _reread_slots(self) -> None:
        if time.monotonic() - self._slots_read_at > SLOT_REREAD_S:
            self._slots_read_at = time.monotonic()
            await self._conn.slot_map()

    def _entry(self, fields: Mapping[str, str]) -> IndexEntry:
        entry: IndexEntry = []
        for field, value in fields.items():
            try:
                if not field.isdigit():
                    raise MetadataError(f"index field {field!r} is not a node slot")
                slot = int(field)
                entry.append(Location.decode(self._conn.slots.node_of(slot), value, slot))
            except MetadataError as exc:
                logger.warning("ignoring %s", exc)
        return entry

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove index entries outright; returns how many existed."""
        if not keys:
            return 0
        async with self._call("index delete"):
            return int(await self._redis.delete(*[self._conn.index_key(k) for k in keys]))

    async def scan_entries(
        self, match: str = "*", batch: int = LOOKUP_BATCH
    ) -> AsyncIterator[list[tuple[str, IndexEntry]]]:
        """Stream ``(key, locations)`` in batches: SCAN plus one pipelined lookup per batch."""
        async for keys in self.scan_key_batches(match, batch):
            yield list(zip(keys, await self.lookup(keys)))

    async def scan_key_batches(self, match: str = "*", batch: int = LOOKUP_BATCH) -> AsyncIterator[list[str]]:
        """Stream pool keys (SCAN) in lists of at most ``batch``."""
        keys: list[str] = []
        async for key in self.scan_keys(match, count=min(batch, SCAN_PAGE)):
            keys.append(key)
            if len(keys) >= batch:
                yield keys
                keys = []
        if keys:
            yield keys

    async def scan_keys(self, match: str = "*", count: int = SCAN_PAGE) -> AsyncIterator[str]:
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
        next_cursor, names = await self._conn.scan_names(cursor, self._conn.index_prefix + match, count)
        return next_cursor, [self._conn.key_from_index(name) for name in names]

    async def sweep_step(
        self, cursor: int, live: Mapping[int, int], dead: Collection[int], count: int = SWEEP_PAGE
    ) -> SweepPage:
        """One step of a sweep of the index, done in Redis (``scripts.SWEEP_LUA``): one SCAN page of at most
        about ``count`` keys, each key's fields of a ``dead`` slot, or of a ``live`` slot (slot -> epoch)
        with an older epoch, removed. The cursor works as :meth:`scan_step`'s."""
        args: list[Any] = [count, self._conn.index_prefix + "*", len(live)]
        for slot, epoch in live.items():
            args += [slot, epoch]
        args += [len(dead), *dead]

        async def sweep(node: Any, node_cursor: int) -> tuple[int, list[Any]]:
            if node is None:
                answer = await self._sweep(keys=[], args=[node_cursor, *args])  # redis-py reloads a lost script
            else:
                answer = await self._sweep_on(node, [node_cursor, *args])
            return int(answer[0]), list(answer[1:])

        async with self._call("index sweep"):
            next_cursor, (keys, removed, unknown) = await self._conn.walk_step(cursor, sweep)
        return SweepPage(next_cursor, int(keys), int(removed), frozenset(int(s) for s in unknown if str(s).isdigit()))

    async def _sweep_on(self, node: Any, args: list[Any]) -> list[Any]:
        """The sweep on one cluster primary (no declared key: it reads that primary's own)."""
        try:
            return list(await self._redis.execute_command("EVALSHA", self._sweep.sha, 0, *args, target_nodes=node))
        except redis_exceptions.NoScriptError:
            await self._redis.script_load(self._sweep.script)  # on every primary
            return list(await self._redis.execute_command("EVALSHA", self._sweep.sha, 0, *args, target_nodes=node))

    async def legacy_entries(self, *, remove: bool = False) -> int:
        """How many index keys of the release before this schema (``kvp:NS:k:{key}``, node ids as fields,
        text values) Redis still holds; ``remove`` deletes them, one SCAN page at a time. Nothing reads
        them: an upgraded node republishes what it holds in the current schema."""
        found, cursor = 0, 0
        while True:
            cursor, names = await self._conn.scan_names(cursor, self._conn.legacy_index_prefix + "*", SCAN_PAGE)
            found += len(names)
            if names and remove:
                async with self._call("legacy index delete"):
                    await self._redis.delete(*names)
            if cursor == 0:
                return found

    async def flush_namespace(self) -> int:
        """Delete every key of this namespace; returns how many were removed. Each step is bounded."""
        removed = 0
        conn = self._conn
        patterns = (conn.index_prefix, conn.legacy_index_prefix, conn.shard_marker_prefix, conn.tag_prefix)
        for pattern in patterns:
            cursor = 0
            while True:
                cursor, names = await self._conn.scan_names(cursor, pattern + "*", SCAN_PAGE)
                if names:
                    async with self._call("flush"):
                        removed += int(await self._redis.delete(*names))
                if cursor == 0:
                    break
        return removed
