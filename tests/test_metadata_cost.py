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
