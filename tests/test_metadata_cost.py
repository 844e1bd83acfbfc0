"""What the metadata path costs Redis: counted on a real redis-server, through a counting proxy.

``bench.resp_proxy.CountingProxy`` parses RESP both ways and counts round trips (a
pipeline is one); ``INFO commandstats`` counts the commands Redis executed.
"""

from __future__ import annotations

import asyncio

import redis

from backend.client import PoolClient
from backend.config import PoolConfig
from backend.embedded import EmbeddedRedis
from backend.metadata import Location, MetadataStore, NodeInfo
from bench.resp_proxy import CountingProxy

KEYS = [f"kvpool-test/model@1@0@{i:x}@bfloat16" for i in range(1000)]


def _calls(info: redis.Redis, command: str) -> int:
    stats = info.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_lookup_of_1000_keys_is_one_redis_round_trip(redis_server: EmbeddedRedis, namespace: str) -> None:
    async def commit() -> None:
        meta = MetadataStore(redis_server.url, namespace)
        try:
            await meta.commit([(key, Location("n1", 1, "dram", 4096, i)) for i, key in enumerate(KEYS)])
            await meta.heartbeat(NodeInfo("n1", "127.0.0.1", 1, 1), ttl_ms=60_000)  # n1 is alive: no stale entries
        finally:
            await meta.close()

    asyncio.run(commit())
    with CountingProxy(redis_server.port) as proxy, redis.Redis(port=redis_server.port) as info:

        async def lookups() -> tuple[int, int, int, int]:
            meta = MetadataStore(f"redis://127.0.0.1:{proxy.port}/0", namespace)
            client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{proxy.port}/{namespace}"))
            try:
                await meta.ping()  # connected: only the lookup is counted
                before, calls = proxy.counts()["round_trips"], _calls(info, "hgetall")
                entries = await meta.lookup(KEYS)
                store_trips, store_calls = proxy.counts()["round_trips"] - before, _calls(info, "hgetall") - calls
                assert [e[0].checksum for e in entries] == list(range(1000))
                await client.nodes(refresh=True)  # the registry read: not part of a lookup
                before, calls = proxy.counts()["round_trips"], _calls(info, "hgetall")
                assert await client.contains(KEYS) == [True] * 1000
                return store_trips, store_calls, proxy.counts()["round_trips"] - before, _calls(info, "hgetall") - calls
            finally:
                await meta.close()
                await client.close()

        store_trips, store_calls, client_trips, client_calls = asyncio.run(lookups())
    assert (store_trips, store_calls) == (1, 1000)
    assert (client_trips, client_calls) == (1, 1000)


def test_a_registry_refresh_is_one_command_while_nothing_changed_and_reads_only_what_did(
    redis_server: EmbeddedRedis, namespace: str
) -> None:
    async def scenario(proxy: CountingProxy) -> None:
        meta = MetadataStore(redis_server.url, namespace)
        client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{proxy.port}/{namespace}"))

        def node(i: int, used: int = 0) -> NodeInfo:
            return NodeInfo(f"n{i:02d}", "127.0.0.1", 9000 + i, 1, capacity_bytes=1000, used_bytes=used)

        async def requests(call: object) -> int:
            before = proxy.counts()["requests"]
            await call  # type: ignore[misc]
            return int(proxy.counts()["requests"] - before)

        try:
            for i in range(50):
                await meta.heartbeat(node(i), ttl_ms=60_000, changed=True)
            assert len(await client.nodes(refresh=True)) == 50  # a full read: HGETALL and 50 heartbeats
            assert await requests(client.registry.refresh()) == 1  # nothing changed: one EVALSHA
            assert await requests(client.registry.refresh()) == 1

            await meta.deregister("n07")  # a node leaves
            assert await requests(client.registry.refresh()) <= 4  # the log, then only n07's entry
            assert "n07" not in {n.node_id for n in client.registry.known()}

            await meta.heartbeat(node(3, used=550), ttl_ms=60_000, changed=True)  # its load moved a tenth
            assert await requests(client.registry.refresh()) <= 4
            assert client.registry.node("n03").used_bytes == 550  # type: ignore[union-attr]

            await meta.heartbeat(node(9), ttl_ms=200)  # its next beat never comes
            await asyncio.sleep(0.4)
            await client.registry.refresh()  # no heartbeat collected it yet: the view drops it anyway
            assert "n09" not in {n.node_id for n in client.registry.known()}
            assert len(client.registry.known()) == 48
            assert await requests(client.registry.refresh()) == 1  # nothing new since
        finally:
            await meta.close()
            await client.close()

    with CountingProxy(redis_server.port) as proxy:
        asyncio.run(scenario(proxy))


def test_a_namespace_lost_in_redis_makes_clients_read_the_registry_again(redis_server: EmbeddedRedis, namespace: str):
    async def scenario() -> None:
        meta = MetadataStore(redis_server.url, namespace)
        client = PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{redis_server.port}/{namespace}"))
        try:
            await meta.ensure_marker()
            await meta.heartbeat(NodeInfo("a", "127.0.0.1", 1, 1), ttl_ms=60_000, changed=True)
            assert [n.node_id for n in await client.nodes(refresh=True)] == ["a"]
            await meta.flush_namespace()  # Redis restarted empty, or was flushed
            await meta.ensure_marker()  # a new generation; versions count from 1 again
            await meta.heartbeat(NodeInfo("b", "127.0.0.1", 2, 1), ttl_ms=60_000, changed=True)
            await client.registry.refresh()
            assert [n.node_id for n in client.registry.known()] == ["b"]
        finally:
            await meta.close()
            await client.close()

    asyncio.run(scenario())
