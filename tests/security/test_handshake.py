"""The mutual handshake (backend/handshake.py, docs/protocol-connections.md "Authentication"): a node and a
client each prove the pool token to the other, over both nonces, the node the client meant and
the address it dialled, so a relayed handshake is refused and a listener without the token is
refused by the client before it sends anything but its HELLO.

The attacker's side is a real listener on a real socket (a relay to a real node, or an
impostor answering HELLO itself), the victim a real kvpool client, the node a real process.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from backend.client.connection import NodeConnection
from backend.handshake import (
    CLIENT_PROVES,
    NODE_PROVES,
    STRETCH_ITERATIONS,
    ClientHello,
    KeyRing,
    NodeHello,
    Transcript,
    WrongNode,
    handshake_key,
    key_id,
    prove,
)
from backend.metadata import MetadataStore, NodeInfo
from backend.protocol import Op, Status
from backend.protocol.frame import HEADER, RESPONSE_BIT, Header, decode_header, encode_header
from backend.protocol.meta import decode_json, encode_json, encode_keys
from kvpool import AuthError, Chunk, NodeUnavailable, PoolConfig, ProtocolError, SyncPoolClient
from tests.support.handshake import frame

TOKEN = "handshake-token-0123456789abcdef"
OTHER_TOKEN = "another-token-fedcba9876543210"
WAIT_S = 10.0


# -- the checks themselves (no I/O) ----------------------------------------------------------
NAMESPACE = "ns"
KEY = handshake_key(TOKEN, NAMESPACE)
OTHER_KEY = handshake_key(OTHER_TOKEN, NAMESPACE)


def _pair(key: bytes | None = KEY, node_key: bytes = KEY) -> tuple[ClientHello, NodeHello]:
    client = ClientHello("node-a", "10.0.0.1:7000", key)
    node = NodeHello(KeyRing([node_key]), "node-a", "10.0.0.1:7000")
    return client, node


def test_a_client_and_a_node_with_one_token_prove_it_to_each_other() -> None:
    client, node = _pair()
    hello = node.answer(client.request(), epoch=3)
    auth = client.answer(hello)
    assert auth is not None and auth["key_id"] == key_id(KEY)
    answer = node.check(auth)  # no AuthError
    client.check(answer)  # no AuthError
    assert hello["epoch"] == 3 and answer["ok"] is True
    said = repr(hello) + repr(auth) + repr(answer) + repr(client.request())
    assert TOKEN not in said and KEY.hex() not in said


def test_the_node_says_nothing_to_guess_the_token_against_before_the_client_proved_it() -> None:
    """A peer that only connects gets no key id and no proof: nothing to try tokens on offline."""
    client, node = _pair()
    hello = node.answer(client.request(), epoch=1)
    assert set(hello) == {"proto", "node_id", "epoch", "auth_required", "nonce"}
    with pytest.raises(AuthError) as refused:
        node.check({"key_id": "0" * 16, "proof": "00" * 32})
    assert key_id(KEY) not in str(refused.value)  # a wrong key id is not told the right one


def test_the_token_is_stretched_per_namespace_before_it_keys_anything() -> None:
    assert handshake_key(TOKEN, NAMESPACE) == KEY != handshake_key(TOKEN, "other-ns")
    assert len(KEY) == 32 and TOKEN.encode() not in KEY
    assert hashlib.pbkdf2_hmac("sha256", TOKEN.encode(), b"kvpool handshake key|ns", STRETCH_ITERATIONS) == KEY
    assert STRETCH_ITERATIONS >= 100_000


def test_the_transcript_is_length_prefixed_so_no_two_fields_can_trade_bytes() -> None:
    one = Transcript(2, "k", "node-a", "10.0.0.1:7000", b"\x01" * 32, b"\x02" * 32)
    shifted = Transcript(2, "k", "node-a1", "0.0.1:7000", b"\x01" * 32, b"\x02" * 32)
    assert one.message(CLIENT_PROVES) != shifted.message(CLIENT_PROVES)
    assert prove(KEY, CLIENT_PROVES, one) != prove(KEY, CLIENT_PROVES, shifted)
    # The direction is part of what is proven: the node's proof is not the client's.
    assert prove(KEY, NODE_PROVES, one) != prove(KEY, CLIENT_PROVES, one)


def test_the_key_id_names_a_key_without_revealing_it() -> None:
    assert key_id(KEY) == key_id(KEY) != key_id(OTHER_KEY)
    assert len(key_id(KEY)) == 16 and key_id(KEY) not in KEY.hex()


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (lambda a: a.update(node_id="node-b"), WrongNode, "but node 'node-b' answered"),
        (lambda a: a.update(proto=1), ProtocolError, "speaks handshake version 1"),
        (lambda a: a.pop("proto"), ProtocolError, "speaks handshake version 1"),
        (lambda a: a.update(auth_required=False), AuthError, "does not ask for the pool token"),
    ],
    ids=["another node", "old node", "no version", "no token asked"],
)
def test_the_client_refuses_a_hello_answer_from_the_wrong_node(
    change: Callable[[dict[str, Any]], Any], error: type[Exception], words: str
) -> None:
    client, node = _pair()
    hello = node.answer(client.request(), epoch=1)
    change(hello)
    with pytest.raises(error, match=words):
        client.answer(hello)


@pytest.mark.parametrize(
    "change", [lambda a: a.update(proof="00" * 32), lambda a: a.pop("proof")], ids=["wrong proof", "no proof"]
)
def test_the_client_refuses_a_node_that_cannot_prove_the_token_back(change: Callable[[dict[str, Any]], Any]) -> None:
    client, node = _pair()
    auth = client.answer(node.answer(client.request(), epoch=1))
    assert auth is not None
    answer = node.check(auth)
    change(answer)
    with pytest.raises(AuthError, match="could not prove it holds the pool token"):
        client.check(answer)


def test_the_node_refuses_a_proof_made_for_another_address_or_node() -> None:
    """What a relay has to offer: a real client's proof, made for the relay (what the client dialled)."""
    for meant in (("node-a", "10.0.0.9:7000"), ("node-z", "10.0.0.1:7000")):
        client = ClientHello(*meant, KEY)
        node = NodeHello(KeyRing([KEY]), "node-a", "10.0.0.1:7000")
        hello = node.answer(client.request(), epoch=1)
        hello["node_id"] = meant[0]  # the relay shows the client the id it expects
        auth = client.answer(hello)
        assert auth is not None
        with pytest.raises(AuthError, match="wrong or missing token proof"):
            node.check(auth)


