"""Faults the pool must survive without losing, leaking or hanging anything."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import pytest

from backend.config import NodeConfig
from backend.embedded import EmbeddedRedis
from backend.node.server import PoolNode
from backend.protocol import ItemMeta, Op
from backend.protocol.frame import encode_header
from backend.protocol.puts import PutBatch
from kvpool import AuthError, Chunk, KVPoolError, PoolClient, PoolConfig, SyncPoolClient
from tests.support.chunks import numbered_chunks as _chunks
from tests.support.waits import wait_until


class CountingSink:
    """A sink that counts buffers handed out and given back; can decline or hold allocations."""

    def __init__(self, decline: bool = False) -> None:
        self.decline = decline
        self.allocated = 0
        self.released = 0
        self.first_allocation = asyncio.Event()

    async def allocate(self, meta: ItemMeta):
        if self.decline:
            return None
        self.allocated += 1
        self.first_allocation.set()
        buf = bytearray(meta.nbytes)
        return buf, buf

    def release(self, handle) -> None:
        self.released += 1


async def test_a_declined_allocation_is_a_miss_that_keeps_the_index_entry(node_factory, pool_url):
    node_factory()
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        chunks = _chunks("dec", 3, 4096)
        await client.put(chunks)
        keys = [c.key for c in chunks]
        assert await client.get(keys, CountingSink(decline=True)) == [None, None, None]
        await asyncio.sleep(0.3)  # any cleanup would have run by now
        assert await client.contains(keys) == [True, True, True]
        got = await client.get(keys)
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]


async def test_cancelled_get_gives_back_every_buffer_it_took(node_factory, pool_url):
    fast, slow = node_factory(), node_factory()
    async with PoolClient(PoolConfig.from_url(pool_url + "?connect_timeout_s=5&progress_timeout_s=5")) as client:
        chunks = _chunks("can", 24, 64 * 1024)
        await client.put(chunks)
        holders = {loc[0].node_id for loc in await client.index.lookup([c.key for c in chunks])}
        assert holders == {fast.node_id, slow.node_id}  # the keys span both nodes
        slow.pause()
        sink = CountingSink()
        task = asyncio.ensure_future(client.get([c.key for c in chunks], sink))
        await asyncio.wait_for(sink.first_allocation.wait(), 5)
        await asyncio.sleep(0.2)  # the fast node's answer is complete; the slow one hangs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        slow.resume()
        await asyncio.sleep(0.3)
        assert sink.allocated > 0 and sink.released == sink.allocated


def test_every_node_republishes_after_redis_is_flushed(node_factory, redis_factory):
    redis = EmbeddedRedis().start()
    redis_factory.append(redis)
    a = node_factory(redis_url=redis.url, ns="fl")
    b = node_factory(redis_url=redis.url, ns="fl")
    config = PoolConfig.from_url(f"kvpool://127.0.0.1:{redis.port}/fl")
    with SyncPoolClient(config) as client:
        chunks = _chunks("fl", 30, 1000)
        client.put(chunks)
        keys = [c.key for c in chunks]
        holders = {e[0].node_id for e in asyncio.run(_lookup(redis.url, "fl", keys))}
        assert holders == {a.node_id, b.node_id}
        subprocess.run(["redis-cli", "-p", str(redis.port), "FLUSHALL"], check=True, capture_output=True)
        assert wait_until(lambda: client.hit_prefix(keys) == len(keys), 10.0)
        epoch_now = int(
            subprocess.run(
                ["redis-cli", "-p", str(redis.port), "GET", "kvp:{fl}:epoch"], capture_output=True, text=True
            ).stdout
        )
        assert epoch_now >= max(a.epoch, b.epoch)  # new nodes never reuse a live epoch


async def _lookup(redis_url: str, ns: str, keys: list[str]):
    from backend.metadata import MetadataStore

    store = MetadataStore(redis_url, ns)
    try:
        return await store.index.lookup(keys)
    finally:
        await store.close()


async def test_requests_issued_during_the_handshake_wait_for_it(node_factory, redis_server, namespace):
    node_factory(env={"KVPOOL_TOKEN": "tok-0123456789abcdef0123456789abcd"})
    config = PoolConfig.from_url(
        f"kvpool://:tok-0123456789abcdef0123456789abcd@127.0.0.1:{redis_server.port}/{namespace}?connections_per_node=1"
    )
    async with PoolClient(config) as client:
        node = (await client.nodes())[0]
        first = asyncio.ensure_future(client.node_stats(node))
        conns = client.connections.to(node)
        while not conns.connections or conns.connections[0].sock is None:
            await asyncio.sleep(0)  # connected, HELLO/AUTH still in flight
        rest = [client.node_stats(node) for _ in range(4)]
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        assert all(isinstance(r, dict) for r in results), results


def test_replicas_are_counted_per_distinct_node(node_factory, pool_url):
    from backend.placement import choose_nodes

    nodes = {n.node_id: n for n in (node_factory() for _ in range(3))}
    with SyncPoolClient(
        PoolConfig.from_url(pool_url + "?replicas=2&connect_timeout_s=0.4&progress_timeout_s=0.4")
    ) as client:
        chunk = _chunks("rep", 1, 100)
        chosen = choose_nodes(chunk[0].key, client.nodes(), 2)
        for info in chosen:
            nodes[info.node_id].pause()  # both first choices fail; one node is left
        with pytest.raises(KVPoolError, match="not stored"):
            client.put(chunk)  # one live node cannot hold two copies
        for info in chosen:
            nodes[info.node_id].resume()


def test_node_keeps_accepting_after_running_out_of_file_descriptors(node_factory, pool_url):
    node = node_factory(max_open_files=64)
    socks = []
    for _ in range(80):
        try:
            socks.append(socket.create_connection((node.host, node.port), timeout=2))
        except OSError:
            break
    time.sleep(0.5)
    for sock in socks:
        sock.close()
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?connect_timeout_s=2&progress_timeout_s=2")) as client:
        assert wait_until(lambda: _stat_ok(client), 10.0)
    assert "accept failed" in node.log


def _stat_ok(client: SyncPoolClient) -> bool:
    try:
        return client.node_stats(client.nodes()[0])["node_id"] != ""
    except KVPoolError:
        return False


async def test_a_put_that_stalls_mid_frame_is_dropped_and_its_space_released(redis_server, namespace):
    node = PoolNode(
        NodeConfig(redis_url=redis_server.url, namespace=namespace, dram_bytes=4 << 20, frame_timeout_s=0.5)
    )
    await node.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
        meta = PutBatch.encode_items([ItemMeta("stall", 1 << 20, 0, "uint8", (1 << 20,), 0)])
        writer.write(encode_header(Op.PUT_BATCH, 1, meta, 1 << 20) + meta + bytes(1000))
        await writer.drain()
        await asyncio.sleep(0.1)
        assert node.tiers.dram_used_bytes == 1 << 20  # reserved while the frame is in flight
        assert await asyncio.wait_for(reader.read(), 3) is not None  # the node closes it
        assert node.tiers.dram_used_bytes == 0
        assert node.counters["stalled_connections"] == 1
        writer.close()
    finally:
        await node.stop()


def test_wrong_token_gets_nothing(node_factory, redis_server, namespace):
    node_factory(env={"KVPOOL_TOKEN": "secret-0123456789abcdef0123456789"})
    with SyncPoolClient(
        PoolConfig.from_url(f"kvpool://:secret-0123456789abcdef0123456789@127.0.0.1:{redis_server.port}/{namespace}")
    ) as good:
        good.put([Chunk("t", b"private")])
    with SyncPoolClient(
        PoolConfig.from_url(f"kvpool://:guess-0123456789abcdef0123456789a@127.0.0.1:{redis_server.port}/{namespace}")
    ) as bad:
        with pytest.raises(AuthError):
            bad.node_stats(bad.nodes()[0])
        assert bad.get(["t"]) == [None]
