"""KeyIndex: which node holds which key, on which tier; commits, removals and walks."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis import exceptions as redis_exceptions

from backend.errors import MetadataError
from backend.metadata.connection import RedisConnection
from backend.metadata.records import IndexEntry, Location
from backend.metadata.scripts import LOOKUP_BATCH

__all__ = ["KeyIndex"]

logger = logging.getLogger("backend.metadata")


class KeyIndex(RedisConnection):
    """The index: ``kvp:NS:k:{key}`` hashes of node id -> location, one per pool key."""

    async def _run_per_key(
        self, action: str, script: Any, calls: Sequence[tuple[str, list[str]]], timeout_s: float | None = None
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
                    await self._load_scripts()
                    await self._run_batch(script, batch)

    async def _run_batch(self, script: Any, batch: Sequence[tuple[str, list[str]]]) -> None:
        # EVALSHA straight into the pipeline: a Script object on a pipeline makes redis-py send
        # SCRIPT EXISTS first, one more round trip before every commit (and so before every put's ack).
        async with self._redis.pipeline(transaction=False) as pipe:
            for key, args in batch:
                pipe.evalsha(script.sha, 1, self.index_key(key), *args)
            await pipe.execute()

    async def commit(self, locations: Sequence[tuple[str, Location]], timeout_s: float | None = None) -> None:
        """Make ``(key, location)`` pairs visible, in one pipelined round trip per batch.

        ``timeout_s``: how long each batch may wait for Redis, when less than its timeout (a
        put's commit answers its client before the client gives up on the node).
        """
        calls = [(key, [loc.node_id, loc.encode(), str(loc.checksum)]) for key, loc in locations]
        await self._run_per_key("index commit", self._commit, calls, timeout_s)

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
