"""The lookup every request pays: read in Redis (one Lua call) against the client's live view.

Real redis-server (and real node processes where bytes are read); the prefix, the
dead and stale copies, the view refresh and Redis being down, as ``batched_async_contains``
and the get see them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import redis

from backend.client.registry import FRESH_VIEW_S
from backend.embedded import free_port
from backend.metadata import LiveCopies, Location, MetadataStore, NodeInfo
from kvpool import Chunk, PoolClient, PoolConfig, SyncPoolClient
from tests.support.index import copies
from tests.support.waits import until, wait_until

KEYS = [f"kvpool-test/model@1@0@{i:x}@bfloat16" for i in range(10)]


def _loc(node_id: str, epoch: int, checksum: int) -> Location:
    return Location(node_id, epoch, "dram", 4096, checksum)


async def _live_node(meta: MetadataStore, node_id: str, epoch: int) -> None:
    await meta.registry.heartbeat(NodeInfo(node_id, "127.0.0.1", 1, epoch), ttl_ms=60_000, changed=True)


async def test_a_prefix_lookup_stops_in_redis_at_the_first_key_without_a_live_copy(redis_server, namespace):
    meta = MetadataStore(redis_server.url, namespace)
    client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{redis_server.port}/{namespace}"))
    try:
        await meta.index.commit([(key, _loc("n1", 1, i)) for i, key in enumerate(KEYS) if i != 4])
        await _live_node(meta, "n1", 1)

        found = await meta.lookup.lookup_live(KEYS, {"n1": 1}, prefix=True, copies=True)
        assert found.hits == [True] * 4 + [False]  # key 4 ended it: keys 5..9 were never read
        assert found.prefix == 4
        assert [[loc.checksum for loc in entry] for entry in found.copies] == [[0], [1], [2], [3], []]
        assert found.others == []
        assert (await meta.lookup.lookup_live(KEYS, {"n1": 1}, prefix=True, copies=False)).copies == [[]] * 5

        full = await meta.lookup.lookup_live(KEYS, {"n1": 1}, prefix=False, copies=False)
        assert full.hits == [True] * 4 + [False] + [True] * 5
        assert full.prefix == 4

        assert await client.hit_prefix(KEYS) == 4
        assert await client.hit_prefix(KEYS[5:]) == 5
        assert await client.hit_prefix(KEYS[4:]) == 0
        assert await client.hit_prefix([]) == 0
        assert await client.contains(KEYS) == [True] * 4 + [False] + [True] * 5
    finally:
        await client.close()
        await meta.close()


async def test_copies_on_a_dead_node_or_of_an_old_epoch_are_misses_and_are_cleaned(redis_server, namespace):
    meta = MetadataStore(redis_server.url, namespace)
    client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{redis_server.port}/{namespace}"))
    old_epoch, dead, live = KEYS[:3]
    try:
        await _live_node(meta, "n1", 2)  # n1 restarted: its epoch-1 copies are gone
        await meta.index.commit([(old_epoch, _loc("n1", 1, 1)), (dead, _loc("ghost", 5, 2)), (live, _loc("n1", 2, 3))])

        found = await meta.lookup.lookup_live([old_epoch, dead, live], {"n1": 2}, prefix=False, copies=True)
        assert found.hits == [False, False, True]
        assert sorted((i, loc.node_id, loc.epoch) for i, loc in found.others) == [(0, "n1", 1), (1, "ghost", 5)]

        await client.nodes(refresh=True)
        assert await client.hit_prefix([old_epoch, live]) == 0
        assert await client.hit_prefix([dead, live]) == 0
        assert await client.hit_prefix([live, old_epoch, dead]) == 1
        assert await client.contains([old_epoch, dead, live]) == [False, False, True]
        # Queued for cleanup in the background, after the view was read again.
        await until(lambda: meta.index.lookup([old_epoch, dead]), lambda entries: entries == [[], []])
    finally:
        await client.close()
        await meta.close()


async def test_a_view_that_predates_a_node_restart_is_read_again_and_its_new_copies_hit(redis_server, namespace):
    meta = MetadataStore(redis_server.url, namespace)
    client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{redis_server.port}/{namespace}"))
    try:
        await _live_node(meta, "n1", 1)
        await client.nodes(refresh=True)  # the view: n1 at epoch 1
        await meta.connection.redis.delete(meta.connection.heartbeat_key("n1"))  # n1 crashed: its beat lapsed
        await _live_node(meta, "n1", 2)  # n1 restarts and stores a key under its new epoch
        await meta.index.commit([(KEYS[0], _loc("n1", 2, 7))])
        await asyncio.sleep(FRESH_VIEW_S * 1.5)  # the view is now too old to call epoch 2 dead

        assert await client.hit_prefix(KEYS[:1]) == 1  # read against the re-read view
        assert client.registry.epochs() == {"n1": 2}
        await asyncio.sleep(0.2)  # a cleanup, had one been queued, would have run
        assert [loc.epoch for loc in (await meta.index.lookup(KEYS[:1]))[0]] == [2]
    finally:
        await client.close()
        await meta.close()


async def test_a_copy_of_a_node_that_joined_after_the_view_is_never_cleaned_by_a_reader(redis_server, namespace):
    """A lookup made while the view is fresh but older than a node's start finds that node's copy under a
    slot it does not know: the background cleanup reads the view again and keeps the copy."""
    meta = MetadataStore(redis_server.url, namespace)
    client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{redis_server.port}/{namespace}"))
    try:
        await _live_node(meta, "old", 1)
        await client.nodes(refresh=True)  # the view: "old" only
        await _live_node(meta, "young", 1)
        await meta.index.commit([(KEYS[0], _loc("young", 1, 7))])
        client.registry._read_at = time.monotonic()  # read a moment ago: a lookup trusts it to call nodes dead

        assert await client.contains(KEYS[:1]) == [False]  # not in this view yet: a miss, and a cleanup queued
        await until(lambda: _counted(client, "stale_entries"))
        assert [loc.node_id for loc in (await meta.index.lookup(KEYS[:1]))[0]] == ["young"]
        assert await client.contains(KEYS[:1]) == [True]
    finally:
        await client.close()
        await meta.close()


async def _counted(client: PoolClient, name: str) -> bool:
    return name in client.counters


def test_a_key_with_one_dead_and_one_live_copy_hits_and_the_get_reads_the_live_one(
    node_factory, pool_url, redis_server, namespace
):
    node = node_factory()
    chunk = Chunk(KEYS[0], os.urandom(8192))

    async def add_dead_copy() -> list[Location]:
        meta = MetadataStore(redis_server.url, namespace)
        try:
            (entry,) = await meta.index.lookup([chunk.key])
            live = entry[0]  # a copy on a node that died, of the same bytes (same checksum)
            await meta.index.commit([(chunk.key, Location("ghost", 3, live.tier, live.nbytes, live.checksum))])
            found = await meta.lookup.lookup_live([chunk.key], {live.node_id: live.epoch}, prefix=True, copies=True)
            assert found.hits == [True] and found.copies == [[live]]
            return (await meta.index.lookup([chunk.key]))[0]
        finally:
            await meta.close()

    with SyncPoolClient(PoolConfig.from_url(pool_url)) as writer:
        writer.put([chunk])
    assert "ghost" in [loc.node_id for loc in asyncio.run(add_dead_copy())]
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        assert client.hit_prefix([chunk.key]) == 1
        (got,) = client.get([chunk.key])
        assert got is not None and bytes(got.data) == bytes(chunk.data)
        assert client.counters.get("get_failovers", 0) == 0  # the dead copy was never tried
    with redis.Redis(port=redis_server.port) as raw:  # the dead copy is cleaned
        assert wait_until(lambda: "ghost" not in copies(raw, namespace, chunk.key))
        assert list(copies(raw, namespace, chunk.key)) == [node.node_id]  # the live one stays


async def test_redis_down_reads_every_lookup_as_misses_with_one_warning(caplog):
    client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{free_port()}/ns?progress_timeout_s=0.3"))
    try:
        with caplog.at_level(logging.WARNING, logger="backend.client"):
            assert await client.hit_prefix(KEYS) == 0
            assert await client.contains(KEYS[:2]) == [False, False]
            assert await client.hit_prefix(KEYS) == 0
        assert client.counters["lookup_failures"] == 3
        assert sum("Redis lookup failed" in r.getMessage() for r in caplog.records) == 1
        assert LiveCopies.missing(2).prefix == 0
    finally:
        await client.close()


async def test_a_lookup_longer_than_one_script_call_is_one_pipeline_and_survives_a_script_flush(
    redis_server, namespace
):
    meta = MetadataStore(redis_server.url, namespace)
    keys = [f"long/{i}" for i in range(2500)]
    try:
        await meta.index.commit([(key, _loc("n1", 1, i)) for i, key in enumerate(keys) if i != 1700])
        await meta.connection.redis.script_flush()  # as a Redis restarted empty would
        found = await meta.lookup.lookup_live(keys, {"n1": 1}, prefix=True, copies=True)
        assert found.prefix == 1700 and len(found.hits) == 1701  # batches of 1,000 keys, combined
        assert [entry[0].checksum for entry in found.copies[:1700]] == list(range(1700))
        assert sum((await meta.lookup.lookup_live(keys, {"n1": 1}, prefix=False, copies=False)).hits) == 2499
    finally:
        await meta.close()
