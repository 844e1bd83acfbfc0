"""The node's parts, each built from a NodeContext with real tiers and a small fake index (no Redis, no process).

What a node does end to end is proven by the process tests (test_pool.py, test_put_room.py,
test_staged_put.py, ...); these show that each part runs on what it is handed: a context and
the parts it uses, never the node process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from backend.config import NodeConfig
from backend.errors import CapacityError, MetadataError, NodeUnavailable
from backend.metadata import Beat, ClaimHolder, Location, NodeInfo, Quotas, RedisMemory
from backend.node.context import NodeContext
from backend.node.index.publisher import Advert, IndexPublisher
from backend.node.index.republish import Republisher
from backend.node.memory.arena import room_of
from backend.node.serve.ops import OpTable
from backend.node.serve.peer import Answer, Reply, Request, host_of
from backend.node.serve.puts import PutReceiver
from backend.node.stats import NodeStats
from backend.node.store.dram import StoredChunk
from backend.node.store.intake import AheadBounds
from backend.node.store.tiers import DRAM, TierConfig, TierManager
from backend.protocol import ItemMeta, Op, checksum
from backend.protocol.frame import Header
from backend.protocol.meta import decode_flags, decode_json, encode_keys
from backend.protocol.puts import PUT_BUSY, PUT_INTEGRITY, PUT_STORED, PutBatch, PutOptions
from backend.protocol.reads import LEASE_MAP, Lease, Release
from backend.shm import ArenaView
from backend.transport import Buffer, FrameSocket

DRAM_BYTES = 4 << 20
NODE_ID = "unit-node"


class FakeIndex:
    """The index a node's parts write to (``NodeIndex``), kept in lists; ``fail``/``fail_removes`` make calls raise."""

    def __init__(self) -> None:
        self.committed: list[tuple[str, Location]] = []
        self.removed: list[tuple[str, int, list[str]]] = []
        self.moved: list[tuple[str, Location]] = []
        self.beats: list[NodeInfo] = []
        self.epochs = 41
        self.fail = False
        self.fail_removes = False

    async def commit(self, locations: Sequence[tuple[str, Location]], timeout_s: float | None = None) -> None:
        if self.fail:
            raise MetadataError("index commit failed: Redis is away (injected)")
        self.committed += locations

    async def remove(self, node_id: str, epoch: int, keys: Sequence[str]) -> None:
        if self.fail_removes:
            raise MetadataError("index remove failed: Redis is away (injected)")
        self.removed.append((node_id, epoch, list(keys)))

    def withdrawn(self) -> list[tuple[str, int, list[str]]]:
        """The removes that named any key (a flush with nothing to withdraw still calls remove)."""
        return [call for call in self.removed if call[2]]

    async def move(self, locations: Sequence[tuple[str, Location]]) -> None:
        self.moved += locations

    async def remove_stale(self, stale: Sequence[tuple[str, Location]]) -> None:
        self.removed.append(("", 0, [key for key, _ in stale]))

    async def ensure_marker(self) -> str:
        return "generation-1"

    async def ensure_epoch_at_least(self, epoch: int) -> None:
        self.epochs = max(self.epochs, epoch)

    async def new_epoch(self) -> int:
        self.epochs += 1
        return self.epochs

    async def heartbeat(
        self, info: NodeInfo, ttl_ms: int, changed: bool = False, holder: ClaimHolder | None = None
    ) -> Beat:
        self.beats.append(info)
        return Beat("generation-1", registered_anew=False)

    async def memory(self) -> RedisMemory:
        return RedisMemory(0, 0, "noeviction")

    async def quotas(self) -> Quotas:
        return Quotas()

    async def exchange_tenant_bytes(self, node_id: str, held: Mapping[str, int], ttl_ms: int) -> dict[str, int]:
        return dict.fromkeys(held, 0)


@dataclass
class Parts:
    ctx: NodeContext
    index: FakeIndex
    stats: NodeStats
    publisher: IndexPublisher
    puts: PutReceiver
    ops: OpTable


