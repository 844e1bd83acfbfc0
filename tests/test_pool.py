"""The pool end to end: real redis-server, real node processes, the real client."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from typing import Any

import pytest

from backend.embedded import EmbeddedRedis
from backend.metadata import MetadataStore
from backend.protocol import Op, Status
from backend.protocol.frame import HEADER, decode_header, encode_header
from backend.protocol.meta import encode_keys
from kvpool import AuthError, CapacityError, Chunk, MetadataError, PoolClient, PoolConfig, SyncPoolClient
from tests.support.chunks import numbered_chunks as _chunks
from tests.support.handshake import hello_frame
from tests.support.waits import wait_until


def test_put_then_get_returns_identical_bytes_and_layout(node_factory, pool_url):
    node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        chunks = [
            Chunk(f"m@1@0@{i}@bfloat16", os.urandom(4096 * (i + 1)), "bfloat16", (2, i + 1, 1024), 1) for i in range(5)
        ]
        client.put(chunks)
        got = client.get([c.key for c in chunks])
        for chunk, fetched in zip(chunks, got, strict=True):
            assert fetched is not None
            assert bytes(fetched.data) == bytes(chunk.data)
            assert fetched.meta.shape == chunk.shape and fetched.meta.dtype == "bfloat16" and fetched.meta.fmt == 1


def test_hit_prefix_stops_at_a_missing_middle_key(node_factory, pool_url):
    node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        chunks = _chunks("p", 6, 1000)
        client.put(chunks[:3] + chunks[4:])
        keys = [c.key for c in chunks]
        assert client.hit_prefix(keys) == 3
        assert client.contains(keys) == [True, True, True, False, True, True]
        assert client.get(keys)[3] is None


def test_delete_removes_index_entry_and_node_bytes(node_factory, pool_url):
    node = node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        chunks = _chunks("d", 3, 2048)
        client.put(chunks)
        assert client.delete([chunks[0].key]) == 1
        assert client.contains([c.key for c in chunks]) == [False, True, True]
        stats = client.node_stats(client.nodes()[0])
        assert stats["tiers"]["dram"]["objects"] == 2
        assert stats["counters"]["deletes"] == 1
    assert node.alive()


def test_lru_eviction_removes_the_index_entries_it_evicts(node_factory, pool_url, redis_server, namespace):
    node_factory(dram="1MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        chunks = _chunks("e", 12, 128 * 1024)  # 1.5 MiB into a 1 MiB tier
        for chunk in chunks:
            client.put([chunk])
        client.get([chunks[-1].key])
        present = client.contains([c.key for c in chunks])
        assert present[-8:] == [True] * 8  # the 8 most recent fit exactly
        assert present[:4] == [False] * 4

    async def index_size() -> int:
        meta = MetadataStore(redis_server.url, namespace)
        try:
            return len([k async for k in meta.index.scan_keys()])
        finally:
            await meta.close()

    assert wait_until(lambda: asyncio.run(index_size()) == 8, 5.0)


def test_put_larger_than_any_node_raises_capacity_error(node_factory, pool_url):
    node_factory(dram="1MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        with pytest.raises(CapacityError):
            client.put([Chunk("big", bytes(2 * 1024 * 1024))])
        client.put([Chunk("small", b"x" * 100)])  # the node still serves
        assert client.contains(["small", "big"]) == [True, False]


def test_put_with_no_live_node_raises_capacity_error(redis_server, pool_url):
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        with pytest.raises(CapacityError, match="no live node"):
            client.put(_chunks("n", 1, 10))


async def test_sixteen_concurrent_clients_times_200_chunks_every_byte_verified(node_factory, pool_url):
    node_factory(dram="512MiB")
    config = PoolConfig.from_url(pool_url + "?progress_timeout_s=20")

    async def one_client(index: int) -> int:
        async with PoolClient(config) as client:
            chunks = _chunks(f"c{index}", 200, 16 * 1024, seed=index)
            for start in range(0, 200, 25):
                await client.put(chunks[start : start + 25])
            got = await client.get([c.key for c in chunks])
            return sum(1 for c, g in zip(chunks, got, strict=True) if g is not None and g.data == c.data)

    verified = await asyncio.gather(*(one_client(i) for i in range(16)))
    assert verified == [200] * 16


def test_killed_node_reads_as_misses_within_the_timeout(node_factory, pool_url):
    node = node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?progress_timeout_s=0.5")) as client:
        chunks = _chunks("k", 4, 4096)
        client.put(chunks)
        assert all(g is not None for g in client.get([c.key for c in chunks]))
        node.kill()
        start = time.monotonic()
        got = client.get([c.key for c in chunks])
        assert got == [None] * 4
        assert time.monotonic() - start < 1.5


def test_a_second_node_takes_writes_when_one_dies(node_factory, pool_url):
    first = node_factory()
    second = node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?progress_timeout_s=0.5")) as client:
        assert {n.node_id for n in client.nodes()} == {first.node_id, second.node_id}
        first.kill()
        chunks = _chunks("f", 20, 1024)
        client.put(chunks)  # placement skips, or falls back from, the dead node
        assert all(g is not None for g in client.get([c.key for c in chunks]))


def test_clean_shutdown_deregisters_and_withdraws_entries(node_factory, pool_url):
    node = node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(_chunks("s", 3, 100))
        assert node.terminate() == 0
        assert client.nodes() == []
        assert client.list_keys() == []
    assert "stopped" in node.log


def test_redis_down_reads_as_misses_then_recovers_with_republished_index(node_factory, redis_factory):
    redis = EmbeddedRedis().start()
    redis_factory.append(redis)
    node_factory(redis_url=redis.url, ns="rr")
    config = PoolConfig.from_url(f"kvpool://127.0.0.1:{redis.port}/rr?progress_timeout_s=0.5")
    with SyncPoolClient(config) as client:
        chunks = _chunks("r", 5, 1000)
        client.put(chunks)
        redis.kill()
        assert client.contains([c.key for c in chunks]) == [False] * 5
        assert client.get([c.key for c in chunks]) == [None] * 5
        with pytest.raises(MetadataError):
            client.list_keys()  # an admin verb says Redis is down
        # Redis comes back empty on the same port: the node notices and republishes.
        restarted = EmbeddedRedis(redis.port)
        redis_factory.append(restarted)
        restarted.start()
        assert wait_until(lambda: _quiet(client.hit_prefix, [c.key for c in chunks]) == 5, 15.0)
        got = client.get([c.key for c in chunks])
        assert [bytes(g.data) for g in got if g is not None] == [bytes(c.data) for c in chunks]


def _quiet(fn, *args):
    try:
        return fn(*args)
    except MetadataError:
        return None


@pytest.mark.usefixtures("processes")
def test_node_refuses_to_start_without_redis(tmp_path):
    from backend.embedded import free_port

    proc = __import__("subprocess").run(
        [
            __import__("sys").executable,
            "-m",
            "backend.cli",
            "node",
            "--redis",
            f"redis://127.0.0.1:{free_port()}",
            "--dram",
            "1MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Redis" in proc.stderr and "failed" in proc.stderr


def test_token_is_required_and_checked(node_factory, redis_server, namespace):
    node_factory(env={"KVPOOL_TOKEN": "right-token-0123456789abcdef01234"})
    base = f"127.0.0.1:{redis_server.port}/{namespace}"
    with SyncPoolClient(PoolConfig.from_url(f"kvpool://{base}")) as client:
        with pytest.raises(AuthError, match="requires a token"):
            client.put(_chunks("a", 1, 10))
    with SyncPoolClient(PoolConfig.from_url(f"kvpool://:wrong-0123456789abcdef0123456789a@{base}")) as client:
        with pytest.raises(AuthError):
            client.put(_chunks("a", 1, 10))
    with SyncPoolClient(PoolConfig.from_url(f"kvpool://:right-token-0123456789abcdef01234@{base}")) as client:
        client.put(_chunks("a", 1, 10))
        assert client.contains(["a@0"]) == [True]


# -- malformed frames sent straight to a node -------------------------------------------


def _raw(node) -> socket.socket:
    sock = socket.create_connection((node.host, node.port), timeout=5)
    return sock


def _read_frame(sock: socket.socket):
    head = b""
    while len(head) < HEADER.size:
        part = sock.recv(HEADER.size - len(head))
        if not part:
            raise ConnectionError("closed")
        head += part
    header = decode_header(head)
    body = b""
    while len(body) < header.meta_len:
        body += sock.recv(header.meta_len - len(body))
    return header, body


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "frame, reason",
    [
        (b"XX" + bytes(HEADER.size - 2), "bad magic"),
        (struct.pack("<2sBBHHIQQQ", b"KV", 99, Op.PING, 0, 0, 0, 1, 0, 0), "version"),
        (struct.pack("<2sBBHHIQQQ", b"KV", 1, 77, 0, 0, 0, 1, 0, 0), "unknown op"),
        (struct.pack("<2sBBHHIQQQ", b"KV", 1, Op.PUT_BATCH, 0, 0, 0, 1, 2**60, 0), "exceeds"),
        (struct.pack("<2sBBHHIQQQ", b"KV", 1, Op.GET_BATCH, 0, 0, 2**31, 1, 0, 0), "exceeds"),
        (encode_header(Op.GET_BATCH, 1, b"\x05\x00\x00\x00") + b"\x05\x00\x00\x00", "truncated"),
        (encode_header(Op.GET_BATCH, 1, b"abcd")[:-8] + bytes(8) + b"abcd", "checksum"),
    ],
)
def test_malformed_frame_gets_an_error_frame_and_only_that_connection_closes(node_factory, pool_url, frame, reason):
    node = node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(_chunks("g", 2, 100))
        bad = _raw(node)
        bad.sendall(frame)
        header, message = _read_frame(bad)
        assert header.status == Status.PROTOCOL
        assert reason in message.decode()
        assert _closed(bad)
        bad.close()
        assert client.hit_prefix(["g@0", "g@1"]) == 2
        assert all(g is not None for g in client.get(["g@0", "g@1"]))
    assert node.alive()


def test_other_connections_keep_working_while_one_sends_garbage(node_factory, pool_url):
    node = node_factory()
    good = _raw(node)
    good.sendall(hello_frame(node, "")[1])
    assert _read_frame(good)[0].status == Status.OK
    bad = _raw(node)
    bad.sendall(os.urandom(4096))
    keys = encode_keys(["nothing"])
    good.sendall(encode_header(Op.EXISTS_BATCH, 2, keys) + keys)
    header, body = _read_frame(good)
    assert header.status == Status.OK and body == b"\x01\x00\x00\x00\x00"
    good.close()
    bad.close()
    assert node.alive()


def test_error_for_an_unparsable_header_answers_request_id_zero(node_factory):
    node = node_factory()
    sock = _raw(node)
    sock.sendall(hello_frame(node, "", 41)[1])
    assert _read_frame(sock)[0].request_id == 41
    sock.sendall(b"XX" + bytes(HEADER.size - 2))
    header, message = _read_frame(sock)
    assert header.status == Status.PROTOCOL and header.request_id == 0
    assert b"bad magic" in message
    sock.close()


def test_hello_carrying_data_is_refused(node_factory):
    node = node_factory()
    sock = _raw(node)
    sock.sendall(encode_header(Op.HELLO, 3, b"{}", data_len=5) + b"{}" + b"extra")
    header, message = _read_frame(sock)
    assert header.status == Status.PROTOCOL and b"carries no data" in message
    assert _closed(sock)
    sock.close()


def test_get_larger_than_one_frame_is_split_and_read_whole(node_factory, pool_url, monkeypatch):
    import backend.client.connection as client_module
    from backend.protocol import Limits

    # This client accepts responses of at most 300 KiB; the node would happily send more.
    monkeypatch.setattr(client_module, "DEFAULT_LIMITS", Limits(max_data_bytes=300 * 1024))
    node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        chunks = _chunks("big", 6, 200 * 1024)  # 1.2 MiB: at least four frames each way
        client.put(chunks)
        got = client.get([c.key for c in chunks])
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]
        stats = client.node_stats(client.nodes()[0])
    assert stats["counters"]["hits"] == 6


async def test_cancelling_one_request_does_not_break_the_others_on_its_connection(node_factory, pool_url):
    node_factory()
    config = PoolConfig.from_url(pool_url + "?connections_per_node=1")
    async with PoolClient(config) as client:
        big = _chunks("cb", 8, 2 * 1024 * 1024)
        small = _chunks("cs", 2, 1000)
        await client.put(big + small)
        slow = asyncio.ensure_future(client.get([c.key for c in big]))
        conn = None
        while conn is None:  # cancel once the GET is on the wire, before its answer is back
            await asyncio.sleep(0)
            sets = client.connections.sets()
            conns = [c for s in sets for c in s.connections if any(x.op == Op.GET_BATCH for x in c._pending.values())]
            conn = conns[0] if conns else None
        slow.cancel()
        got = await client.get([c.key for c in small])
        await asyncio.sleep(0.3)  # the cancelled GET's answer has arrived by now
        assert not conn.broken
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in small]
        again = await client.get([c.key for c in big])
        assert all(g is not None for g in again)
        assert client.counters.get("stale_entries", 0) == 0


class _ShortSink:
    """Hands out buffers one byte short, and counts what it handed out and got back."""

    def __init__(self) -> None:
        self.given: list[int] = []
        self.returned: list[int] = []

    async def allocate(self, meta: Any) -> tuple[int, bytearray]:
        self.given.append(len(self.given))
        return self.given[-1], bytearray(meta.nbytes - 1)

    def release(self, handle: int) -> None:
        self.returned.append(handle)


@pytest.mark.parametrize("shm", [False, True])
def test_a_sink_that_gives_the_wrong_size_gets_its_buffers_back_and_the_keys_miss(node_factory, pool_url, shm):
    node_factory(shm=shm)
    with SyncPoolClient(PoolConfig.from_url(pool_url + ("" if shm else "?shm=off"))) as client:
        chunks = _chunks("short", 3, 64 * 1024)
        client.put(chunks)
        sink = _ShortSink()
        got = client._call(client._client.get([c.key for c in chunks], sink))
        assert got == [None, None, None]
        assert sink.given and sorted(sink.returned) == sink.given  # every buffer taken was handed back
        again = client.get([c.key for c in chunks])  # the copies themselves are fine
        assert [bytes(g.data) for g in again] == [c.data for c in chunks]