@pytest.mark.parametrize(
    ("request_body", "words"),
    [
        ({"client": "kvpool"}, "this node speaks handshake version 3, the client 1"),
        ({"proto": 2, "nonce": "ab" * 32}, "this node speaks handshake version 3, the client 2"),
        ({"proto": 3, "nonce": "ab"}, "no nonce of 32 bytes"),
    ],
    ids=["old client", "client of the previous index schema", "short nonce"],
)
def test_the_node_refuses_a_hello_it_cannot_answer(request_body: dict[str, Any], words: str) -> None:
    node = NodeHello(KeyRing([KEY]), "node-a", "10.0.0.1:7000")
    with pytest.raises(ProtocolError, match=words):
        node.answer(request_body, epoch=1)


def test_the_node_refuses_a_client_proving_another_token() -> None:
    client, node = _pair(key=OTHER_KEY)
    auth = client.answer(node.answer(client.request(), epoch=1))
    assert auth is not None
    with pytest.raises(AuthError, match="were given different tokens"):
        node.check(auth)


def test_a_client_without_a_token_is_told_one_is_required() -> None:
    client, node = _pair(key=None)
    hello = node.answer(client.request(), epoch=1)
    assert hello["auth_required"] is True
    with pytest.raises(AuthError, match="requires a token; give it as token_file=PATH"):
        client.answer(hello)