@dataclass(eq=False)  # hashed by identity, as a session is: a lease's owner
class WirePeer:
    """A ``Peer`` over a loopback connection, as a session is one; the answers handed to it kept, not run."""

    conn: FrameSocket
    answers: list[tuple[Request, Answer]] = field(default_factory=list)
    tenant: str | None = None  # the pool token's connection: every key (node/tenancy.py)

    @property
    def host(self) -> str:
        return host_of(self.conn.peer)

    @property
    def closed(self) -> bool:
        return self.conn.closed

    async def recv_data(self, targets: Sequence[Buffer | int], digest: Callable[[Any], int] | None = None) -> list[int]:
        return await self.conn.recv_many(targets, digest)

    def stage(self, name: str, token: str) -> ArenaView:
        raise AssertionError("no op here maps a stage")

    async def answer(self, request: Request, work: Answer) -> None:
        self.answers.append((request, work))


def _request(op: int, meta: bytes | bytearray, data_len: int = 0) -> Request:
    return Request(Header(op, 0, 0, len(meta), 1, data_len, 0), bytearray(meta), 0.0)


async def _ask(parts: Parts, op: int, meta: bytearray, peer: WirePeer) -> Reply:
    """``op``'s answer to ``meta`` from the op table, as a session's request gets it."""
    await parts.ops.handle(_request(op, meta), peer)
    ((request, work),) = peer.answers
    peer.answers.clear()
    assert request.op == op
    return await work()


@contextlib.asynccontextmanager
async def _wired(dram_bytes: int, shm_dir: Path | None) -> AsyncIterator[Parts]:
    """A node's parts, wired as ``PoolNode.__init__`` wires them, joined as node ``NODE_ID``."""
    config = NodeConfig(redis_url="redis://unused:1", namespace="unit", dram_bytes=dram_bytes)
    index = FakeIndex()
    ctx = NodeContext(config, TierManager(TierConfig(dram_bytes=dram_bytes, shm_dir=shm_dir)), index)
    stats = NodeStats(ctx)
    publisher = IndexPublisher(ctx, stats)
    puts = PutReceiver(ctx, publisher)
    ops = OpTable(ctx, stats, publisher, puts)
    ctx.joined(NODE_ID, await index.new_epoch(), "127.0.0.1:1")  # as PoolNode.start does once it claimed the id
    await publisher.join(Advert("127.0.0.1", 7000))
    yield Parts(ctx, index, stats, publisher, puts, ops)
    await ctx.cancel_tasks()
    await ctx.tiers.close()
    ctx.bulk.shutdown(wait=False)


@pytest.fixture(params=["private", "arena"])
async def parts(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Parts]:
    """A node's parts. Its DRAM is private memory, or a shared-memory arena (in ``tmp_path``) clients on the host map."""
    async with _wired(DRAM_BYTES, tmp_path if request.param == "arena" else None) as wired:
        yield wired


ROOMY_DRAM_BYTES = 64 << 20  # windows of 8 MiB ahead of the bytes, 16 MiB per client host (AheadBounds)


@pytest.fixture
async def roomy() -> AsyncIterator[Parts]:
    """The parts of a node with 64 MiB of DRAM in private memory, with bulk worker threads."""
    async with _wired(ROOMY_DRAM_BYTES, None) as wired:
        yield wired


