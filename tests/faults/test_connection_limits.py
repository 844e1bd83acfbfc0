"""Connections that never finish their handshake: closed at a deadline, capped, and given a small meta.

Raw sockets against real node processes (started with a 1 s handshake deadline, so a
test waits about a second, not the default ten). After each fault the node must still
serve a well-behaved client, and a client's pooled connections, once admitted, must
stay open however long they idle. What is promised: docs/protocol-connections.md, "Connection
limits"; the TLS cases are in tests/security/test_tls_and_tokens.py.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest

from backend.client import Chunk, SyncPoolClient
from backend.config import PoolConfig
from backend.protocol import DEFAULT_LIMITS, Op, Status
from backend.protocol.frame import HEADER, RESPONSE_BIT, Header, decode_header, encode_header
from backend.protocol.meta import encode_keys
from tests.support.handshake import auth_frame, check_auth_answer, hello_frame
from tests.support.waits import wait_until

TOKEN = "limits-token-42-0123456789abcdef"
DEADLINE_S = 1.0
# A close is "at the deadline" between 0.8 of it and this much after it: the shared
# 2-core machine can delay the node's loop, never make it early.
SLACK_S = 3.0
HANDSHAKE_META = DEFAULT_LIMITS.max_handshake_meta_bytes
MIB = 1024 * 1024


def _node(node_factory, *extra: str, token: bool = True):
    env = {"KVPOOL_TOKEN": TOKEN} if token else {}
    return node_factory(*extra, env=env)


def _client(pool_url: str, token: bool = True) -> SyncPoolClient:
    url = pool_url.replace("kvpool://", f"kvpool://:{TOKEN}@") if token else pool_url
    return SyncPoolClient(PoolConfig.from_url(url))


def _connect(node) -> socket.socket:
    return socket.create_connection((node.host, node.port), timeout=10)


def _frame(op: int, request_id: int, meta: bytes) -> bytes:
    return encode_header(op, request_id, meta) + meta


def _read_frame(sock: socket.socket) -> tuple[Header, bytes]:
    buf = b""
    while len(buf) < HEADER.size:
        piece = sock.recv(HEADER.size - len(buf))
        assert piece, "the node closed instead of answering"
        buf += piece
    header = decode_header(buf)
    meta = b""
    while len(meta) < header.meta_len:
        piece = sock.recv(header.meta_len - len(meta))
        assert piece, "the node closed in the middle of its answer"
        meta += piece
    return header, meta


def _authenticate(sock: socket.socket, node) -> None:
    handshake, hello = hello_frame(node, TOKEN)
    sock.sendall(hello)
    sock.sendall(auth_frame(handshake, _read_frame(sock)[1]))
    check_auth_answer(handshake, _read_frame(sock)[1])


def _closed_at(sock: socket.socket, opened_at: float, wait_s: float) -> float | None:
    """Seconds from ``opened_at`` until the node closed ``sock`` (FIN or reset); None if still open after ``wait_s``."""
    stop_at = time.monotonic() + wait_s
    while True:
        left = stop_at - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            if sock.recv(65536):
                continue  # an answer (a HELLO's): read on until the close
        except TimeoutError:
            return None
        except ConnectionResetError:
            pass
        return time.monotonic() - opened_at


def _still_answers(sock: socket.socket, request_id: int) -> bool:
    sock.sendall(_frame(Op.PING, request_id, b""))
    header, _ = _read_frame(sock)
    return header.status == Status.OK and header.request_id == request_id


def _round_trip(client: SyncPoolClient) -> None:
    key, payload = f"after-{uuid.uuid4().hex}", os.urandom(4096)
    client.put([Chunk(key, payload)])
    got = client.get([key])[0]
    assert got is not None and bytes(got.data) == payload


def _counters(client: SyncPoolClient) -> dict[str, int]:
    return client.node_stats(client.nodes()[0])["counters"]


# -- the deadline --------------------------------------------------------------------------
def test_connections_that_do_not_finish_the_handshake_are_closed_at_the_deadline_and_counted(node_factory, pool_url):
    node = _node(node_factory, "--handshake-timeout-s", str(DEADLINE_S))
    hello = hello_frame(node, TOKEN)[1]
    sends = {
        "silent": b"",
        "one byte": b"K",
        "part of a header": hello[: HEADER.size // 2],
        "a header and part of its meta": hello[: HEADER.size + 3],
        "HELLO without AUTH": hello,
    }
    opened = {}
    for name, data in sends.items():
        sock = _connect(node)
        opened[name] = (sock, time.monotonic())
        sock.sendall(data)
    try:
        for name, (sock, opened_at) in opened.items():
            closed_s = _closed_at(sock, opened_at, DEADLINE_S + SLACK_S)
            assert closed_s is not None, f"{name}: still open {DEADLINE_S + SLACK_S:.0f} s after its accept"
            assert closed_s >= 0.8 * DEADLINE_S, f"{name}: closed after {closed_s:.2f} s, before the deadline"
    finally:
        for sock, _ in opened.values():
            sock.close()
    with _client(pool_url) as client:
        _round_trip(client)
        assert _counters(client)["handshake_timeouts"] == len(sends)
    # Counted one by one, logged once a minute at most.
    assert node.log.count("did not finish its handshake") == 1, node.log[-3000:]


@pytest.mark.parametrize("token", [True, False], ids=["token", "no-token"])
def test_admitted_connections_idle_past_the_deadline_stay_open(node_factory, pool_url, token):
    """A pool keeps its connections after their first frame (no token) or AUTH (token), as long as it likes."""
    node = _node(node_factory, "--handshake-timeout-s", str(DEADLINE_S), token=token)
    raw = _connect(node)
    if token:
        _authenticate(raw, node)
    else:
        raw.sendall(hello_frame(node, "")[1])  # a kvpool client's first frame
        _read_frame(raw)
    silent, silent_opened_at = _connect(node), time.monotonic()
    with raw, silent, _client(pool_url, token=token) as client:
        _round_trip(client)
        accepted = _counters(client)["connections_accepted"]
        assert _closed_at(silent, silent_opened_at, DEADLINE_S + SLACK_S) is not None  # the deadline runs here
        time.sleep(DEADLINE_S)  # the admitted ones are now well past it
        assert _still_answers(raw, 9)
        _round_trip(client)
        counters = _counters(client)
        assert counters["connections_accepted"] == accepted, "the client had to reconnect"
        assert counters["handshake_timeouts"] == 1  # the silent one only


# -- the meta limit ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "authed"),
    [(Op.HELLO, False), (Op.AUTH, False), (Op.EXISTS_BATCH, False), (Op.HELLO, True)],
    ids=["hello", "auth", "a request before auth", "hello after auth"],
)
def test_a_meta_over_the_handshake_limit_is_refused_from_the_header(node_factory, pool_url, op, authed):
    node = _node(node_factory)
    with _connect(node) as sock:
        if authed:
            _authenticate(sock, node)
            # Admitted, a connection may send a meta of any size up to max_meta_bytes.
            keys = encode_keys([f"k{i:04d}-{'x' * 40}" for i in range(200)])
            assert len(keys) > HANDSHAKE_META
            sock.sendall(_frame(Op.EXISTS_BATCH, 5, keys))
            header, _ = _read_frame(sock)
            assert (header.status, header.request_id) == (Status.OK, 5)
        # Only the header: the node refuses it unread (unread bytes would turn its close into a reset).
        sock.sendall(HEADER.pack(b"KV", 1, op, 0, 0, HANDSHAKE_META + 1, 77, 0, 0))
        header, message = _read_frame(sock)
        assert (header.status, header.op, header.request_id) == (Status.PROTOCOL, op | RESPONSE_BIT, 77)
        assert f"meta section of {HANDSHAKE_META + 1} bytes exceeds {HANDSHAKE_META}" in message.decode()
        assert _closed_at(sock, time.monotonic(), 5.0) is not None
    with _client(pool_url) as client:
        _round_trip(client)


def test_stalled_4_mib_hellos_before_auth_do_not_grow_the_node(node_factory, pool_url):
    """60 connections declare a 4 MiB HELLO and send 1 MiB of it: refused at the header, nothing held."""
    node = _node(node_factory)
    with _client(pool_url) as client:
        _round_trip(client)  # warm up every path before measuring
        before = node.memory()["VmRSS"]
        peers = []
        try:
            for i in range(60):
                sock = _connect(node)
                peers.append(sock)
                try:
                    sock.sendall(HEADER.pack(b"KV", 1, Op.HELLO, 0, 0, DEFAULT_LIMITS.max_meta_bytes, i, 0, 0))
                    sock.settimeout(0.5)
                    sock.sendall(b"{" + bytes(MIB))
                except OSError:
                    pass  # refused and closed already: the rest of the meta is not wanted
            assert wait_until(lambda: _counters(client).get("protocol_errors", 0) == 60)
            grown = node.memory()["VmRSS"] - before
            assert grown < 16 * MIB, f"60 stalled HELLOs grew the node by {grown / MIB:.0f} MiB"
        finally:
            for sock in peers:
                sock.close()
        _round_trip(client)


# -- the cap on pending connections ------------------------------------------------------
def test_beyond_the_cap_the_oldest_pending_connections_are_closed_and_clients_still_get_in(node_factory, pool_url):
    cap, extra = 8, 12
    node = _node(node_factory, "--max-pending-connections", str(cap))  # the default 10 s deadline
    silent = []
    try:
        for _ in range(cap + extra):
            silent.append(_connect(node))
            time.sleep(0.01)  # accepted, and counted, in this order
        started = time.monotonic()
        closed = [_closed_at(sock, started, 0.3 if i >= extra else 3.0) is not None for i, sock in enumerate(silent)]
        assert closed == [True] * extra + [False] * cap, "the oldest pending ones go first, the cap stays open"
        # The cap is full of silent peers; a client still connects and authenticates (shedding the oldest).
        with _client(pool_url) as client:
            _round_trip(client)
            shed = _counters(client)["connections_shed"]
        newly_closed = sum(_closed_at(sock, started, 0.3) is not None for sock in silent[extra:])
        assert newly_closed >= 1 and shed == extra + newly_closed
        assert all(_closed_at(sock, started, 0.3) is None for sock in silent[extra + newly_closed :])
    finally:
        for sock in silent:
            sock.close()
    assert node.log.count("connections without a finished handshake") == 1, node.log[-3000:]
