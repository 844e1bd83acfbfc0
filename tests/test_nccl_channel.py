"""The channel over its CPU transport: real redis-server, real node processes, real sockets.

The CPU transport has the NCCL transport's contract, so this exercises everything
but libnccl itself: rendezvous through Redis, the pair cache, batches, timeouts,
peer death mid-transfer, and the fallback to TCP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator

import pytest

from backend.client import BytesSink, SyncPoolClient
from backend.metadata import MetadataStore
from backend.protocol import Op
from backend.protocol.channel import ChannelGet
from backend.protocol.meta import encode_json
from kvpool import Chunk, KVPoolError, NcclError, PoolClient, PoolConfig, ProtocolError
from nccl_channel.channel import ChannelServer, CpuTransport, NcclChannel
from nccl_channel.outcome import Landed, NotBrought, Why
from nccl_channel.rendezvous import Offer, Rendezvous, new_pair_id
from tests.support.clock import ManualClock
from tests.support.waits import until, wait_until

CLUSTER = "rack-a"
TIMEOUT_S = 1.0
PAIR_WAIT_S = 20.0


def _chunks(prefix: str, count: int, size: int) -> list[Chunk]:
    return [Chunk(f"{prefix}@{i}", os.urandom(size)) for i in range(count)]


@pytest.fixture
async def client(pool_url) -> AsyncIterator[PoolClient]:
    pool = PoolClient(PoolConfig.from_url(f"{pool_url}?cluster={CLUSTER}&progress_timeout_s={TIMEOUT_S}"))
    yield pool
    await pool.close()


def _channel(client: PoolClient, transport: CpuTransport | None = None) -> NcclChannel:
    return NcclChannel(
        transport or CpuTransport(),
        Rendezvous(client.index),
        "test-endpoint",
        CLUSTER,
        client.channel_request,
        client.config.progress_timeout_s,
    )


def _bytes(results: list) -> list[bytes]:
    """The bytes of each landed chunk (every result must have landed)."""
    assert all(isinstance(r, Landed) for r in results), results
    return [bytes(r.handle.data) for r in results]


async def _node_info(client: PoolClient, node_id: str):
    return next(n for n in await client.nodes(refresh=True) if n.node_id == node_id)


# -- rendezvous -------------------------------------------------------------------------------
async def test_an_offer_is_taken_once_and_only_by_its_target(redis_server, namespace):
    store = MetadataStore(redis_server.url, namespace)
    rdv = Rendezvous(store.rendezvous)
    try:
        offer = Offer(new_pair_id(), "cpu", b"\x01\x02", "client-1", "node-1", CLUSTER)
        await rdv.publish(offer)
        with pytest.raises(NcclError, match="meant for 'node-1', not 'node-2'"):
            await rdv.take(offer.pair_id, target="node-2", cluster=CLUSTER, transport="cpu")
        await rdv.publish(offer)
        got = await rdv.take(offer.pair_id, target="node-1", cluster=CLUSTER, transport="cpu", digest=offer.digest())
        assert got == offer
        with pytest.raises(NcclError, match="missing or expired"):
            await rdv.take(offer.pair_id, target="node-1", cluster=CLUSTER, transport="cpu")
        await rdv.publish(offer)
        with pytest.raises(NcclError, match="comes from cluster 'rack-a'; this is 'rack-b'"):
            await rdv.take(offer.pair_id, target="node-1", cluster="rack-b", transport="cpu")
        await rdv.publish(offer)
        with pytest.raises(NcclError, match="wants transport 'cpu'; this side has 'nccl'"):
            await rdv.take(offer.pair_id, target="node-1", cluster=CLUSTER, transport="nccl")
        # Someone with the Redis password but not the token rewrites the offer (their own unique id):
        # the node, told the offer's digest over its authenticated connection, refuses to join it.
        forged = dataclasses.replace(offer, unique_id=b"\x66" * 2, initiator="intruder")
        await rdv.publish(forged)
        with pytest.raises(NcclError, match="not the offer the client made"):
            await rdv.take(offer.pair_id, target="node-1", cluster=CLUSTER, transport="cpu", digest=offer.digest())
    finally:
        await store.close()


async def test_an_untaken_offer_expires_in_redis(redis_server, namespace):
    store = MetadataStore(redis_server.url, namespace)
    try:
        offer = Offer(new_pair_id(), "cpu", b"id", "client-1", "node-1", CLUSTER)
        await Rendezvous(store.rendezvous, ttl_ms=100).publish(offer)
        redis = store.connection.redis
        assert 0 < await redis.pttl(store.rendezvous.rendezvous_key(offer.pair_id)) <= 100
        await until(lambda: redis.exists(store.rendezvous.rendezvous_key(offer.pair_id)), lambda n: n == 0, 5.0)
    finally:
        await store.close()


async def test_cpu_transport_pairs_two_ends_from_the_published_id_alone(redis_server, namespace):
    store = MetadataStore(redis_server.url, namespace)
    server = ChannelServer(CpuTransport(), Rendezvous(store.rendezvous), "node-x", CLUSTER, timeout_s=5.0)
    transport = CpuTransport()
    unique_id, state = transport.prepare()
    try:
        pair_id = new_pair_id()
        offer = Offer(pair_id, "cpu", unique_id, "client-x", "node-x", CLUSTER)
        await Rendezvous(store.rendezvous).publish(offer)
        await server.start_join(pair_id, offer.digest())
        link, _ = await asyncio.gather(
            asyncio.to_thread(transport.join, unique_id, 0, state, 5.0), server.join(pair_id)
        )
        payload = [os.urandom(1000), b"", os.urandom(70_000)]
        got = [bytearray(len(p)) for p in payload]
        landed: list[int] = []
        received = asyncio.ensure_future(
            asyncio.to_thread(
                link.recv_into, [len(p) for p in payload], [memoryview(g) for g in got], 5.0, landed.append
            )
        )
        await server.send(pair_id, payload)
        await received
        assert [bytes(g) for g in got] == payload and landed == [0, 1, 2]
        assert server.counters["channel_bytes"] == 71_000
        link.close()
    finally:
        transport.discard(state)
        await server.close()
        await store.close()


# -- against a real node ---------------------------------------------------------------------
async def test_a_batch_arrives_byte_identical_and_the_pair_is_reused(node_factory, client):
    node = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    chunks = _chunks("batch", 12, 300_000)
    await client.put(chunks)
    info = await _node_info(client, node.node_id)
    assert info.channel == "cpu" and info.cluster == CLUSTER
    channel = _channel(client)
    try:
        assert channel.serves(info)
        keys = [c.key for c in chunks]
        got = await channel.get(info, [*keys[:6], "batch@missing", *keys[6:]], BytesSink())
        assert got[6] == NotBrought(Why.NOT_HELD)
        assert _bytes(got[:6] + got[7:]) == [bytes(c.data) for c in chunks]
        again = await channel.get(info, keys[::-1], BytesSink())
        assert _bytes(again) == [bytes(c.data) for c in chunks[::-1]]
        assert channel.counters["pairs_created"] == 1 and channel.pair_count() == 1
        stats = await client.node_stats(info)
        assert stats["counters"]["channel_pairs"] == 1
        assert stats["counters"]["channel_hits"] == 24 and stats["counters"]["channel_misses"] == 1
        # A send's bytes count once its thread has returned, which may be after the client has them all.
        stats = await until(
            lambda: client.node_stats(info), lambda s: s["counters"]["channel_bytes"] >= 2 * 12 * 300_000, 5.0
        )
        assert stats["counters"]["channel_bytes"] == 2 * 12 * 300_000
    finally:
        await channel.close()


def test_sync_pool_client_reads_same_cluster_hits_over_the_channel_its_url_turns_on(node_factory, pool_url):
    """``nccl=on`` in the URL is enough: the client builds the channel (here its CPU transport), the first
    read goes over TCP while the pair is made, and once paired every hit comes over the channel, none over TCP."""
    node = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    chunks = _chunks("sync", 4, 200_000)
    keys, expected = [c.key for c in chunks], [bytes(c.data) for c in chunks]
    with SyncPoolClient(PoolConfig.from_url(f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu")) as pool:
        pool.put(chunks)

        def read_over_the_channel() -> bool:
            got = pool.get(keys)
            assert [bytes(g.data) for g in got] == expected  # right bytes whichever path served them
            return pool.counters.get("get_bytes_channel", 0) > 0

        assert wait_until(read_over_the_channel, PAIR_WAIT_S), "no read came over the channel"
        before = pool.counters
        info = next(n for n in pool.nodes() if n.node_id == node.node_id)
        hits_before = pool.node_stats(info)["counters"]["channel_hits"]
        got = pool.get(keys)
        after = pool.counters
        assert [bytes(g.data) for g in got] == expected
        assert after["get_bytes_channel"] - before["get_bytes_channel"] == 4 * 200_000
        assert after.get("get_bytes_tcp", 0) == before.get("get_bytes_tcp", 0)
        assert after.get("channel_fallbacks", 0) == 0
        assert pool.node_stats(info)["counters"]["channel_hits"] - hits_before == 4


async def test_concurrent_gets_on_one_pair_are_serialised_and_all_correct(node_factory, client):
    node = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    chunks = _chunks("conc", 8, 200_000)
    await client.put(chunks)
    info = await _node_info(client, node.node_id)
    channel = _channel(client)
    try:
        results = await asyncio.gather(*(channel.get(info, [c.key], BytesSink()) for c in chunks))
        assert [_bytes(r)[0] for r in results] == [bytes(c.data) for c in chunks]
        assert channel.counters["pairs_created"] == 1
    finally:
        await channel.close()


async def test_a_node_of_another_cluster_or_without_channel_is_not_served(node_factory, client):
    other = node_factory("--cluster", "rack-b", "--channel", "cpu")
    plain = node_factory("--cluster", CLUSTER)
    channel = _channel(client)
    nodes = {n.node_id: n for n in await client.nodes(refresh=True)}
    assert not channel.serves(nodes[other.node_id])
    assert not channel.serves(nodes[plain.node_id])
    with pytest.raises(KVPoolError, match="serves no channel"):
        await client.channel_request(nodes[plain.node_id], ChannelGet.encode_request(new_pair_id(), []))


async def test_a_node_refuses_an_unknown_session_and_a_malformed_request(node_factory, client):
    node = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    info = await _node_info(client, node.node_id)
    with pytest.raises(KVPoolError, match="never paired"):
        await client.channel_request(info, ChannelGet.encode_request(new_pair_id(), ["k"]))
    with pytest.raises(KVPoolError, match="missing or expired"):
        await client.channel_request(info, ChannelGet.encode_request(new_pair_id(), [], "d" * 64))
    with pytest.raises(KVPoolError, match="names no offer digest"):
        await client.channel_request(info, ChannelGet.encode_request(new_pair_id(), []))
    with pytest.raises(ProtocolError, match="session must be"):
        await client.channel_request(info, encode_json({"keys": []}))
    assert node.alive()


async def test_peer_death_mid_transfer_aborts_the_pair_and_a_new_node_pairs_again(node_factory, client):
    """The node is killed after the first chunk of a batch arrived: NcclError, pair dropped."""
    node = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    chunks = _chunks("death", 8, 4 * 1024 * 1024)  # far more than the socket buffers hold
    await client.put(chunks)
    info = await _node_info(client, node.node_id)
    transport = CpuTransport(progress=lambda index: node.kill() if index == 0 else None)
    channel = _channel(client, transport)
    try:
        with pytest.raises(NcclError, match=r"closed the channel mid-transfer|receive failed"):
            await channel.get(info, [c.key for c in chunks], BytesSink())
        assert channel.pair_count() == 0 and channel.counters["pair_failures"] == 1
    finally:
        await channel.close()


async def test_a_stalled_peer_times_out_instead_of_hanging(node_factory, client):
    node = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    chunks = _chunks("stall", 8, 4 * 1024 * 1024)
    await client.put(chunks)
    info = await _node_info(client, node.node_id)
    transport = CpuTransport(progress=lambda index: node.pause() if index == 0 else None)
    channel = _channel(client, transport)
    try:
        async with asyncio.timeout(60):  # the channel's own bound is ~1.6 s; this only guards the test
            with pytest.raises(NcclError, match="timed out"):
                await channel.get(info, [c.key for c in chunks], BytesSink())
        assert channel.pair_count() == 0
    finally:
        node.resume()
        await channel.close()
    # The node survives a client that gave up: its send fails, the pair is dropped, it keeps serving.
    fresh = _channel(client)
    try:
        got = await fresh.get(info, [chunks[0].key], BytesSink())
        assert _bytes(got) == [bytes(chunks[0].data)]
    finally:
        await fresh.close()
    assert wait_until(lambda: "pair dropped" in node.log, 30.0)


def test_channel_messages_round_trip_and_reject_what_is_malformed():
    from backend.protocol import ItemMeta
    from backend.protocol.channel import ChannelGet, ChannelRequest

    assert Op.CHANNEL_GET == 13  # 11 and 12 belong to other ops
    assert ChannelGet.decode_request(ChannelGet.encode_request("s1", ["a", "b"])) == ChannelRequest(
        "s1", ["a", "b"], "", 0
    )
    assert ChannelGet.decode_request(ChannelGet.encode_request("s1", [], "d" * 64)) == ChannelRequest(
        "s1", [], "d" * 64
    )
    item = ItemMeta("b", 10, 99, "bfloat16", (2, 5), 1)
    meta = ChannelGet.encode_answer([None, item])
    assert ChannelGet.decode_answer(meta, ["a", "b"]) == [None, item]
    with pytest.raises(ProtocolError, match="one result per key"):
        ChannelGet.decode_answer(meta, ["a"])
    with pytest.raises(ProtocolError, match="malformed"):
        ChannelGet.decode_answer(encode_json({"found": [[1, 2]]}), ["a"])
    with pytest.raises(ProtocolError, match="key outside"):
        ChannelGet.decode_request(encode_json({"session": "s", "keys": [""]}))
    with pytest.raises(ProtocolError, match="session must be"):
        ChannelGet.decode_request(encode_json({"session": "x" * 65, "keys": []}))


class _RecordingTransport(CpuTransport):
    """The CPU transport, its links noting when a receive starts, ends and when the link is aborted."""

    def __init__(self, progress) -> None:
        super().__init__(progress=progress)
        self.events: list[str] = []

    def join(self, unique_id: bytes, rank: int, state, timeout_s: float):
        return _RecordingLink(super().join(unique_id, rank, state, timeout_s), self.events)


class _RecordingLink:
    def __init__(self, link, events: list[str]) -> None:
        self.link, self.events = link, events

    @property
    def broken(self) -> bool:
        return self.link.broken

    def send(self, buffers, timeout_s: float) -> None:
        self.link.send(buffers, timeout_s)

    def recv_into(self, sizes, targets, timeout_s: float, landed) -> None:
        self.events.append("recv start")
        try:
            self.link.recv_into(sizes, targets, timeout_s, landed)
        finally:
            self.events.append("recv end")

    def cancel(self) -> None:
        self.link.cancel()

    def abort(self) -> None:
        self.events.append("abort")
        self.link.abort()

    def close(self) -> None:
        self.link.close()


async def test_a_cancelled_get_aborts_the_pair_only_after_its_receive_thread_returned(node_factory, client):
    """NCCL forbids two calls on one communicator at a time: the abort waits for the receiving thread."""
    node = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    chunks = _chunks("cancel", 8, 4 * 1024 * 1024)
    await client.put(chunks)
    info = await _node_info(client, node.node_id)
    arrived = asyncio.Event()
    loop = asyncio.get_running_loop()

    def first_chunk(index: int) -> None:
        if index == 0:
            node.pause()  # the receive now blocks until cancelled or timed out
            loop.call_soon_threadsafe(arrived.set)

    transport = _RecordingTransport(first_chunk)
    channel = _channel(client, transport)
    try:
        fetch = asyncio.ensure_future(channel.get(info, [c.key for c in chunks], BytesSink()))
        await asyncio.wait_for(arrived.wait(), 10)
        fetch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fetch
        assert channel.pair_count() == 0
        await until(lambda: "abort" in transport.events, timeout_s=10.0)  # the abort runs on this loop
        assert transport.events == ["recv start", "recv end", "abort"]
        assert channel.serves(info)  # a cancelled call is not the node's failure: no back-off
    finally:
        node.resume()
        await channel.close()


async def test_after_a_channel_failure_the_node_is_read_over_tcp_for_the_backoff_period(node_factory, client):
    node = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    chunks = _chunks("backoff", 8, 4 * 1024 * 1024)
    await client.put(chunks)
    info = await _node_info(client, node.node_id)
    transport = CpuTransport(progress=lambda index: node.pause() if index == 0 else None)
    clock = ManualClock()  # the back-off's time: advanced by hand, not slept through
    channel = NcclChannel(
        transport,
        Rendezvous(client.index),
        "test-endpoint",
        CLUSTER,
        client.channel_request,
        client.config.progress_timeout_s,
        backoff_s=3.0,
        clock=clock,
    )
    try:
        assert channel.serves(info)
        with pytest.raises(NcclError, match="timed out after"):
            await channel.get(info, [c.key for c in chunks], BytesSink())
        assert not channel.serves(info)
        clock.advance(2.9)
        assert not channel.serves(info)  # still within the back-off
        clock.advance(0.1)
        assert channel.serves(info)
    finally:
        node.resume()
        await channel.close()


@pytest.mark.usefixtures("processes")
def test_a_node_asked_for_the_nccl_channel_without_a_gpu_exits_naming_the_option(redis_server, namespace):
    import subprocess
    import sys

    from nccl_channel import available

    if available().ok:
        pytest.skip("this machine can run the NCCL channel")
    args = [
        "--redis",
        redis_server.url,
        "--namespace",
        namespace,
        "--dram",
        "64MiB",
        "--shm-dir",
        "off",
        "--cluster",
        CLUSTER,
        "--channel",
        "nccl",
    ]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    out = subprocess.run(
        [sys.executable, "-m", "backend.cli", "node", *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 2, out.stderr[-2000:]  # a ConfigError: a usage error, nothing started
    assert "kvpool: error: --channel: the NCCL channel cannot run here" in out.stderr


async def test_a_channel_batch_stops_at_the_nodes_data_cap_and_the_rest_are_misses(redis_server, namespace, client):
    """As for GET_BATCH, one CHANNEL_GET moves at most ``limits.max_data_bytes``; the client reads the rest over TCP."""
    import dataclasses

    from backend.config import NodeConfig
    from backend.node.server import PoolNode
    from backend.protocol import DEFAULT_LIMITS

    limits = dataclasses.replace(DEFAULT_LIMITS, max_data_bytes=250_000)
    node = PoolNode(
        NodeConfig(redis_server.url, namespace, 64 * 1024 * 1024, cluster=CLUSTER, channel="cpu", limits=limits)
    )
    await node.start()
    channel = _channel(client)
    try:
        chunks = _chunks("cap", 4, 100_000)
        for chunk in chunks:  # one per frame: each fits the node's cap
            await client.put([chunk])
        info = await _node_info(client, node.node_id)
        got = await channel.get(info, [c.key for c in chunks], BytesSink())
        assert _bytes(got[:2]) == [bytes(c.data) for c in chunks[:2]]
        assert got[2:] == [NotBrought(Why.NOT_HELD)] * 2
        assert node.counters["get_over_frame_limit"] == 2 and node.counters["channel_hits"] == 2
        rest = await client.get([c.key for c in chunks[2:]], BytesSink())
        assert [bytes(g.data) for g in rest] == [bytes(c.data) for c in chunks[2:]]
    finally:
        await channel.close()
        await node.stop()