def _pair(peer: str, bulk: Executor | None = None) -> tuple[FrameSocket, socket.socket]:
    """A loopback TCP connection: the node's end as a FrameSocket (its peer named ``peer``), and the client's raw socket."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client_end = socket.create_connection(listener.getsockname())
        node_end, _ = listener.accept()
    return FrameSocket(node_end, asyncio.get_running_loop(), peer, bulk), client_end


@pytest.fixture
async def wire() -> AsyncIterator[tuple[FrameSocket, socket.socket]]:
    """A loopback TCP connection: the node's end as a FrameSocket, and the client's raw socket."""
    conn, client_end = _pair("unit-peer")
    yield conn, client_end
    conn.close()
    client_end.close()


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "the condition never came"
        await asyncio.sleep(0.01)


def _item(key: str, payload: bytes) -> ItemMeta:
    return ItemMeta(key, len(payload), checksum(payload), "uint8", (len(payload),), 0)


async def _stored(parts: Parts, conn: FrameSocket, client: socket.socket, chunks: dict[str, bytes]) -> None:
    """Put ``chunks`` through the put path (received off the socket, then committed)."""
    client.sendall(b"".join(chunks.values()))
    received = await parts.puts.receive(WirePeer(conn), [_item(k, v) for k, v in chunks.items()], PutOptions())
    await parts.puts.commit(received)


# -- the put path (puts.py) ------------------------------------------------------------
async def test_put_chunks_are_held_after_the_receive_but_indexed_only_by_the_commit(parts, wire):
    conn, client = wire
    chunks = {"a": b"x" * 1000, "b": bytes(range(256)) * 8}
    client.sendall(b"".join(chunks.values()))

    received = await parts.puts.receive(WirePeer(conn), [_item(k, v) for k, v in chunks.items()], PutOptions())

    assert [(flag, item.key) for flag, item, _ in received] == [(PUT_STORED, "a"), (PUT_STORED, "b")]
    assert all(parts.ctx.tiers.holds(k, checksum(v)) for k, v in chunks.items())
    assert parts.index.committed == []  # not visible before the commit
    meta, data = await parts.puts.commit(received)
    assert decode_flags(meta, 2) == [PUT_STORED, PUT_STORED] and data == []
    assert parts.index.committed == [
        (k, Location(NODE_ID, 42, DRAM, len(v), checksum(v))) for k, v in chunks.items()
    ]  # under the identity the node joined with
    assert parts.ctx.counters["puts"] == 2 and parts.ctx.counters["put_bytes"] == 1000 + 2048
    got = await parts.ctx.tiers.get("b")
    assert got is not None and bytes(got.buffer) == chunks["b"]


async def test_a_chunk_whose_bytes_fail_their_checksum_is_refused_and_not_kept(parts, wire):
    conn, client = wire
    good, bad = b"g" * 500, b"b" * 500
    items = [_item("good", good), ItemMeta("bad", len(bad), checksum(bad) ^ 1, "uint8", (len(bad),), 0)]
    client.sendall(good + bad)

    meta, _ = await parts.puts.commit(await parts.puts.receive(WirePeer(conn), items, PutOptions()))

    assert decode_flags(meta, 2) == [PUT_STORED, PUT_INTEGRITY]
    assert not parts.ctx.tiers.contains("bad") and [k for k, _ in parts.index.committed] == ["good"]
    assert parts.ctx.counters["integrity_failures"] == 1
    # The refused chunk's reservation is released; the good one is counted at the room it occupies.
    assert parts.ctx.tiers.dram_used_bytes == room_of(len(good)) == 512


async def test_a_chunk_larger_than_dram_is_refused_before_anything_is_reserved(parts, wire):
    conn, client = wire
    huge, small = bytes(DRAM_BYTES + 1), b"s" * 100
    client.sendall(small)

    with pytest.raises(
        CapacityError, match=rf"'huge' is {DRAM_BYTES + 1} bytes, larger than .* \({DRAM_BYTES} bytes\)"
    ):
        await asyncio.wait_for(
            parts.puts.receive(WirePeer(conn), [_item("huge", huge), _item("small", small)], PutOptions()), 10
        )

    assert parts.ctx.tiers.dram_used_bytes == 0 and len(parts.ctx.tiers) == 0  # nothing reserved, nothing read
    received = await parts.puts.receive(WirePeer(conn), [_item("small", small)], PutOptions())
    assert [flag for flag, _, _ in received] == [PUT_STORED]


async def test_a_put_holds_room_for_at_most_one_window_beyond_the_bytes_it_received(roomy):
    window = AheadBounds.for_dram(ROOMY_DRAM_BYTES).connection_bytes
    payload = os.urandom(5 * window)  # declared 40 MiB: it comes in five parts
    conn, client = _pair("10.0.0.1:5000", roomy.ctx.bulk)
    tiers = roomy.ctx.tiers
    try:
        task = asyncio.ensure_future(roomy.puts.receive(WirePeer(conn), [_item("large", payload)], PutOptions()))
        client.sendall(payload[:1])
        await _until(lambda: tiers.dram_used_bytes > 0)
        await asyncio.sleep(0.05)
        assert tiers.dram_used_bytes == window  # one part's room, not the 40 MiB declared
        await asyncio.to_thread(client.sendall, payload[1 : window + 1])  # the first part, and a byte of the next
        await _until(lambda: tiers.dram_used_bytes == 2 * window)
        await asyncio.sleep(0.05)
        assert tiers.dram_used_bytes == 2 * window and roomy.puts.ahead.held("10.0.0.1") == window
        await asyncio.to_thread(client.sendall, payload[window + 1 :])
        received = await asyncio.wait_for(task, 10)
    finally:
        conn.close()
        client.close()
    assert [flag for flag, _, _ in received] == [PUT_STORED]  # verified whole, over its parts
    assert tiers.dram_used_bytes == len(payload) and roomy.puts.ahead.held("10.0.0.1") == 0
    got = await tiers.get("large")
    assert got is not None and bytes(got.buffer) == payload


async def test_a_chunk_received_in_parts_is_verified_whole_and_a_mismatch_gives_its_room_back(roomy):
    payload = os.urandom(3 * AheadBounds.for_dram(ROOMY_DRAM_BYTES).connection_bytes)
    item = ItemMeta("bad", len(payload), checksum(payload) ^ 1, "uint8", (len(payload),), 0)
    conn, client = _pair("10.0.0.1:5000", roomy.ctx.bulk)
    try:
        sending = asyncio.ensure_future(asyncio.to_thread(client.sendall, payload))
        received = await asyncio.wait_for(roomy.puts.receive(WirePeer(conn), [item], PutOptions()), 10)
        await sending
    finally:
        conn.close()
        client.close()
    assert [flag for flag, _, _ in received] == [PUT_INTEGRITY]
    assert roomy.ctx.tiers.dram_used_bytes == 0 and len(roomy.ctx.tiers) == 0


async def test_one_hosts_puts_share_one_bound_of_room_ahead_and_another_host_never_waits_on_it(roomy):
    bounds = AheadBounds.for_dram(ROOMY_DRAM_BYTES)  # 8 MiB a connection, 16 MiB a host
    peers = ["10.0.0.1:1", "10.0.0.1:2", "10.0.0.1:3", "10.0.0.2:1"]
    pairs = [_pair(peer, roomy.ctx.bulk) for peer in peers]
    tiers = roomy.ctx.tiers
    tasks = []
    for n, (conn, client) in enumerate(pairs):
        item = ItemMeta(f"stalled-{n}", 40 << 20, 0, "uint8", (40 << 20,), 0)
        tasks.append(asyncio.ensure_future(roomy.puts.receive(WirePeer(conn), [item], PutOptions(wait_ms=10_000))))
        client.sendall(b"x")  # one byte, then silence
    await _until(lambda: tiers.dram_used_bytes == 3 * bounds.connection_bytes)
    await asyncio.sleep(0.1)
    # 10.0.0.1: two windows (its bound), its third request waits holding nothing; 10.0.0.2: its own window.
    assert tiers.dram_used_bytes == 3 * bounds.connection_bytes
    ahead = roomy.puts.ahead
    assert (ahead.held("10.0.0.1"), ahead.held("10.0.0.2")) == (bounds.host_bytes, bounds.connection_bytes)
    for _, client in pairs:
        client.close()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    assert all(isinstance(outcome, NodeUnavailable) for outcome in outcomes)  # the peers went away mid-frame
    assert tiers.dram_used_bytes == 0 and ahead.held("10.0.0.1") == ahead.held("10.0.0.2") == 0
    for conn, _ in pairs:
        conn.close()


async def test_a_chunk_evicted_before_its_commit_is_answered_busy_and_not_indexed(parts, wire):
    # A request that waited for room let its received chunks move; other puts in flight may evict
    # them. Such a chunk is never acknowledged, and the answer is busy (the pressure passes), not
    # no room: a soak of 32 clients once failed on the no-room answer.
    conn, client = wire
    kept, evicted = b"k" * 1000, b"e" * 1000
    client.sendall(kept + evicted)
    received = await parts.puts.receive(WirePeer(conn), [_item("kept", kept), _item("evicted", evicted)], PutOptions())
    gone = next(chunk for _, item, chunk in received if item.key == "evicted")
    assert gone is not None
    parts.ctx.tiers.settle([gone])
    await parts.ctx.tiers.discard(gone)  # stands in for an eviction by another put during the wait

    meta, _ = await parts.puts.commit(received)

    assert decode_flags(meta, 2) == [PUT_STORED, PUT_BUSY]
    assert [k for k, _ in parts.index.committed] == ["kept"]
    assert parts.ctx.counters["put_rejected_busy"] == 1 and parts.ctx.counters["put_rejected_capacity"] == 0


async def test_a_put_whose_index_commit_fails_leaves_nothing_behind(parts, wire):
    conn, client = wire
    payload = b"p" * 4096
    client.sendall(payload)
    received = await parts.puts.receive(WirePeer(conn), [_item("lost", payload)], PutOptions())
    parts.index.fail = True

    with pytest.raises(MetadataError):
        await parts.puts.commit(received)

    assert not parts.ctx.tiers.contains("lost")  # never acknowledged, so not kept
    assert parts.ctx.tiers.dram_used_bytes == 0 and parts.ctx.counters["puts"] == 0


async def test_a_put_whose_socket_closes_mid_chunk_keeps_none_of_its_chunks(parts, wire):
    conn, client = wire
    first, second = b"1" * 1000, b"2" * 1000
    client.sendall(first + second[:10])
    client.shutdown(socket.SHUT_WR)

    with pytest.raises(Exception):  # noqa: B017 - the transport's error for a peer gone mid-frame
        await parts.puts.receive(WirePeer(conn), [_item("first", first), _item("second", second)], PutOptions())

    assert len(parts.ctx.tiers) == 0 and parts.ctx.tiers.dram_used_bytes == 0


# -- op handlers (ops.py, leases.py) ------------------------------------------------------
async def test_lease_pins_the_keys_held_and_answers_misses_for_the_rest(parts, wire):
    conn, client = wire
    await _stored(parts, conn, client, {"held": b"h" * 2048})
    peer = WirePeer(conn)

    meta, _ = await _ask(parts, Op.LEASE, bytearray(Lease.encode_request(["held", "absent"], 5000, 0)), peer)

    lease_id, found = Lease.decode_answer(meta, ["held", "absent"])
    assert lease_id > 0 and parts.ctx.tiers.upkeep.report().leases == 1
    assert found[0] is not None and found[0][0].key == "held" and found[0][1] is None  # a lock only: no offset
    assert found[1] is None
    released, _ = await _ask(parts, Op.RELEASE, bytearray(Release.encode_request(lease_id)), peer)
    assert decode_json(released) == {"released": 1} and parts.ctx.tiers.upkeep.report().leases == 0


async def test_a_mapped_lease_answers_the_chunks_offset_in_the_arena_and_counts_each_key_as_a_get(parts, wire):
    conn, client = wire
    payload = bytes(range(256)) * 2
    await _stored(parts, conn, client, {"k": payload})

    request = bytearray(Lease.encode_request(["k", "absent"], 5000, LEASE_MAP))
    meta, _ = await _ask(parts, Op.LEASE, request, WirePeer(conn))

    _, found = Lease.decode_answer(meta, ["k", "absent"])
    assert found[0] is not None and found[1] is None
    arena = parts.ctx.tiers.shm_arena
    if arena is None:
        assert found[0][1] is None  # private memory: read it over TCP
    else:
        offset = found[0][1]
        assert offset is not None
        with open(arena.path, "rb") as shared:  # what a client on this host copies out of the arena
            shared.seek(offset)
            assert shared.read(len(payload)) == payload
        assert parts.ctx.counters["shm_get_bytes"] == len(payload)
    assert (parts.ctx.counters["gets"], parts.ctx.counters["hits"], parts.ctx.counters["misses"]) == (2, 1, 1)


async def test_a_lease_for_a_connection_that_closed_meanwhile_is_released_at_once(parts, wire):
    conn, client = wire
    await _stored(parts, conn, client, {"held": b"h" * 100})
    conn.close()  # its session's teardown (release_owner) has already run

    await _ask(parts, Op.LEASE, bytearray(Lease.encode_request(["held"], 5000, 0)), WirePeer(conn))

    assert parts.ctx.tiers.upkeep.report().leases == 0  # nobody is left to release it


async def test_delete_drops_the_chunks_and_withdraws_them_under_the_nodes_identity(parts, wire):
    conn, client = wire
    await _stored(parts, conn, client, {"gone": b"g" * 100, "kept": b"k" * 100})

    meta, _ = await _ask(parts, Op.DELETE_BATCH, bytearray(encode_keys(["gone", "never"])), WirePeer(conn))

    assert decode_flags(meta, 2) == [1, 0]
    assert parts.index.withdrawn() == [(NODE_ID, 42, ["gone"])]
    assert not parts.ctx.tiers.contains("gone") and parts.ctx.tiers.contains("kept")


async def test_ping_and_stat_answer_the_identity_the_node_joined_with(parts, wire):
    conn, _ = wire
    parts.stats.count_also(Counter({"collected_nodes": 3}))  # a part that keeps its own counters

    ping, _ = await _ask(parts, Op.PING, bytearray(), WirePeer(conn))
    stat, _ = await _ask(parts, Op.STAT, bytearray(), WirePeer(conn))

    assert decode_json(ping) == {"node_id": NODE_ID, "epoch": 42}
    report = decode_json(stat)
    assert (report["node_id"], report["epoch"]) == (NODE_ID, 42)
    assert report["counters"]["collected_nodes"] == 3


async def test_channel_get_on_a_node_without_a_channel_is_refused(parts, wire):
    from backend.errors import ProtocolError

    conn, _ = wire
    with pytest.raises(ProtocolError, match="serves no channel"):
        await _ask(parts, Op.CHANNEL_GET, bytearray(), WirePeer(conn))


# -- the op table (ops.py) ---------------------------------------------------------------
async def test_every_request_op_but_hello_and_auth_has_a_handler_and_only_put_batch_carries_data(parts):
    handled = {op for op in Op if op not in (Op.HELLO, Op.AUTH)}

    assert set(parts.ops.table) == handled
    assert [op for op in Op if parts.ops.carries_data(op)] == [Op.PUT_BATCH]


async def test_an_op_that_is_not_a_request_is_answered_as_a_protocol_error(parts, wire):
    from backend.errors import ProtocolError

    conn, _ = wire
    with pytest.raises(ProtocolError, match="op 99 is not a request"):
        await _ask(parts, 99, bytearray(), WirePeer(conn))


async def test_a_put_batch_takes_its_bytes_in_its_handler_and_commits_them_in_its_answer(parts, wire):
    conn, client = wire
    chunks = {"a": b"a" * 1000, "b": bytes(range(256)) * 4}
    items = [_item(k, v) for k, v in chunks.items()]
    peer = WirePeer(conn)
    client.sendall(b"".join(chunks.values()))

    await parts.ops.handle(_request(Op.PUT_BATCH, PutBatch.encode_request(items, PutOptions()), 2024), peer)

    # In stream order: every byte is off the connection and held when the handler returns ...
    assert all(parts.ctx.tiers.holds(k, checksum(v)) for k, v in chunks.items())
    assert parts.index.committed == []  # ... but committed only by its answer
    ((_, work),) = peer.answers
    meta, _ = await work()
    assert decode_flags(meta, 2) == [PUT_STORED, PUT_STORED]
    assert [key for key, _ in parts.index.committed] == ["a", "b"]


async def test_a_put_batch_larger_than_the_node_is_answered_before_its_bytes_are_read_past(parts, wire):
    conn, client = wire
    huge = _item("huge", b"h" * (DRAM_BYTES + 1))
    peer = WirePeer(conn)
    handled = asyncio.ensure_future(
        parts.ops.handle(_request(Op.PUT_BATCH, PutBatch.encode_request([huge], PutOptions()), huge.nbytes), peer)
    )

    await _until(lambda: len(peer.answers) == 1)  # not one byte sent yet
    assert not handled.done()  # still reading past its bytes, so the stream stays in step
    with pytest.raises(CapacityError, match="larger than node"):
        await peer.answers[0][1]()
    client.sendall(b"h" * huge.nbytes)
    await asyncio.wait_for(handled, 10)
    assert parts.ctx.tiers.dram_used_bytes == 0


# -- the publisher (publisher.py) ----------------------------------------------------
async def test_join_takes_the_identity_and_the_heartbeat_advertises_it(parts):
    info = parts.index.beats[-1]
    assert (parts.ctx.node_id, parts.ctx.epoch) == (NODE_ID, 42)
    assert (info.node_id, info.epoch, info.host, info.port) == (NODE_ID, 42, "127.0.0.1", 7000)
    assert info.capacity_bytes == parts.ctx.tiers.capacity_bytes


async def test_an_eviction_whose_index_flush_fails_is_withdrawn_by_the_next_flush(parts, wire):
    conn, client = wire
    await _stored(parts, conn, client, {"old": b"o" * (3 << 20)})
    parts.index.fail_removes = True
    await _stored(parts, conn, client, {"new": b"n" * (3 << 20)})  # evicts "old"; the put's own flush fails
    assert not parts.ctx.tiers.contains("old") and parts.index.withdrawn() == []

    parts.index.fail_removes = False
    await parts.publisher.flush_index()

    assert parts.index.withdrawn() == [(NODE_ID, 42, ["old"])]


async def test_a_loss_during_a_republish_resumes_the_walk_where_it_stands_and_round_to_it(roomy):
    """The walk, 4 keys a batch: Redis is lost again while its third batch is in flight. Every key is then
    published again, once each, from the key where the walk stood (that batch again: it may have landed
    before the loss), round past the last key and back to it."""
    tiers, index = roomy.ctx.tiers, roomy.index
    keys = [f"k{i:02d}" for i in range(25)]
    for key in keys:
        await tiers.reserve(tiers.room_of(1))  # DRAM counts a chunk at the room it occupies
        tiers.insert(StoredChunk(_item(key, b"x"), memoryview(bytearray(b"x"))))
    in_flight, go_on = asyncio.Event(), asyncio.Event()
    commit = index.commit

    async def third_batch_waits(locations: Sequence[tuple[str, Location]], timeout_s: float | None = None) -> None:
        await commit(locations, timeout_s)
        if len(index.committed) == 12:
            in_flight.set()
            await go_on.wait()

    index.commit = third_batch_waits  # type: ignore[method-assign]
    walk = Republisher(roomy.ctx, roomy.stats, batch_keys=4)
    index.committed.clear()
    walk.restart("the namespace was missing in Redis")
    await asyncio.wait_for(in_flight.wait(), 5)
    walk.restart("the namespace was missing in Redis")  # lost again, k08..k11 in flight
    go_on.set()
    await _until(lambda: not walk.running)
    again = [key for key, _ in index.committed[12:]]
    assert again == keys[8:] + keys[:8]  # every key once, from where it stood, round to it
    assert roomy.stats.republish.published == len(keys) and not roomy.stats.republish.running
    assert roomy.ctx.counters["republished"] == 8 + len(keys)  # the batch in flight counted once, after
