"""Bad input: hypothesis drives raw sockets against one real node process.

Every example sends malformed, truncated, oversized, wrong-version or pre-auth
frames, then checks what docs/protocol.md promises: the node answers a malformed
frame with an error frame (or, for a cut-short stream, just closes) and closes only
that connection; it never answers INTERNAL (an unhandled exception); its peak
memory stays within the DRAM tier plus a fixed overhead whatever lengths a header
declares; and a well-behaved PoolClient keeps reading back exactly what it wrote.

``KVPOOL_FULL=1`` (``make faults``) runs many more examples.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.client import Chunk, SyncPoolClient
from backend.config import PoolConfig
from backend.embedded import EmbeddedRedis
from backend.errors import CapacityError, ProtocolError
from backend.protocol import DEFAULT_LIMITS, ItemMeta, Op, Status, checksum
from backend.protocol.frame import HEADER, RESPONSE_BIT, decode_header, encode_header, verify_meta
from backend.protocol.meta import decode_flags, encode_json, encode_keys
from backend.protocol.puts import PUT_INTEGRITY, PUT_STORED, PutBatch
from backend.protocol.reads import Lease
from tests.conftest import NodeProcess
from tests.support.handshake import auth_frame, check_auth_answer, hello_frame

FULL = bool(os.environ.get("KVPOOL_FULL"))
EXAMPLES = 2000 if FULL else 60
TOKEN = "fuzz-token-0123456789"
MIB = 1024 * 1024
DRAM_BYTES = 32 * MIB
# Memory a node may use on top of what it had after warm-up: its DRAM tier, the
# pre-faulted buffer pool (a quarter of DRAM), one meta section at the limit, and a
# fixed allowance for the interpreter's own growth.
FIXED_OVERHEAD_BYTES = 64 * MIB
NODE_MEMORY_BOUND_BYTES = DRAM_BYTES + DRAM_BYTES // 4 + DEFAULT_LIMITS.max_meta_bytes + FIXED_OVERHEAD_BYTES
REPLY_WAIT_S = 15.0  # bounded: the node must answer or close well within this
SENTINEL_ID = 2**64 - 1

pytestmark = pytest.mark.timeout(1200 if FULL else 120)  # per test: FULL runs EXAMPLES of each
FUZZ_SETTINGS = settings(
    deadline=None,
    max_examples=EXAMPLES,
    derandomize=not FULL,  # the short run in `make test` checks the same examples every time
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _memory_bytes(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak resident set) of a process, in bytes."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024
    return fields


class Target:
    """The module's node, a well-behaved client of it, and the node's memory after warm-up."""

    def __init__(self, node: NodeProcess, client: SyncPoolClient, url: str, baseline_bytes: int) -> None:
        self.node = node
        self.client = client
        self.url = url
        self.baseline_bytes = baseline_bytes

    def __repr__(self) -> str:  # hypothesis prints it with every failing example; the log is long
        return f"Target(node={self.node.node_id} at {self.node.host}:{self.node.port})"

    @property
    def pid(self) -> int:
        assert self.node.process is not None
        return self.node.process.pid

    def check_healthy(self) -> None:
        """The node is alive, within its memory bound, and still serves a well-behaved client."""
        assert self.node.alive(), "node died:\n" + self.node.log[-3000:]
        peak = _memory_bytes(self.pid)["VmHWM"]
        assert peak <= self.baseline_bytes + NODE_MEMORY_BOUND_BYTES, (
            f"node peak RSS {peak / MIB:.0f} MiB is over baseline {self.baseline_bytes / MIB:.0f} MiB "
            f"+ bound {NODE_MEMORY_BOUND_BYTES / MIB:.0f} MiB"
        )
        key = f"good-{uuid.uuid4().hex}"
        payload = os.urandom(4096)
        self.client.put([Chunk(key, payload)])
        got = self.client.get([key])[0]
        assert got is not None and bytes(got.data) == payload
        assert "Traceback" not in self.node.log and "internal error" not in self.node.log, self.node.log[-3000:]


@pytest.fixture(scope="module")
def target(processes: None, redis_server: EmbeddedRedis) -> Iterator[Target]:
    namespace = "fz" + uuid.uuid4().hex[:10]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "KVPOOL_TOKEN": TOKEN}
    args = ["--redis", redis_server.url, "--namespace", namespace, "--dram", f"{DRAM_BYTES // MIB}MiB"]
    node = NodeProcess([*args, "--shm-dir", "off"], env).start()
    url = f"kvpool://:{TOKEN}@127.0.0.1:{redis_server.port}/{namespace}"
    client = SyncPoolClient(PoolConfig.from_url(url))
    try:
        # Warm up every path once (imports, buffer pool, Redis scripts) before the baseline.
        for i in range(8):
            client.put([Chunk(f"warm-{i}", os.urandom(256 * 1024))])
            assert client.get([f"warm-{i}"])[0] is not None
        assert node.process is not None
        baseline = _memory_bytes(node.process.pid)["VmHWM"]
        yield Target(node, client, url, baseline)
    finally:
        client.close()
        node.kill()


# -- raw socket helpers -----------------------------------------------------------------
def _raw_header(
    op: int,
    request_id: int = 1,
    meta: bytes = b"",
    *,
    magic: bytes = b"KV",
    version: int = 1,
    meta_len: int | None = None,
    data_len: int = 0,
    meta_checksum: int | None = None,
) -> bytes:
    return HEADER.pack(
        magic,
        version,
        op,
        0,
        0,
        len(meta) if meta_len is None else meta_len,
        request_id,
        data_len,
        checksum(meta) if meta_checksum is None else meta_checksum,
    )


@dataclass
class Reply:
    frames: list[tuple[object, bytes]]  # (Header, meta), in arrival order
    closed: bool  # the node closed (FIN or reset) within REPLY_WAIT_S


def _read(sock: socket.socket, stop_at_id: int | None = None) -> Reply:
    """Read frames until the node closes, or until the response to ``stop_at_id`` arrived.

    Fails the test if neither happens within REPLY_WAIT_S: a node must never hang a peer.
    """
    buf = bytearray()
    frames: list[tuple[object, bytes]] = []
    deadline = time.monotonic() + REPLY_WAIT_S
    while True:
        while len(buf) >= HEADER.size:
            header = decode_header(bytes(buf[: HEADER.size]))  # a node's frame always parses
            end = HEADER.size + header.meta_len + header.data_len
            if len(buf) < end:
                break
            meta = bytes(buf[HEADER.size : HEADER.size + header.meta_len])
            verify_meta(header, meta)
            frames.append((header, meta))
            del buf[:end]
            if stop_at_id is not None and header.request_id == stop_at_id:
                return Reply(frames, closed=False)
        left = deadline - time.monotonic()
        assert left > 0, f"node neither answered nor closed within {REPLY_WAIT_S} s (got {len(frames)} frames)"
        sock.settimeout(left)
        try:
            piece = sock.recv(1 << 20)
        except ConnectionResetError:
            return Reply(frames, closed=True)
        except TimeoutError:
            continue
        if not piece:
            return Reply(frames, closed=True)
        buf += piece


def _send(sock: socket.socket, payload: bytes) -> None:
    try:
        sock.sendall(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the node already refused and closed: what it answered is still read


def _half_close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the node already reset the connection: reading reports it closed


def _connect(target: Target, *, authed: bool) -> socket.socket:
    sock = socket.create_connection((target.node.host, target.node.port), timeout=REPLY_WAIT_S)
    if authed:
        handshake, hello = hello_frame(target.node, TOKEN)
        sock.sendall(hello)
        sock.sendall(auth_frame(handshake, _read(sock, stop_at_id=1).frames[-1][1]))
        check_auth_answer(handshake, _read(sock, stop_at_id=2).frames[-1][1])
    return sock


def _still_serving(sock: socket.socket, target: Target) -> bool:
    """True if this connection still answers a HELLO (HELLO is allowed before AUTH too)."""
    _send(sock, hello_frame(target.node, TOKEN, SENTINEL_ID)[1])
    reply = _read(sock, stop_at_id=SENTINEL_ID)
    return not reply.closed


def _assert_refused(reply: Reply, status: Status, words: str, op: int = Op.PING | RESPONSE_BIT, rid: int = 0) -> None:
    """Exactly one error frame (status, op, request id, message naming the fault), then the close."""
    assert reply.closed, "the node kept a connection that sent a malformed frame"
    assert len(reply.frames) == 1, reply.frames
    header, meta = reply.frames[0]
    assert (header.status, header.op, header.request_id) == (status, op, rid), (header, meta)  # type: ignore[attr-defined]
    assert words in meta.decode("utf-8"), meta


# -- frames refused from the 36 header bytes alone ----------------------------------------
KNOWN_OPS = sorted(int(op) for op in Op)
unknown_ops = st.integers(0, 255).filter(lambda op: op & ~RESPONSE_BIT not in KNOWN_OPS)


@st.composite
def bad_headers(draw: st.DrawFn) -> tuple[bytes, str]:
    """A header a node must refuse before reading on, and a word its error must contain."""
    op = draw(st.sampled_from(KNOWN_OPS))
    kind = draw(st.sampled_from(["magic", "version", "op", "meta_len", "data_len"]))
    if kind == "magic":
        magic = draw(st.binary(min_size=2, max_size=2).filter(lambda m: m != b"KV"))
        return _raw_header(op, magic=magic), "bad magic"
    if kind == "version":
        return _raw_header(
            op, version=draw(st.integers(0, 255).filter(lambda v: v != 1))
        ), "unsupported protocol version"
    if kind == "op":
        return _raw_header(draw(unknown_ops)), "unknown op code"
    if kind == "meta_len":
        huge = draw(st.integers(DEFAULT_LIMITS.max_meta_bytes + 1, 2**32 - 1))
        return _raw_header(op, meta_len=huge), "exceeds"
    huge = draw(st.one_of(st.just(2**63), st.integers(DEFAULT_LIMITS.max_data_bytes + 1, 2**64 - 1)))
    return _raw_header(op, data_len=huge), "exceeds"


@FUZZ_SETTINGS
@given(case=bad_headers(), authed=st.booleans())
def test_a_header_with_bad_magic_version_op_or_a_huge_length_gets_one_protocol_error_and_a_close(
    target: Target, case: tuple[bytes, str], authed: bool
) -> None:
    header, words = case
    sock = _connect(target, authed=authed)
    with sock:
        _send(sock, header)  # exactly 36 bytes: the node reads all of it, so it closes with a FIN
        _assert_refused(_read(sock), Status.PROTOCOL, words)
    target.check_healthy()


# -- frames refused once the header parsed ----------------------------------------------
@FUZZ_SETTINGS
@given(
    op=st.sampled_from(KNOWN_OPS),
    meta=st.binary(max_size=512),
    rid=st.integers(1, 2**64 - 2),
    flip=st.integers(1, 2**64 - 1),
)
def test_a_meta_checksum_mismatch_is_refused_with_that_frames_op_and_request_id(
    target: Target, op: int, meta: bytes, rid: int, flip: int
) -> None:
    sock = _connect(target, authed=True)
    with sock:
        _send(sock, _raw_header(op, rid, meta, meta_checksum=checksum(meta) ^ flip) + meta)
        _assert_refused(_read(sock), Status.PROTOCOL, "meta checksum mismatch", op | RESPONSE_BIT, rid)
    target.check_healthy()


@FUZZ_SETTINGS
@given(op=st.sampled_from(KNOWN_OPS), rid=st.integers(1, 2**64 - 2))
def test_a_response_frame_from_a_client_is_a_protocol_error(target: Target, op: int, rid: int) -> None:
    sock = _connect(target, authed=True)
    with sock:
        _send(sock, encode_header(op | RESPONSE_BIT, rid))
        _assert_refused(_read(sock), Status.PROTOCOL, "response frame", op | RESPONSE_BIT, rid)
    target.check_healthy()


NO_DATA_OPS = [op for op in KNOWN_OPS if op != Op.PUT_BATCH]


@FUZZ_SETTINGS
@given(op=st.sampled_from(NO_DATA_OPS), data=st.binary(min_size=1, max_size=256), authed=st.booleans())
def test_data_on_an_op_that_carries_none_is_refused_before_auth_or_dispatch(
    target: Target, op: int, data: bytes, authed: bool
) -> None:
    sock = _connect(target, authed=authed)
    with sock:
        # Only the header reaches the node before it refuses; the data it never reads would
        # turn its close into a reset and hide the error frame.
        _send(sock, _raw_header(op, 7, data_len=len(data)))
        _assert_refused(_read(sock), Status.PROTOCOL, "carries no data", op | RESPONSE_BIT, 7)
    target.check_healthy()


PRE_AUTH_REFUSED = [op for op in KNOWN_OPS if op not in (Op.HELLO, Op.AUTH)]


@FUZZ_SETTINGS
@given(op=st.sampled_from(PRE_AUTH_REFUSED), meta=st.binary(max_size=256), hello_first=st.booleans())
def test_any_op_before_auth_is_refused_with_an_auth_error_and_a_close(
    target: Target, op: int, meta: bytes, hello_first: bool
) -> None:
    sock = socket.create_connection((target.node.host, target.node.port), timeout=REPLY_WAIT_S)
    with sock:
        if hello_first:
            assert _still_serving(sock, target)  # HELLO is answered before AUTH; it grants nothing
        _send(sock, encode_header(op, 9, meta) + meta)
        _assert_refused(_read(sock), Status.AUTH, "send HELLO and AUTH first", op | RESPONSE_BIT, 9)
    target.check_healthy()


@FUZZ_SETTINGS
@given(proof=st.one_of(st.text(max_size=80), st.none()), hello_first=st.booleans())
def test_a_wrong_token_is_refused_with_an_auth_error_and_a_close(
    target: Target, proof: str | None, hello_first: bool
) -> None:
    sock = socket.create_connection((target.node.host, target.node.port), timeout=REPLY_WAIT_S)
    with sock:
        if hello_first:
            assert _still_serving(sock, target)
        body = encode_json({} if proof is None else {"proof": proof})
        _send(sock, encode_header(Op.AUTH, 3, body) + body)
        _assert_refused(_read(sock), Status.AUTH, "wrong or missing token", Op.AUTH | RESPONSE_BIT, 3)
    target.check_healthy()


# -- well-framed requests with random or hostile meta, after AUTH ---------------------------
fuzz_keys = st.text(min_size=1, max_size=40)


@st.composite
def hostile_metas(draw: st.DrawFn) -> bytes:
    """Meta sections: random bytes, valid encodings cut or padded, and huge declared counts."""
    keys = draw(st.lists(fuzz_keys, max_size=12))
    valid = draw(
        st.sampled_from(
            [
                encode_keys(keys),
                encode_json(
                    draw(
                        st.dictionaries(
                            st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=12), st.none()), max_size=4
                        )
                    )
                ),
                Lease.encode_request(keys, draw(st.integers(1, 600_000)), draw(st.integers(0, 3))),
                struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + encode_keys(keys),  # RELEASE
                encode_json({"session": draw(st.text(max_size=12)), "keys": keys}),  # CHANNEL_GET
                encode_json({"after": draw(st.text(max_size=12)), "limit": draw(st.integers(-5, 20_000))}),  # INVENTORY
            ]
        )
    )
    return draw(
        st.one_of(
            st.binary(max_size=512),
            st.just(valid),
            st.integers(0, len(valid)).map(lambda cut: valid[:cut]),
            st.binary(min_size=1, max_size=16).map(lambda junk: valid + junk),
            # A declared count in the billions must be refused before anything is read or allocated.
            st.integers(DEFAULT_LIMITS.max_items + 1, 2**32 - 1).map(lambda n: struct.pack("<I", n) + valid[4:]),
            # A key length over the limit, or zero.
            st.sampled_from([0, DEFAULT_LIMITS.max_key_bytes + 1, 2**16 - 1]).map(
                lambda n: struct.pack("<IH", 1, n) + b"k" * min(n, 2048)
            ),
        )
    )


@FUZZ_SETTINGS
@given(op=st.sampled_from(NO_DATA_OPS), meta=hostile_metas(), rid=st.integers(1, 2**64 - 2))
def test_a_request_with_hostile_meta_is_answered_or_refused_never_an_internal_error(
    target: Target, op: int, meta: bytes, rid: int
) -> None:
    sock = _connect(target, authed=True)
    with sock:
        _send(sock, encode_header(op, rid, meta) + meta)
        reply = _read(sock, stop_at_id=rid)
        assert reply.frames, "the node closed without a word on a complete frame"
        header, body = reply.frames[-1]
        assert header.request_id == rid and header.op == op | RESPONSE_BIT  # type: ignore[attr-defined]
        # A hostile AUTH: a wrong proof. A hostile HELLO: no valid nonce, or a token this node does not hold.
        refusals = (Status.PROTOCOL, Status.AUTH) if op in (Op.AUTH, Op.HELLO) else (Status.PROTOCOL,)
        assert header.status in (Status.OK, *refusals), (header, body)  # type: ignore[attr-defined]
        if header.status != Status.OK:  # type: ignore[attr-defined]
            assert body, "an error frame names what was wrong"
            assert _read(sock).closed  # a malformed request ends its connection
        else:
            assert _still_serving(sock, target)  # a good request leaves the connection open
    target.check_healthy()


@st.composite
def put_frames(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, bytes, bool]], int]:
    """A PUT_BATCH frame: items with good or wrong checksums, sometimes a lying data_len."""
    prefix = uuid.uuid4().hex[:8]
    names = draw(st.lists(fuzz_keys, min_size=1, max_size=8, unique=True))
    values = [(f"{prefix}-{name}", draw(st.binary(max_size=8192)), draw(st.booleans())) for name in names]
    items = [
        ItemMeta(key, len(data), checksum(data) if good else checksum(data) ^ 1, "uint8", (len(data),), 0)
        for key, data, good in values
    ]
    meta = PutBatch.encode_items(items)
    payload = b"".join(data for _, data, _ in values)
    # A data_len that disagrees with the items (none when there is nothing to take from).
    data_len = max(len(payload) + draw(st.sampled_from([0, 0, 0, 1, -1])), 0)
    skew = data_len - len(payload)
    frame = _raw_header(Op.PUT_BATCH, 5, meta, data_len=data_len) + meta + payload[:data_len]
    return frame, values, skew


@FUZZ_SETTINGS
@given(case=put_frames())
def test_a_raw_put_stores_exactly_the_items_whose_checksums_match(
    target: Target, case: tuple[bytes, list[tuple[str, bytes, bool]], int]
) -> None:
    frame, values, skew = case
    sock = _connect(target, authed=True)
    with sock:
        _send(sock, frame)
        if skew:
            _assert_refused(_read(sock), Status.PROTOCOL, "items declare", Op.PUT_BATCH | RESPONSE_BIT, 5)
        else:
            reply = _read(sock, stop_at_id=5)
            header, body = reply.frames[-1]
            assert header.status == Status.OK, body  # type: ignore[attr-defined]
            expected = [PUT_STORED if good else PUT_INTEGRITY for _, _, good in values]
            assert decode_flags(body, len(values)) == expected
            assert _still_serving(sock, target)
    got = target.client.get([key for key, _, _ in values])
    for (key, data, good), fetched in zip(values, got):
        if not good or skew:
            assert fetched is None, f"{key!r} is readable although its put was refused"
        elif fetched is not None:  # a hit must be byte-identical (DRAM may have evicted it: a miss)
            assert bytes(fetched.data) == data
    target.check_healthy()


@FUZZ_SETTINGS
@given(case=put_frames(), cut=st.floats(0.0, 1.0, exclude_max=True), reset=st.booleans())
def test_a_put_cut_short_by_a_half_close_or_a_reset_stores_nothing(
    target: Target, case: tuple[bytes, list[tuple[str, bytes, bool]], int], cut: float, reset: bool
) -> None:
    frame, values, _ = case
    sock = _connect(target, authed=True)
    with sock:
        _send(sock, frame[: int(len(frame) * cut)])
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            _half_close(sock)
            reply = _read(sock)  # the node must notice the end of the stream and close
            assert reply.closed
            assert all(h.status != Status.INTERNAL for h, _ in reply.frames)  # type: ignore[attr-defined]
    assert target.client.get([key for key, _, _ in values]) == [None] * len(values)
    target.check_healthy()


@FUZZ_SETTINGS
@given(junk=st.binary(min_size=1, max_size=600))
def test_random_bytes_are_refused_or_dropped_and_the_connection_closes(target: Target, junk: bytes) -> None:
    sock = _connect(target, authed=False)
    with sock:
        _send(sock, junk)
        _half_close(sock)
        reply = _read(sock)
        assert reply.closed
        for header, _ in reply.frames:
            assert header.status in (Status.OK, Status.PROTOCOL, Status.AUTH)  # type: ignore[attr-defined]
    target.check_healthy()


def test_stalled_half_sent_frames_cost_only_what_they_sent_and_do_not_hold_up_other_clients(target: Target) -> None:
    """64 connections declare a 4 MiB meta and 64 a 2 GiB chunk (no room: read and dropped);
    each sends 2 bytes of it and stalls."""
    big = ItemMeta(f"stall-{uuid.uuid4().hex}", DEFAULT_LIMITS.max_data_bytes, 0, "uint8", (1,), 0)
    put_meta = PutBatch.encode_items([big])
    before = _memory_bytes(target.pid)["VmRSS"]
    stalled = []
    try:
        for _ in range(64):
            sock = _connect(target, authed=True)
            sock.sendall(_raw_header(Op.GET_BATCH, 1, meta_len=DEFAULT_LIMITS.max_meta_bytes) + b"\x01\x00")
            stalled.append(sock)
            sock = _connect(target, authed=True)
            sock.sendall(_raw_header(Op.PUT_BATCH, 1, put_meta, data_len=big.nbytes) + put_meta + b"\x01\x00")
            stalled.append(sock)
        for _ in range(5):
            target.check_healthy()  # round trips through the node's loop: it has read the stalled headers
        grown = _memory_bytes(target.pid)["VmRSS"] - before
        assert grown < 32 * MIB, f"128 stalled frames grew the node by {grown / MIB:.0f} MiB"
    finally:
        for sock in stalled:
            sock.close()
    assert target.client.contains([big.key]) == [False]


# -- key and value limits on the client side ---------------------------------------------
def test_an_over_long_key_refuses_the_whole_put_naming_max_key_bytes_and_stores_nothing(target: Target) -> None:
    good = [Chunk(f"lim-{uuid.uuid4().hex}", b"a" * 100), Chunk(f"lim-{uuid.uuid4().hex}", b"b" * 100)]
    with pytest.raises(ProtocolError, match="key of 1025 bytes is over max_key_bytes = 1024"):
        target.client.put([good[0], Chunk("k" * 1025, b"c"), good[1]])
    assert target.client.contains([c.key for c in good]) == [False, False]
    target.client.put(good)  # the same batch without the bad key goes through whole
    assert [bytes(g.data) for g in target.client.get([c.key for c in good])] == [b"a" * 100, b"b" * 100]


@pytest.mark.parametrize(
    "bad_key, words",
    [
        ("", "key of 0 bytes"),
        ("k" * 1025, "over max_key_bytes"),
        ("é" * 513, "key of 1026 bytes"),
        ("bad-\udcff-surrogate", "not valid UTF-8"),
        (b"bytes-key", "keys are str"),
    ],
)
def test_every_call_refuses_an_unstorable_key_with_a_protocol_error_naming_it(
    target: Target, bad_key: str, words: str
) -> None:
    with pytest.raises(ProtocolError, match=words):
        target.client.put([Chunk(bad_key, b"x")])
    with pytest.raises(ProtocolError, match=words):
        target.client.get(["fine", bad_key])
    with pytest.raises(ProtocolError, match=words):
        target.client.contains([bad_key])
    with pytest.raises(ProtocolError, match=words):
        target.client.delete([bad_key])
    with pytest.raises(ProtocolError, match=words):
        target.client.lock([bad_key], 1000)


def test_a_value_over_max_data_bytes_is_refused_before_it_is_hashed_or_sent(target: Target) -> None:
    # An anonymous mapping: 2 GiB + 1 of address space, no page of it touched.
    before = _memory_bytes(os.getpid())["VmRSS"]
    with mmap.mmap(-1, DEFAULT_LIMITS.max_data_bytes + 1) as huge:
        view = memoryview(huge)
        try:
            with pytest.raises(ProtocolError, match=f"over max_data_bytes = {DEFAULT_LIMITS.max_data_bytes}"):
                target.client.put([Chunk(f"huge-{uuid.uuid4().hex}", view)])
        finally:
            view.release()
        # The payload was never read: hashing it would have faulted in 2 GiB.
        assert _memory_bytes(os.getpid())["VmRSS"] - before < 256 * MIB


def test_a_value_larger_than_the_dram_tier_is_a_capacity_error_and_nothing_is_stored(target: Target) -> None:
    key = f"big-{uuid.uuid4().hex}"
    # Refused from the request's meta, naming the sizes: the node never reads the bytes.
    words = rf"^1 of 1 chunks were not stored: 1 no room \(.*is {DRAM_BYTES + 1} bytes, larger than node .*DRAM tier"
    with pytest.raises(CapacityError, match=words):
        target.client.put([Chunk(key, bytes(DRAM_BYTES + 1))])
    assert target.client.contains([key]) == [False]
    target.check_healthy()


@pytest.mark.parametrize(
    "chunk, words",
    [
        (Chunk("dt", b"x", dtype="d" * 33), "max_dtype_bytes"),
        (Chunk("dt", b"x", dtype=""), "max_dtype_bytes"),
        (Chunk("nd", b"x", shape=(1,) * 9), "max_ndim"),
        (Chunk("neg", b"x", shape=(-1,)), "negative"),
    ],
)
def test_a_layout_over_the_limits_is_refused_naming_the_limit(target: Target, chunk: Chunk, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        target.client.put([chunk])
    assert target.client.contains([chunk.key]) == [False]


def test_more_items_than_max_items_are_split_into_frames_transparently(target: Target) -> None:
    count = DEFAULT_LIMITS.max_items + 904  # 5000: more than a frame may carry
    prefix = uuid.uuid4().hex[:8]
    chunks = [Chunk(f"{prefix}-{i}", i.to_bytes(4, "little") * 4) for i in range(count)]
    target.client.put(chunks)
    keys = [c.key for c in chunks]
    assert target.client.contains(keys) == [True] * count
    got = target.client.get(keys)
    assert [bytes(g.data) if g is not None else None for g in got] == [bytes(c.data) for c in chunks]
    assert target.client.delete(keys) == count


def test_the_lmcache_connector_turns_an_unstorable_key_into_a_miss_without_raising(target: Target) -> None:
    from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config

    stack = LMCacheStack(kvpool_lmcache_config(target.url), model="m" * 1100)  # keys over max_key_bytes
    try:
        keys = [stack.key(1), stack.key(2)]
        assert len(keys[0].to_string().encode()) > DEFAULT_LIMITS.max_key_bytes
        objs = [stack.make_object(1), stack.make_object(2)]
        stack.put(keys, objs)  # completes (LMCache is told the put is done) without raising
        stack.release(objs)
        assert stack.contains_prefix(keys) == 0
        assert stack.get(keys) == [None, None]
        counters = stack.connector().counters
        assert counters["miss_put"] >= 1 and counters["miss_lookup"] >= 1 and counters["put_chunks"] == 0
    finally:
        stack.close()
    target.check_healthy()