def test_a_captured_proof_replayed_on_another_connection_is_refused() -> None:
    """Whoever watched one connection's handshake cannot replay its AUTH: the node's nonce is new each time."""
    client, node = _pair()
    auth = client.answer(node.answer(client.request(), epoch=1))
    assert auth is not None
    node.check(auth)
    for replay_node in (node, _pair()[1]):  # a second HELLO on the same connection, or a new connection
        replay_node.answer(client.request(), epoch=1)
        with pytest.raises(AuthError, match="wrong or missing token proof"):
            replay_node.check(auth)


def test_an_auth_before_any_hello_is_refused() -> None:
    with pytest.raises(AuthError, match="AUTH before HELLO"):
        NodeHello(KeyRing([KEY]), "node-a", "10.0.0.1:7000").check({"key_id": key_id(KEY), "proof": "00"})


# -- raw frames over blocking sockets (the attacker's tools) -------------------------------------
def _read_frame(sock: socket.socket) -> tuple[Header, bytes, bytes] | None:
    """One whole frame (header, meta, data); None if the peer closed first."""
    head = _read_exactly(sock, HEADER.size)
    if head is None:
        return None
    header = decode_header(head)
    meta = _read_exactly(sock, header.meta_len) or b""
    data = _read_exactly(sock, header.data_len) or b""
    return header, meta, data


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            piece = sock.recv(n - len(buf))
        except OSError:
            return None
        if not piece:
            return None
        buf += piece
    return buf


def _raw(header: Header, meta: bytes, data: bytes) -> bytes:
    fields = (header.op, header.status, header.flags, header.meta_len, header.request_id, header.data_len)
    return HEADER.pack(b"KV", 1, *fields, header.meta_checksum) + meta + data


@dataclass
class Listener:
    """A listener on loopback serving each connection with ``serve(conn)`` on a thread."""

    serve: Callable[[socket.socket], None]
    sock: socket.socket = field(default_factory=lambda: socket.create_server(("127.0.0.1", 0)))
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def start(self) -> Listener:
        def accept() -> None:
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                conn.settimeout(WAIT_S)
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self.threads.append(thread)
                thread.start()

        threading.Thread(target=accept, daemon=True).start()
        return self

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            self.serve(conn)

    def close(self) -> None:
        self.sock.close()
        for thread in self.threads:
            thread.join(WAIT_S)


@pytest.fixture
def listeners() -> Iterator[Callable[[Callable[[socket.socket], None]], Listener]]:
    made: list[Listener] = []

    def make(serve: Callable[[socket.socket], None]) -> Listener:
        made.append(Listener(serve).start())
        return made[-1]

    yield make
    for listener in made:
        listener.close()


@dataclass
class Relay:
    """The attack as it was done: relay a victim's handshake to a real node, then use the node connection.

    Every frame of the handshake is passed on unchanged in both directions (the relay cannot
    make a proof of its own). Once the victim stops (it sent its AUTH, or refused the node
    and closed), the relay sends its own requests on its connection to the node: the
    inventory, then a delete of ``victim_key``.
    """

    node: tuple[str, int]
    victim_key: str
    seen_from_victim: list[int] = field(default_factory=list)  # ops the victim sent
    answers: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # the relay's own requests: status, meta
    done: threading.Event = field(default_factory=threading.Event)

    def serve(self, victim: socket.socket) -> None:
        try:
            with socket.create_connection(self.node, timeout=WAIT_S) as node:
                self._relay_handshake(victim, node)
                self._own_request(node, "inventory", frame(Op.INVENTORY, 100, {}))
                keys = encode_keys([self.victim_key])
                self._own_request(node, "delete", _raw_frame(Op.DELETE_BATCH, 101, keys))
        finally:
            self.done.set()

    def _relay_handshake(self, victim: socket.socket, node: socket.socket) -> None:
        for _ in range(2):  # HELLO, AUTH
            got = _read_frame(victim)
            if got is None:
                return  # the victim refused the node and closed
            self.seen_from_victim.append(got[0].base_op)
            node.sendall(_raw(*got))
            answer = _read_frame(node)
            if answer is None:
                return
            victim.sendall(_raw(*answer))

    def _own_request(self, node: socket.socket, name: str, request: bytes) -> None:
        try:
            node.sendall(request)
        except OSError:
            self.answers[name] = (-1, b"closed")
            return
        answer = _read_frame(node)
        self.answers[name] = (-1, b"closed") if answer is None else (answer[0].status, answer[1])


