"""One client cannot starve the pool: stalled uploads hold little room, and stalled peers hold no thread.

The hostile peer holds the token (it is a client gone wrong, or one that misbehaves on
purpose) and speaks raw frames over its own sockets, from another client host
(127.0.0.2: Linux routes all of 127/8 to loopback) where that matters; the node and
the well-behaved clients are real processes and clients, as everywhere. What is
promised: docs/reliability.md ("A stalled client cannot starve a node"), docs/design-node.md
("Room is reserved as bytes arrive") and docs/protocol.md ("Bulk transfers", "Put options").

``KVPOOL_FULL=1`` (``make faults``) runs the stall for 60 s; ``make test`` runs it for 8 s.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import socket
import statistics
import threading
import time
import uuid
from concurrent.futures import Executor, ThreadPoolExecutor

import pytest

from backend.client import Chunk, SyncPoolClient
from backend.config import PoolConfig
from backend.node.store.intake import AheadBounds
from backend.protocol import ItemMeta, Op, Status, checksum
from backend.protocol.frame import HEADER, decode_header, encode_header
from backend.protocol.meta import encode_keys
from backend.protocol.puts import PutBatch
from backend.transport import FrameSocket
from tests.support.handshake import auth_frame, check_auth_answer, hello_frame
from tests.support.waits import wait_until

FULL = bool(os.environ.get("KVPOOL_FULL"))
TOKEN = "starvation-token-9f2c"
MiB = 1024 * 1024
OTHER_HOST = "127.0.0.2"  # the hostile client's host, apart from the well-behaved clients' 127.0.0.1


# -- the hostile peer's raw frames -----------------------------------------------------
def _frame(op: int, request_id: int, meta: bytes, data_len: int = 0) -> bytes:
    return encode_header(op, request_id, meta, data_len) + meta


def _read_exactly(sock: socket.socket, nbytes: int) -> bytes:
    buf = b""
    while len(buf) < nbytes:
        piece = sock.recv(nbytes - len(buf))
        assert piece, "the node closed the connection"
        buf += piece
    return buf


def _read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    """The next frame's status, request id and meta (its data must be read by the caller)."""
    header = decode_header(_read_exactly(sock, HEADER.size))
    return header.status, header.request_id, _read_exactly(sock, header.meta_len)


def _authenticate(sock: socket.socket, node) -> None:
    """The pool's handshake, as a client holding the token does it (the one place that knows it)."""
    handshake, hello = hello_frame(node, TOKEN)
    sock.sendall(hello)
    sock.sendall(auth_frame(handshake, _read_frame(sock)[2]))
    status, _, meta = _read_frame(sock)
    assert status == Status.OK, meta
    check_auth_answer(handshake, meta)


