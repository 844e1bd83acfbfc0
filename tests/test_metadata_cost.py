"""What the metadata path costs Redis: counted on a real redis-server, through a counting proxy.

``bench.harness.resp_proxy.CountingProxy`` parses RESP both ways and counts round trips (a
pipeline is one); ``INFO commandstats`` counts the commands Redis executed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import redis

from backend.client import PoolClient
from backend.config import PoolConfig
from backend.embedded import EmbeddedRedis
from backend.metadata import Location, MetadataStore, NodeInfo
from bench.harness.resp_proxy import CountingProxy

KEYS = [f"kvpool-test/model@1@0@{i:x}@bfloat16" for i in range(1000)]


def _calls(info: redis.Redis, command: str) -> int:
    stats = info.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_lookup_of_1000_keys_is_one_redis_round_trip(redis_server: EmbeddedRedis, namespace: str) -> None:
    """``contains``, ``hit_prefix`` and the get's lookup: one EVALSHA each, whatever they find.

    The script's own HGETALLs count in ``INFO commandstats`` too: a prefix lookup reads
    keys only up to the first miss, so an all-miss reads one hash.
    """

    async def commit() -> None:
        store = MetadataStore(redis_server.url, namespace)
        try:
            await store.index.commit([(key, Location("n1", 1, "dram", 4096, i)) for i, key in enumerate(KEYS[:500])])
            await store.registry.heartbeat(
                NodeInfo("n1", "127.0.0.1", 1, 1), ttl_ms=60_000
            )  # n1 is alive: no stale entries
        finally:
            await store.close()

    asyncio.run(commit())
    misses = [f"absent/{i}" for i in range(1000)]
    with CountingProxy(redis_server.port) as proxy, redis.Redis(port=redis_server.port) as info:

        async def lookups() -> dict[str, tuple[int, int, int]]:
            store = MetadataStore(f"redis://127.0.0.1:{proxy.port}/0", namespace)
            client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{proxy.port}/{namespace}"))
            costs: dict[str, tuple[int, int, int]] = {}

            async def cost(name: str, call: Awaitable[object], expected: object) -> None:
                before = proxy.counts()["round_trips"], _calls(info, "evalsha"), _calls(info, "hgetall")
                assert await call == expected
                after = proxy.counts()["round_trips"], _calls(info, "evalsha"), _calls(info, "hgetall")
                costs[name] = (after[0] - before[0], after[1] - before[1], after[2] - before[2])

            try:
                await store.connection.ping()  # connected: only the lookup is counted
                entries = await store.index.lookup(KEYS[:500])  # the full read kvpool check/delete use: HGETALL per key
                assert [e[0].checksum for e in entries] == list(range(500))
                await client.nodes(refresh=True)  # the registry read: not part of a lookup
                await client.hit_prefix(KEYS[:1])  # the script is loaded once per Redis
                await cost("hit", client.hit_prefix(KEYS[:500]), 500)
                await cost("half", client.hit_prefix(KEYS), 500)
                await cost("all-miss", client.hit_prefix(misses), 0)
                await cost("contains", client.contains(KEYS), [True] * 500 + [False] * 500)
                return costs
            finally:
                await store.close()
                await client.close()

        costs = asyncio.run(lookups())
    # (round trips, EVALSHA, HGETALL run by the script)
    assert costs == {
        "hit": (1, 1, 500),
        "half": (1, 1, 501),  # stopped at the first key missing
        "all-miss": (1, 1, 1),
        "contains": (1, 1, 1000),  # per-key answers: every key read
    }


def test_a_registry_refresh_is_one_command_while_nothing_changed_and_reads_only_what_did(
    redis_server: EmbeddedRedis, namespace: str
) -> None:
    async def scenario(proxy: CountingProxy) -> None:
        store = MetadataStore(redis_server.url, namespace)
        client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{proxy.port}/{namespace}"))

        def node(i: int, used: int = 0) -> NodeInfo:
            return NodeInfo(f"n{i:02d}", "127.0.0.1", 9000 + i, 1, capacity_bytes=1000, used_bytes=used)

        async def requests(call: object) -> int:
            before = proxy.counts()["requests"]
            await call  # type: ignore[misc]
            return int(proxy.counts()["requests"] - before)

        try:
            for i in range(50):
                await store.registry.heartbeat(node(i), ttl_ms=60_000, changed=True)
            assert len(await client.nodes(refresh=True)) == 50  # a full read: HGETALL and 50 heartbeats
            assert await requests(client.registry.refresh()) == 1  # nothing changed: one EVALSHA
            assert await requests(client.registry.refresh()) == 1

            await store.registry.deregister("n07")  # a node leaves
            # the log, then only n07's entry: its record, the draining set, its slot and its beat
            assert await requests(client.registry.refresh()) <= 5
            assert "n07" not in {n.node_id for n in client.registry.known()}

            await store.registry.heartbeat(node(3, used=550), ttl_ms=60_000, changed=True)  # its load moved a tenth
            assert await requests(client.registry.refresh()) <= 5
            assert client.registry.node("n03").used_bytes == 550  # type: ignore[union-attr]

            await store.registry.heartbeat(node(9), ttl_ms=200)  # its next beat never comes
            await asyncio.sleep(0.4)
            await client.registry.refresh()  # no heartbeat collected it yet: the view drops it anyway
            assert "n09" not in {n.node_id for n in client.registry.known()}
            assert len(client.registry.known()) == 48
            assert await requests(client.registry.refresh()) == 1  # nothing new since
        finally:
            await store.close()
            await client.close()

    with CountingProxy(redis_server.port) as proxy:
        asyncio.run(scenario(proxy))


def test_a_namespace_lost_in_redis_makes_clients_read_the_registry_again(redis_server: EmbeddedRedis, namespace: str):
    async def scenario() -> None:
        store = MetadataStore(redis_server.url, namespace)
        client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{redis_server.port}/{namespace}"))
        try:
            await store.registry.ensure_marker()
            await store.registry.heartbeat(NodeInfo("a", "127.0.0.1", 1, 1), ttl_ms=60_000, changed=True)
            assert [n.node_id for n in await client.nodes(refresh=True)] == ["a"]
            await store.index.flush_namespace()  # Redis restarted empty, or was flushed
            await store.registry.ensure_marker()  # a new generation; versions count from 1 again
            await store.registry.heartbeat(NodeInfo("b", "127.0.0.1", 2, 1), ttl_ms=60_000, changed=True)
            await client.registry.refresh()
            assert [n.node_id for n in client.registry.known()] == ["b"]
        finally:
            await store.close()
            await client.close()

    asyncio.run(scenario())


def test_an_index_commit_and_a_removal_are_one_redis_round_trip_each(redis_server: EmbeddedRedis, namespace: str):
    """A node's commit (before every put's ack) and its eviction flush: one pipeline each, no SCRIPT EXISTS first."""
    with CountingProxy(redis_server.port) as proxy, redis.Redis(port=redis_server.port) as info:

        async def run() -> tuple[int, int]:
            store = MetadataStore(f"redis://127.0.0.1:{proxy.port}/0", namespace)
            try:
                await store.index.commit([(KEYS[8], Location("n1", 1, "dram", 4096, 0))])  # scripts loaded, connected
                before = proxy.counts()["round_trips"]
                await store.index.commit([(key, Location("n1", 1, "dram", 4096, i)) for i, key in enumerate(KEYS[:8])])
                committed = proxy.counts()["round_trips"] - before
                before = proxy.counts()["round_trips"]
                await store.index.remove("n1", 1, KEYS[:8])
                removed = proxy.counts()["round_trips"] - before
                info.script_flush()  # Redis lost the scripts (restart, flush): loaded again, the commit lands
                await store.index.commit([(KEYS[9], Location("n1", 1, "dram", 4096, 0))])
                return committed, removed
            finally:
                await store.close()

        exists_before = _calls(info, "script|exists")
        assert asyncio.run(run()) == (1, 1)
        assert _calls(info, "script|exists") == exists_before
        assert len(info.keys(f"kvp:{namespace}/{KEYS[9]}")) == 1


def test_a_heartbeat_is_one_redis_round_trip_and_survives_a_script_flush(redis_server: EmbeddedRedis, namespace: str):
    """A node's beat: one pipeline, no SCRIPT EXISTS first; a lost script is loaded again and the beat lands."""
    with CountingProxy(redis_server.port) as proxy, redis.Redis(port=redis_server.port) as info:
        node = NodeInfo("n1", "127.0.0.1", 1, 1)

        async def run() -> int:
            store = MetadataStore(f"redis://127.0.0.1:{proxy.port}/0", namespace)
            try:
                await store.registry.heartbeat(node, ttl_ms=60_000, changed=True)  # scripts loaded, connected
                before = proxy.counts()["round_trips"]
                await store.registry.heartbeat(node, ttl_ms=60_000)
                beat = proxy.counts()["round_trips"] - before
                info.script_flush()  # Redis lost the scripts: loaded again, the beat lands
                await store.registry.heartbeat(node, ttl_ms=60_000)
                return beat
            finally:
                await store.close()

        exists_before = _calls(info, "script|exists")
        assert asyncio.run(run()) == 1
        assert _calls(info, "script|exists") == exists_before
        assert info.zscore(f"kvp:{{{namespace}}}:beats", "n1") is not None