def _raw_frame(op: int, request_id: int, meta: bytes) -> bytes:
    return encode_header(op, request_id, meta) + meta


def _token_url(pool_url: str, token: str = TOKEN) -> str:
    return pool_url.replace("kvpool://", f"kvpool://:{token}@")


SECRET = Chunk("secret-chunk", b"only for token holders")


@contextlib.contextmanager
def _owner_and_relay(
    node_factory: Any, pool_url: str, listeners: Callable[[Callable[[socket.socket], None]], Listener]
) -> Iterator[tuple[SyncPoolClient, NodeInfo, Relay, Listener]]:
    """A node with a token holding SECRET, its owner (a client with the token), and a relay to the node."""
    node = node_factory(env={"KVPOOL_TOKEN": TOKEN})
    with SyncPoolClient(PoolConfig.from_url(_token_url(pool_url))) as owner:
        owner.put([SECRET])
        relay = Relay((node.host, node.port), SECRET.key)
        yield owner, owner.nodes()[0], relay, listeners(relay.serve)


def _assert_the_relay_got_nothing(relay: Relay, owner: SyncPoolClient) -> None:
    """The relay's own list and delete were refused as unauthenticated, and SECRET is still there."""
    assert relay.done.wait(WAIT_S)
    assert relay.answers["inventory"][0] in (Status.AUTH, -1), relay.answers
    assert relay.answers["delete"][0] in (Status.AUTH, -1), relay.answers
    got = owner.get([SECRET.key])[0]
    assert got is not None and bytes(got.data) == bytes(SECRET.data)  # nothing deleted


def test_a_relayed_handshake_is_refused_and_the_relay_gets_nothing(node_factory, pool_url, listeners):
    """The relay attack of trust round 4: a listener the client dials relays the real node's handshake.

    Before the mutual handshake the victim signed the node's nonce for the relay, and the
    relay listed, read and deleted chunks. Now the victim's proof names the address it
    dialled (the relay's): the node, which checks its own, refuses it, and the relay's own
    requests on its connection are refused as unauthenticated.
    """
    with _owner_and_relay(node_factory, pool_url, listeners) as (owner, real, relay, listener):
        # The victim dials the relay as the registry told it: a forged entry (real node id, the relay's address).
        forged = NodeInfo(real.node_id, "127.0.0.1", listener.port, real.epoch)

        async def victim() -> None:
            conn = NodeConnection(forged, PoolConfig.from_url(_token_url(pool_url)))
            try:
                await conn.ensure_open()
            finally:
                conn.close()

        # The victim's proof names the relay's address: the node refuses it, and says whom the victim meant.
        with pytest.raises(AuthError, match=f"wrong or missing token proof .*127.0.0.1:{listener.port}"):
            asyncio.run(victim())
        _assert_the_relay_got_nothing(relay, owner)
        assert relay.seen_from_victim == [Op.HELLO, Op.AUTH]
        assert owner.node_stats(real)["counters"]["auth_failures"] >= 1


@dataclass
class Impostor:
    """A listener posing as a node without the token: answers HELLO with ``answer``, any AUTH with a
    guessed proof, and records every frame."""

    answer: Callable[[dict[str, Any]], dict[str, Any]]
    frames: list[tuple[int, int]] = field(default_factory=list)  # (op, data_len) of every frame received

    def serve(self, conn: socket.socket) -> None:
        while (got := _read_frame(conn)) is not None:
            header, meta, _ = got
            self.frames.append((header.base_op, header.data_len))
            if header.base_op == Op.HELLO:
                conn.sendall(_answer(header, encode_json(self.answer(decode_json(meta)))))
            elif header.base_op == Op.AUTH:
                conn.sendall(_answer(header, encode_json({"ok": True, "proof": "ef" * 32})))


def _answer(request: Header, meta: bytes) -> bytes:
    return encode_header(request.base_op | RESPONSE_BIT, request.request_id, meta) + meta