def _connect(node, source: str = OTHER_HOST, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: a small window
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect((node.host, node.port))
    _authenticate(sock, node)
    return sock


def _stalled_upload(node, nbytes: int, sent: int = 1) -> socket.socket:
    """A PUT_BATCH that declares one chunk of ``nbytes``, sends ``sent`` bytes of it, then goes silent."""
    item = ItemMeta(f"stalled-{uuid.uuid4().hex}", nbytes, 0, "uint8", (nbytes,), 0)
    meta = PutBatch.encode_items([item])
    sock = _connect(node)
    sock.sendall(_frame(Op.PUT_BATCH, 7, meta, nbytes) + bytes(sent))
    return sock


def _stalled_reader(node, key: str) -> socket.socket:
    """A GET_BATCH of a large chunk whose answer is never read (a tiny receive window)."""
    sock = _connect(node, rcvbuf=4096)
    sock.sendall(_frame(Op.GET_BATCH, 7, encode_keys([key])))
    return sock


# -- well-behaved clients --------------------------------------------------------------
def _node(node_factory, dram: str, shm: bool = False):
    return node_factory(dram=dram, env={"KVPOOL_TOKEN": TOKEN}, shm=shm)


def _client(pool_url: str, **options: str) -> SyncPoolClient:
    query = "&".join(f"{k}={v}" for k, v in {"shm": "off", **options}.items())
    url = pool_url.replace("kvpool://", f"kvpool://:{TOKEN}@") + "?" + query
    return SyncPoolClient(PoolConfig.from_url(url))


def _chunks(prefix: str, count: int, size: int) -> list[Chunk]:
    rng = random.Random(prefix)
    return [Chunk(f"{prefix}-{i}", rng.randbytes(size)) for i in range(count)]


def _hits(client: SyncPoolClient, chunks: list[Chunk]) -> int:
    got = client.get([c.key for c in chunks])
    assert all(g is None or bytes(g.data) == c.data for c, g in zip(chunks, got)), "a wrong byte came back"
    return sum(g is not None for g in got)


def _stat(client: SyncPoolClient) -> dict:
    (node,) = client.nodes()
    return client.node_stats(node)


def _dram_used(client: SyncPoolClient) -> int:
    return int(_stat(client)["tiers"]["dram"]["used_bytes"])


# -- room is reserved as bytes arrive ----------------------------------------------------
def test_a_stalled_upload_declaring_the_whole_tier_evicts_nothing_and_refuses_no_other_put(node_factory, pool_url):
    node = _node(node_factory, "256MiB", shm=True)  # DRAM in a shared-memory arena
    earlier = _chunks("earlier", 32, 4 * MiB)  # half the tier
    later = _chunks("later", 8, 4 * MiB)
    bound = AheadBounds.for_dram(256 * MiB).connection_bytes
    with _client(pool_url) as client:
        client.put(earlier)
        stored = _dram_used(client)
        arena_before = _stat(client)["arena"]["allocated_bytes"]
        # Private memory: the arena's shared pages are counted by allocated_bytes, and an arena in use
        # touches pages ahead of its puts on its own time (tests/test_shm.py), stall or no stall.
        private_before = node.memory()["RssAnon"]
        stall = _stalled_upload(node, 256 * MiB)  # the whole DRAM tier, then one byte and silence
        try:
            assert wait_until(lambda: _dram_used(client) > stored), "the node never took the stalled put's header"
            # During the stall: what it holds ahead of its one byte is bounded, in DRAM, arena and memory.
            assert _dram_used(client) - stored <= bound
            assert _stat(client)["arena"]["allocated_bytes"] - arena_before <= bound
            assert node.memory()["RssAnon"] - private_before <= bound + 16 * MiB
            started = time.monotonic()
            client.put(later)  # raises if any chunk is refused (busy or no room)
            assert time.monotonic() - started < 5.0
            assert _hits(client, earlier) >= 0.99 * len(earlier)
            assert _hits(client, later) == len(later)
            assert _stat(client)["counters"].get("evictions", 0) == 0
        finally:
            stall.close()
        # The stalled put gave back what it held: DRAM holds exactly the stored chunks again.
        assert wait_until(lambda: _dram_used(client) == stored + 8 * 4 * MiB)


def test_many_stalled_uploads_from_one_host_hold_no_more_than_that_hosts_bound(node_factory, pool_url):
    node = _node(node_factory, "256MiB")
    earlier = _chunks("earlier", 32, 4 * MiB)
    later = _chunks("later", 8, 4 * MiB)
    bounds = AheadBounds.for_dram(256 * MiB)
    with _client(pool_url) as client:
        client.put(earlier)
        stored = _dram_used(client)
        stalls = [_stalled_upload(node, 256 * MiB) for _ in range(8)]  # 8 x the tier, from one host
        try:
            # As many as the host's bound allows get their room; the rest wait, holding none.
            assert wait_until(lambda: _dram_used(client) - stored >= bounds.host_bytes)
            time.sleep(0.5)  # (what the waiting ones would take, they would take now)
            assert _dram_used(client) - stored <= bounds.host_bytes
            client.put(later)  # another host (127.0.0.1): never waits on 127.0.0.2's bound
            assert _hits(client, earlier) >= 0.99 * len(earlier)
            assert _hits(client, later) == len(later)
        finally:
            for stall in stalls:
                stall.close()
        assert wait_until(lambda: _dram_used(client) == stored + 8 * 4 * MiB)


@pytest.mark.parametrize(
    "sizes, named",
    [
        ([64 * MiB + 1], r"is 67108865 bytes, larger than node \S+'s DRAM tier \(67108864 bytes\)"),
        ([32 * MiB] * 3, r"a put of 3 chunks, 100663296 bytes in all, is larger than node \S+ can ever hold"),
    ],
    ids=["chunk", "batch"],
)
def test_a_put_larger_than_the_node_can_ever_hold_is_refused_at_once_naming_the_sizes(
    node_factory, pool_url, sizes, named
):
    node = _node(node_factory, "64MiB")
    earlier = _chunks("earlier", 8, 4 * MiB)
    with _client(pool_url) as client:
        client.put(earlier)
        items = [ItemMeta(f"huge-{i}", n, 0, "uint8", (n,), 0) for i, n in enumerate(sizes)]
        meta = PutBatch.encode_items(items)
        with _connect(node) as sock:
            # The header alone, not one byte of data: the answer comes before the node reads any.
            sock.sendall(_frame(Op.PUT_BATCH, 9, meta, sum(sizes)))
            status, request_id, message = _read_frame(sock)
            assert (status, request_id) == (Status.CAPACITY, 9)
            assert re.search(named, message.decode()), message
        assert _hits(client, earlier) == len(earlier)  # nothing was evicted for it
        assert _stat(client)["counters"].get("evictions", 0) == 0


# -- no few connections can starve a node -----------------------------------------------
def _frame_socket_pair(bulk: Executor) -> tuple[FrameSocket, socket.socket]:
    """A loopback connection: this side as a FrameSocket with ``bulk`` threads, and the peer's raw socket."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname())
        mine, _ = listener.accept()
    return FrameSocket(mine, asyncio.get_running_loop(), "peer", bulk), peer


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    sock.settimeout(10)
    return _read_exactly(sock, nbytes)


@pytest.mark.timeout(30)  # (the code before turns hung here: a thread polled the silent peer)
async def test_a_bulk_receive_from_a_silent_peer_holds_no_worker_thread():
    payload = os.urandom(4 * MiB)  # a bulk transfer: on a worker thread
    one_thread = ThreadPoolExecutor(1)
    silent_conn, silent_peer = _frame_socket_pair(one_thread)
    busy_conn, busy_peer = _frame_socket_pair(one_thread)
    try:
        silent_target = bytearray(len(payload))
        silent = asyncio.ensure_future(silent_conn.recv_many([silent_target], checksum))
        silent_peer.sendall(payload[:1])  # one byte, then silence
        await asyncio.sleep(0.2)
        assert not silent.done() and not silent_conn.held_up_here()  # the silence is the peer's
        stamp = silent_conn.progress_at
        sending = asyncio.ensure_future(asyncio.to_thread(busy_peer.sendall, payload))
        target = bytearray(len(payload))
        # The only worker thread is free for the other connection: it is not polling the silent one.
        assert await asyncio.wait_for(busy_conn.recv_many([target], checksum), 5) == [checksum(payload)]
        assert target == payload and silent_conn.progress_at == stamp
        await sending
        await asyncio.to_thread(silent_peer.sendall, payload[1:])
        assert await asyncio.wait_for(silent, 5) == [checksum(payload)] and silent_target == payload
    finally:
        for conn, peer in ((silent_conn, silent_peer), (busy_conn, busy_peer)):
            conn.close()  # (wakes a thread still in a transfer)
            peer.close()
        one_thread.shutdown()


@pytest.mark.timeout(30)  # (the code before turns hung here: a thread polled the silent peer)
async def test_a_bulk_send_to_a_peer_that_does_not_read_holds_no_worker_thread():
    stuck_payload, payload = os.urandom(32 * MiB), os.urandom(4 * MiB)
    one_thread = ThreadPoolExecutor(1)
    stuck_conn, stuck_peer = _frame_socket_pair(one_thread)  # it reads nothing until the end: its window stays small
    free_conn, free_peer = _frame_socket_pair(one_thread)
    try:
        stuck = asyncio.ensure_future(stuck_conn.send([stuck_payload]))  # more than both socket buffers hold
        await asyncio.sleep(0.2)
        assert not stuck.done()
        reading = asyncio.ensure_future(asyncio.to_thread(_recv_exactly, free_peer, len(payload)))
        await asyncio.wait_for(free_conn.send([payload]), 5)  # the only worker thread is free for it
        assert await asyncio.wait_for(reading, 5) == payload
        draining = asyncio.ensure_future(asyncio.to_thread(_recv_exactly, stuck_peer, len(stuck_payload)))
        await asyncio.wait_for(stuck, 10)
        assert await asyncio.wait_for(draining, 10) == stuck_payload
    finally:
        for conn, peer in ((stuck_conn, stuck_peer), (free_conn, free_peer)):
            conn.close()
            peer.close()
        one_thread.shutdown()


class StalledPeers:
    """Six connections that stay stalled for a while: three silent uploads and three readers that do not read.

    The node closes a stalled connection after 30 s (``frame_timeout_s``, ``REPLY_TIMEOUT_S``), so
    each is replaced by a fresh one every ``RENEW_S``, the new one opened before the old one closes.
    """

    RENEW_S = 20.0

    def __init__(self, node, big_key: str) -> None:
        self.node = node
        self.big_key = big_key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="stalled-peers", daemon=True)
        self.socks = [self._open(i) for i in range(6)]

    def _open(self, i: int) -> socket.socket:
        return _stalled_upload(self.node, 16 * MiB) if i % 2 == 0 else _stalled_reader(self.node, self.big_key)

    def _renew(self) -> None:
        while not self._stop.wait(self.RENEW_S / len(self.socks)):
            for i, old in enumerate(self.socks):
                if self._stop.is_set():
                    return
                self.socks[i] = self._open(i)
                old.close()
                if self._stop.wait(self.RENEW_S / len(self.socks)):
                    return

    def __enter__(self) -> StalledPeers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for sock in self.socks:
            sock.close()


class Pinger:
    """PINGs over a raw authenticated connection every 20 ms, from the well-behaved clients' host."""

    def __init__(self, node) -> None:
        self.rtts_s: list[float] = []  # each answered PING's round trip
        self.errors: list[BaseException] = []
        self._sock = _connect(node, source="127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ping, name="pinger", daemon=True)

    def _ping(self) -> None:
        request_id = 100
        try:
            while not self._stop.wait(0.02):
                request_id += 1
                started = time.perf_counter()
                self._sock.sendall(_frame(Op.PING, request_id, b""))
                status, answered, _ = _read_frame(self._sock)
                assert (status, answered) == (Status.OK, request_id)
                self.rtts_s.append(time.perf_counter() - started)
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> Pinger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
        self._sock.close()


STALL_S = 60.0 if FULL else 8.0


@pytest.mark.timeout(STALL_S + 120)
def test_six_stalled_connections_do_not_make_a_healthy_node_look_down(node_factory, pool_url):
    node = _node(node_factory, "256MiB")
    chunks = _chunks("served", 8, 4 * MiB)  # every GET answer is a bulk transfer (>= 1 MiB)
    big = _chunks("big", 1, 32 * MiB)[0]  # what the stalled readers ask for and never read
    with _client(pool_url) as client:
        client.put([*chunks, big])
        rounds = 0
        with StalledPeers(node, big.key), Pinger(node) as pinger:
            time.sleep(0.5)  # the stalled uploads have sent their header, the readers their request
            stop_at = time.monotonic() + STALL_S
            while time.monotonic() < stop_at:
                fresh = _chunks(f"fresh{rounds}", 2, 4 * MiB)
                client.put(fresh)  # a bulk receive on the node
                assert _hits(client, [*chunks, *fresh]) == len(chunks) + len(fresh)  # raises on a timeout
                rounds += 1
        assert not pinger.errors and len(pinger.rtts_s) >= STALL_S * 10  # answered all along, at ~20 ms intervals
        p99_ms = statistics.quantiles(pinger.rtts_s, n=100)[98] * 1000
        assert p99_ms < 50, f"PING p99 {p99_ms:.1f} ms over {len(pinger.rtts_s)} pings"
        assert rounds >= STALL_S / 2  # gets and puts kept being served, not just once
        assert client.counters.get("nodes_marked_down", 0) == 0