IMPOSTOR_ANSWERS = {
    "asks for no token": lambda req: {
        "proto": 2,
        "node_id": req["node_id"],
        "epoch": 1,
        "auth_required": False,
        "nonce": "cd" * 32,
    },
    "proves with a guess": lambda req: {
        "proto": 2,
        "node_id": req["node_id"],
        "epoch": 1,
        "auth_required": True,
        "nonce": "cd" * 32,
    },
    "speaks the old handshake": lambda req: {
        "node_id": req["node_id"],
        "epoch": 1,
        "auth_required": True,
        "nonce": "cd" * 32,
    },
}


@pytest.mark.parametrize("behaviour", list(IMPOSTOR_ANSWERS))
def test_a_client_refuses_a_listener_without_the_token_before_sending_it_anything(
    redis_server, namespace, pool_url, listeners, behaviour
):
    """An impostor registered as the pool's only node: the client's put fails naming why, and the impostor
    gets nothing but a HELLO and at most an AUTH (a proof bound to the impostor's own address): no chunk."""
    impostor = Impostor(IMPOSTOR_ANSWERS[behaviour])
    listener = listeners(impostor.serve)

    async def register() -> None:
        config = PoolConfig.from_url(pool_url)
        store = MetadataStore(config.redis_url, config.namespace)
        try:
            info = NodeInfo("impostor", "127.0.0.1", listener.port, 1, capacity_bytes=1 << 30)
            await store.registry.heartbeat(info, ttl_ms=60_000, changed=True)
        finally:
            await store.close()

    asyncio.run(register())
    with SyncPoolClient(PoolConfig.from_url(_token_url(pool_url))) as client:
        with pytest.raises((AuthError, ProtocolError, NodeUnavailable)) as refused:
            client.put([Chunk("for-the-pool", b"x" * 4096)])
        assert "impostor" in str(refused.value)
        assert client.get(["for-the-pool"]) == [None]
    assert impostor.frames, "the client never dialled the impostor"
    assert {op for op, _ in impostor.frames} <= {Op.HELLO, Op.AUTH}  # no PUT, no other request
    assert all(data_len == 0 for _, data_len in impostor.frames)


def test_a_client_that_dials_a_live_node_under_another_id_refuses_it(node_factory, pool_url):
    """A stale or forged registry entry: the address of one node under another's id."""
    node_factory(env={"KVPOOL_TOKEN": TOKEN})
    with SyncPoolClient(PoolConfig.from_url(_token_url(pool_url))) as client:
        real = client.nodes()[0]
    wrong = NodeInfo("someone-else", real.host, real.port, real.epoch)

    async def dial() -> None:
        conn = NodeConnection(wrong, PoolConfig.from_url(_token_url(pool_url)))
        try:
            await conn.ensure_open()
        finally:
            conn.close()

    with pytest.raises(WrongNode, match=f"but node {real.node_id!r} answered"):
        asyncio.run(dial())


def test_an_old_client_gets_a_version_error_not_a_hang(node_factory):
    """What a client of the previous release sends first: HELLO {"client": "kvpool"}, no nonce."""
    node = node_factory(env={"KVPOOL_TOKEN": TOKEN})
    started = time.monotonic()
    with socket.create_connection((node.host, node.port), timeout=WAIT_S) as sock:
        sock.sendall(frame(Op.HELLO, 1, {"client": "kvpool"}))
        answer = _read_frame(sock)
        assert answer is not None
        assert answer[0].status == Status.PROTOCOL
        assert b"this node speaks handshake version 3, the client 1" in answer[1]
        assert _read_frame(sock) is None  # and the node closes
    assert time.monotonic() - started < 5.0


def test_clients_with_another_token_are_told_the_tokens_differ(node_factory, pool_url):
    node_factory(env={"KVPOOL_TOKEN": TOKEN})
    with SyncPoolClient(PoolConfig.from_url(_token_url(pool_url, OTHER_TOKEN))) as client:
        with pytest.raises(AuthError, match="were given different tokens"):
            client.node_stats(client.nodes()[0])
        assert client.get(["anything"]) == [None]
