"""The wire format: header layout, meta encodings, limits and hostile input."""

from __future__ import annotations

import re
import struct
import tracemalloc
from collections.abc import Callable
from typing import TypeVar

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.errors import (
    AuthError,
    CapacityError,
    ConfigError,
    IntegrityError,
    KVPoolError,
    MetadataError,
    NcclError,
    NodeUnavailable,
    ProtocolError,
    PutOutcome,
)
from backend.protocol import DEFAULT_LIMITS, VERSION, ItemMeta, Limits, Op, Status, checksum
from backend.protocol.frame import (
    HEADER,
    MAGIC,
    RESPONSE_BIT,
    Header,
    decode_header,
    encode_header,
    error_for_status,
    status_for_error,
    verify_meta,
)
from backend.protocol.inventory import Inventory, InventoryPage, InventoryRow
from backend.protocol.meta import decode_flags, decode_json, decode_keys, encode_flags, encode_json, encode_keys
from backend.protocol.puts import (
    MAX_PUT_WAIT_MS,
    PUT_BUSY,
    PUT_INTEGRITY,
    PUT_NO_ROOM,
    PUT_STORED,
    PutBatch,
    PutOptions,
    PutStaged,
    put_outcome,
)
from backend.protocol.reads import GetBatch
from backend.protocol.reports import (
    ArenaReport,
    NodeReport,
    RecentReport,
    RecoveryReport,
    RepublishReport,
    Stat,
    TierReport,
)

T = TypeVar("T")


def item(
    key: str, nbytes: int = 16, *, dtype: str = "bfloat16", shape: tuple[int, ...] = (2, 4), fmt: int = 1
) -> ItemMeta:
    return ItemMeta(key, nbytes, checksum(bytes(nbytes)), dtype, shape, fmt)


def raw_header(
    *,
    magic: bytes = MAGIC,
    version: int = VERSION,
    op: int = Op.PING,
    status: int = 0,
    flags: int = 0,
    meta_len: int = 0,
    request_id: int = 1,
    data_len: int = 0,
    meta_sum: int = 0,
) -> bytes:
    return HEADER.pack(magic, version, op, status, flags, meta_len, request_id, data_len, meta_sum)


def raw_item(key: bytes, *, nbytes: int = 0, dtype: bytes = b"uint8", shape: tuple[int, ...] = ()) -> bytes:
    """One item's meta built by hand, so the decoder can be fed what the encoder refuses."""
    out = struct.pack("<H", len(key)) + key + struct.pack("<QQH", nbytes, 0, 0)
    out += struct.pack("<B", len(dtype)) + dtype
    out += struct.pack("<B", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
    return out


def count(n: int) -> bytes:
    return struct.pack("<I", n)


# -- constants: the wire contract docs/protocol.md describes -------------------------------


def test_header_is_36_little_endian_bytes_in_the_documented_order() -> None:
    assert HEADER.format == "<2sBBHHIQQQ"
    assert HEADER.size == 36

    meta = b"hello"
    head = encode_header(Op.GET_BATCH, 0x0102030405060708, meta, data_len=0x1122, status=Status.CAPACITY)

    assert head[0:2] == b"KV"
    assert head[2] == VERSION == 1
    assert head[3] == Op.GET_BATCH
    assert head[4:6] == struct.pack("<H", Status.CAPACITY)
    assert head[6:8] == b"\x00\x00"  # flags: always sent as zero
    assert head[8:12] == struct.pack("<I", len(meta))
    assert head[12:20] == struct.pack("<Q", 0x0102030405060708)
    assert head[20:28] == struct.pack("<Q", 0x1122)
    assert head[28:36] == struct.pack("<Q", xxhash.xxh3_64_intdigest(meta))


def test_op_and_status_codes_have_their_wire_values() -> None:
    assert {op.name: int(op) for op in Op} == {
        "HELLO": 1,
        "AUTH": 2,
        "PUT_BATCH": 3,
        "GET_BATCH": 4,
        "EXISTS_BATCH": 5,
        "DELETE_BATCH": 6,
        "STAT": 7,
        "PING": 8,
        "INVENTORY": 9,
        "VERIFY_BATCH": 10,
        "LEASE": 11,
        "RELEASE": 12,
        "CHANNEL_GET": 13,
        "PUT_STAGED": 14,
        "TOUCH": 15,
        "PIN": 16,
        "UNPIN": 17,
        "PINS": 18,
        "EVENTS": 19,
    }
    assert {s.name: int(s) for s in Status} == {
        "OK": 0,
        "PROTOCOL": 1,
        "AUTH": 2,
        "CAPACITY": 3,
        "INTEGRITY": 4,
        "METADATA": 5,
        "INTERNAL": 6,
        "UNAVAILABLE": 7,
    }
    assert RESPONSE_BIT == 0x80
    assert (PUT_STORED, PUT_INTEGRITY, PUT_NO_ROOM) == (0, 1, 2)


def test_default_limits_have_their_documented_values() -> None:
    assert DEFAULT_LIMITS == Limits(
        max_meta_bytes=4 * 1024 * 1024,
        max_data_bytes=2 * 1024 * 1024 * 1024,
        max_items=4096,
        max_key_bytes=1024,
        max_dtype_bytes=32,
        max_ndim=8,
    )


def test_checksum_is_xxh3_64_and_hashes_memoryviews_in_place() -> None:
    data = bytearray(b"some chunk payload" * 100)

    assert checksum(data) == xxhash.xxh3_64_intdigest(bytes(data))
    assert checksum(memoryview(data)[5:50]) == xxhash.xxh3_64_intdigest(bytes(data[5:50]))


# -- header ---------------------------------------------------------------------------


def test_header_round_trips_every_field() -> None:
    meta = b'{"a":1}'
    head = encode_header(Op.PUT_BATCH, 2**64 - 1, meta, data_len=12345)

    decoded = decode_header(head)

    assert decoded.op == Op.PUT_BATCH
    assert decoded.status == Status.OK
    assert decoded.flags == 0
    assert decoded.meta_len == len(meta)
    assert decoded.request_id == 2**64 - 1
    assert decoded.data_len == 12345
    assert decoded.meta_checksum == checksum(meta)
    assert decoded.is_response is False
    assert decoded.base_op == Op.PUT_BATCH


def test_response_bit_marks_a_response_of_the_same_op() -> None:
    decoded = decode_header(encode_header(Op.EXISTS_BATCH | RESPONSE_BIT, 7, b"", status=Status.AUTH))

    assert decoded.is_response is True
    assert decoded.base_op == Op.EXISTS_BATCH
    assert decoded.status == Status.AUTH


@pytest.mark.parametrize("view", [bytes, bytearray, memoryview])
def test_decode_header_accepts_any_bytes_like(view: type) -> None:
    assert decode_header(view(encode_header(Op.PING, 3))).request_id == 3


@pytest.mark.parametrize("size", [0, 35, 37])
def test_decode_header_rejects_a_buffer_that_is_not_36_bytes(size: int) -> None:
    with pytest.raises(ProtocolError, match=f"header is {size} bytes, expected 36"):
        decode_header(bytes(size))


def test_decode_header_rejects_bad_magic() -> None:
    with pytest.raises(ProtocolError, match="bad magic b'HT'"):
        decode_header(raw_header(magic=b"HT"))


@pytest.mark.parametrize("version", [0, 2, 255])
def test_decode_header_rejects_another_protocol_version(version: int) -> None:
    with pytest.raises(ProtocolError, match=f"unsupported protocol version {version}"):
        decode_header(raw_header(version=version))


@pytest.mark.parametrize("op", [0, 0x50, 0x7F, RESPONSE_BIT, RESPONSE_BIT | 0x50, 0xFF])
def test_decode_header_rejects_an_unknown_op(op: int) -> None:
    with pytest.raises(ProtocolError, match=f"unknown op code {op}"):
        decode_header(raw_header(op=op))


def test_decode_header_rejects_meta_over_the_limit_before_allocating() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="meta section of 4194305 bytes exceeds 4194304"):
            decode_header(raw_header(meta_len=DEFAULT_LIMITS.max_meta_bytes + 1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


def test_decode_header_rejects_a_claim_of_2_pow_60_data_bytes_before_allocating() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=f"data section of {2**60} bytes exceeds {2**31}"):
            decode_header(raw_header(op=Op.PUT_BATCH, data_len=2**60))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


def test_decode_header_accepts_lengths_exactly_at_the_limits() -> None:
    head = raw_header(meta_len=DEFAULT_LIMITS.max_meta_bytes, data_len=DEFAULT_LIMITS.max_data_bytes)

    decoded = decode_header(head)

    assert (decoded.meta_len, decoded.data_len) == (DEFAULT_LIMITS.max_meta_bytes, DEFAULT_LIMITS.max_data_bytes)


def test_decode_header_applies_the_limits_it_is_given() -> None:
    small = Limits(max_meta_bytes=10, max_data_bytes=100)

    with pytest.raises(ProtocolError, match="meta section"):
        decode_header(raw_header(meta_len=11), small)
    with pytest.raises(ProtocolError, match="data section"):
        decode_header(raw_header(data_len=101), small)
    assert decode_header(raw_header(meta_len=10, data_len=100), small).data_len == 100


def test_verify_meta_accepts_intact_meta() -> None:
    meta = encode_keys(["a", "b"])
    verify_meta(decode_header(encode_header(Op.GET_BATCH, 1, meta)), meta)


@pytest.mark.parametrize("position", [0, 5, -1])
def test_verify_meta_catches_a_flipped_byte(position: int) -> None:
    meta = encode_keys(["model@1@0@abc@bf16", "model@1@0@def@bf16"])
    header = decode_header(encode_header(Op.GET_BATCH, 1, meta))
    corrupt = bytearray(meta)
    corrupt[position] ^= 0x01

    with pytest.raises(ProtocolError, match="meta checksum mismatch"):
        verify_meta(header, corrupt)


# -- items (PUT_BATCH meta) -------------------------------------------------------------


def test_items_round_trip_with_layouts_and_unicode_keys() -> None:
    items = [
        item("vllm@llama@1@0@0a1b", 16, shape=(2, 4)),
        ItemMeta("ключ-😀", 0, 0, "uint8", (), 0),
        ItemMeta("k" * 1024, 3, 2**64 - 1, "f" * 32, tuple(range(1, 9)), 65535),
    ]

    meta = PutBatch.encode_items(items)

    assert PutBatch.decode_items(meta, data_len=19) == items
    assert PutBatch.decode_items(bytearray(meta), 19) == items
    assert PutBatch.decode_items(memoryview(meta), 19) == items


def test_put_options_ride_after_the_items_and_a_frame_without_them_gets_the_defaults() -> None:
    items = [item("a", 10), item("b", 6)]
    options = PutOptions(put_id=2**64 - 1, wait_ms=MAX_PUT_WAIT_MS)
    assert PutBatch.decode_request(PutBatch.encode_request(items, options), 16) == (items, options)
    assert PutBatch.decode_request(PutBatch.encode_items(items), 16) == (items, PutOptions())  # an older client's frame
    staged = PutStaged.encode_request("s.stage", "0" * 32, items, [4096, 4106], options=options)
    assert PutStaged.decode_request(staged)[2:] == (items, [4096, 4106], options)
    assert (
        PutStaged.decode_request(PutStaged.encode_request("s.stage", "0" * 32, items, [4096, 4106]))[4] == PutOptions()
    )


def test_put_options_of_another_size_or_out_of_range_are_protocol_errors() -> None:
    meta = PutBatch.encode_request([item("a", 10)], PutOptions(7, 100))
    with pytest.raises(ProtocolError, match="trailing"):
        PutBatch.decode_request(meta[:-1], 10)
    with pytest.raises(ProtocolError, match="trailing"):
        PutBatch.decode_request(meta + b"\x00", 10)
    too_long = PutBatch.encode_items([item("a", 10)]) + struct.pack("<QI", 7, MAX_PUT_WAIT_MS + 1)
    with pytest.raises(ProtocolError, match="wait_ms"):
        PutBatch.decode_request(too_long, 10)


def test_every_put_flag_is_one_outcome_and_an_unknown_flag_is_not_stored() -> None:
    assert [put_outcome(f) for f in (PUT_STORED, PUT_INTEGRITY, PUT_NO_ROOM, PUT_BUSY)] == [
        PutOutcome.STORED,
        PutOutcome.CORRUPT,
        PutOutcome.NO_ROOM,
        PutOutcome.BUSY,
    ]
    assert put_outcome(200) is PutOutcome.FAILED


def test_empty_item_list_round_trips() -> None:
    assert PutBatch.encode_items([]) == count(0)
    assert PutBatch.decode_items(PutBatch.encode_items([]), 0) == []


def test_decode_items_rejects_sizes_that_do_not_add_up_to_data_len() -> None:
    meta = PutBatch.encode_items([item("a", 10), item("b", 20)])

    with pytest.raises(ProtocolError, match="items declare 30 bytes but the frame carries 31"):
        PutBatch.decode_items(meta, 31)
    with pytest.raises(ProtocolError, match="items declare 30 bytes but the frame carries 29"):
        PutBatch.decode_items(meta, 29)


def test_decode_items_rejects_every_truncation() -> None:
    meta = PutBatch.encode_items([item("a"), item("bb", shape=(1, 2, 3))])

    for cut in range(len(meta)):
        with pytest.raises(ProtocolError, match="meta truncated"):
            PutBatch.decode_items(meta[:cut], 32)


def test_decode_items_rejects_trailing_bytes() -> None:
    meta = PutBatch.encode_items([item("a")])

    with pytest.raises(ProtocolError, match="1 unexpected trailing meta bytes"):
        PutBatch.decode_items(meta + b"\x00", 16)


def test_decode_items_rejects_more_items_than_the_limit_before_reading_them() -> None:
    with pytest.raises(ProtocolError, match="4097 items exceed the limit of 4096"):
        PutBatch.decode_items(count(4097), 0)
    with pytest.raises(ProtocolError, match=f"{2**32 - 1} items exceed"):
        PutBatch.decode_items(count(2**32 - 1), 0)


def test_decode_items_rejects_an_empty_key() -> None:
    with pytest.raises(ProtocolError, match=re.escape("key length 0 outside 1..1024")):
        PutBatch.decode_items(count(1) + raw_item(b""), 0)


def test_decode_items_rejects_a_key_over_the_limit() -> None:
    with pytest.raises(ProtocolError, match=re.escape("key length 1025 outside 1..1024")):
        PutBatch.decode_items(count(1) + raw_item(b"k" * 1025), 0)


def test_decode_items_rejects_a_key_that_is_not_utf8() -> None:
    with pytest.raises(ProtocolError, match="key is not valid UTF-8"):
        PutBatch.decode_items(count(1) + raw_item(b"\xff\xfe"), 0)


def test_decode_items_rejects_a_dtype_that_is_not_utf8() -> None:
    with pytest.raises(ProtocolError, match="dtype is not valid UTF-8"):
        PutBatch.decode_items(count(1) + raw_item(b"k", dtype=b"\xc3"), 0)


@pytest.mark.parametrize("dtype", [b"", b"x" * 33])
def test_decode_items_rejects_an_empty_or_long_dtype(dtype: bytes) -> None:
    with pytest.raises(ProtocolError, match=re.escape(f"dtype length {len(dtype)} outside 1..32")):
        PutBatch.decode_items(count(1) + raw_item(b"k", dtype=dtype), 0)


def test_decode_items_rejects_more_dimensions_than_the_limit() -> None:
    with pytest.raises(ProtocolError, match="9 dimensions exceed the limit of 8"):
        PutBatch.decode_items(count(1) + raw_item(b"k", shape=tuple(range(9))), 0)


def test_decode_items_honours_custom_limits() -> None:
    limits = Limits(max_items=1, max_key_bytes=2, max_ndim=1)
    meta = PutBatch.encode_items([item("ab", shape=(4,))], limits)

    assert PutBatch.decode_items(meta, 16, limits)[0].key == "ab"
    with pytest.raises(ProtocolError, match="2 items exceed the limit of 1"):
        PutBatch.decode_items(PutBatch.encode_items([item("a"), item("b")]), 32, limits)


def test_encode_items_refuses_what_the_decoder_would_reject() -> None:
    with pytest.raises(ProtocolError, match="key of 0 bytes"):
        PutBatch.encode_items([item("")])
    with pytest.raises(ProtocolError, match="key of 1025 bytes"):
        PutBatch.encode_items([item("k" * 1025)])
    with pytest.raises(ProtocolError, match="more than 8 dimensions"):
        PutBatch.encode_items([item("k", shape=(1,) * 9)])
    with pytest.raises(ProtocolError, match="dtype name '' is empty or too long"):
        PutBatch.encode_items([item("k", dtype="")])
    with pytest.raises(ProtocolError, match="4097 items exceed"):
        PutBatch.encode_items([item(f"k{i}") for i in range(4097)])


# -- keys (GET / EXISTS / DELETE meta) ----------------------------------------------------


def test_keys_round_trip() -> None:
    keys = ["a", "ключ", "k" * 1024, "model@8@3@deadbeef@bfloat16"]

    assert decode_keys(encode_keys(keys)) == keys
    assert decode_keys(bytearray(encode_keys(keys))) == keys
    assert decode_keys(encode_keys([])) == []


def test_keys_meta_is_a_count_then_length_prefixed_utf8() -> None:
    assert encode_keys(["ab", "é"]) == count(2) + b"\x02\x00ab" + b"\x02\x00\xc3\xa9"


def test_decode_keys_rejects_truncation_trailing_bytes_and_bad_keys() -> None:
    meta = encode_keys(["abc", "de"])
    for cut in range(len(meta)):
        with pytest.raises(ProtocolError, match="meta truncated"):
            decode_keys(meta[:cut])
    with pytest.raises(ProtocolError, match="trailing"):
        decode_keys(meta + b"x")
    with pytest.raises(ProtocolError, match="key length 0"):
        decode_keys(count(1) + b"\x00\x00")
    with pytest.raises(ProtocolError, match="key length 1025"):
        decode_keys(count(1) + struct.pack("<H", 1025) + b"k" * 1025)
    with pytest.raises(ProtocolError, match="key is not valid UTF-8"):
        decode_keys(count(1) + b"\x01\x00\x80")
    with pytest.raises(ProtocolError, match="4097 items exceed"):
        decode_keys(count(4097))


def test_encode_keys_refuses_empty_long_and_too_many_keys() -> None:
    with pytest.raises(ProtocolError):
        encode_keys([""])
    with pytest.raises(ProtocolError):
        encode_keys(["é" * 513])  # 1026 UTF-8 bytes
    with pytest.raises(ProtocolError, match="4097 keys exceed"):
        encode_keys(["k"] * 4097)


# -- flags (PUT / EXISTS / DELETE responses) -------------------------------------------------


def test_flags_round_trip() -> None:
    flags = [PUT_STORED, PUT_INTEGRITY, PUT_NO_ROOM, 1, 0]

    meta = encode_flags(flags)

    assert meta == count(5) + bytes(flags)
    assert decode_flags(meta, expected=5) == flags
    assert decode_flags(encode_flags([]), expected=0) == []


def test_decode_flags_rejects_a_count_other_than_the_request_had() -> None:
    with pytest.raises(ProtocolError, match="response carries 2 results for 3 requested"):
        decode_flags(encode_flags([0, 1]), expected=3)


def test_decode_flags_rejects_truncation_and_trailing_bytes() -> None:
    with pytest.raises(ProtocolError, match="meta truncated"):
        decode_flags(count(3) + b"\x00\x01", expected=3)
    with pytest.raises(ProtocolError, match="trailing"):
        decode_flags(encode_flags([1]) + b"\x00", expected=1)


# -- GET_BATCH response meta -------------------------------------------------------------


def test_get_response_round_trips_hits_and_misses() -> None:
    keys = ["a", "b", "c"]
    found = [item("a", 10), None, item("c", 5, shape=())]

    meta = GetBatch.encode_answer(found)

    assert GetBatch.decode_answer(meta, keys, data_len=15) == found
    first_item_len = len(PutBatch.encode_items([item("a", 10)])) - 4
    assert meta[:5] == count(3) + b"\x01"  # count, then a found flag before each hit
    assert meta[5 + first_item_len] == 0  # a miss is just its zero flag


def test_get_response_of_only_misses_carries_no_data() -> None:
    meta = GetBatch.encode_answer([None, None])

    assert meta == count(2) + b"\x00\x00"
    assert GetBatch.decode_answer(meta, ["x", "y"], 0) == [None, None]


def test_decode_get_response_rejects_an_answer_for_another_key() -> None:
    meta = GetBatch.encode_answer([item("other")])

    with pytest.raises(ProtocolError, match="answered 'other' for 'mine'"):
        GetBatch.decode_answer(meta, ["mine"], 16)


def test_decode_get_response_rejects_a_result_count_mismatch() -> None:
    with pytest.raises(ProtocolError, match="GET response carries 1 results for 2 keys"):
        GetBatch.decode_answer(GetBatch.encode_answer([None]), ["a", "b"], 0)


def test_decode_get_response_rejects_a_data_len_mismatch() -> None:
    meta = GetBatch.encode_answer([item("a", 10)])

    with pytest.raises(ProtocolError, match="GET response declares 10 bytes but carries 11"):
        GetBatch.decode_answer(meta, ["a"], 11)


def test_decode_get_response_rejects_truncation_and_trailing_bytes() -> None:
    meta = GetBatch.encode_answer([item("a", 10), None])
    for cut in range(len(meta)):
        with pytest.raises(ProtocolError):
            GetBatch.decode_answer(meta[:cut], ["a", "b"], 10)
    with pytest.raises(ProtocolError, match="trailing"):
        GetBatch.decode_answer(meta + b"\x00", ["a", "b"], 10)


# -- JSON control messages (HELLO, AUTH, STAT, PING) ----------------------------------------


def test_json_round_trips_and_is_compact_with_sorted_keys() -> None:
    body = {"nonce": "ab" * 32, "epoch": 7, "auth_required": True, "node_id": "n-1"}

    meta = encode_json(body)

    assert decode_json(meta) == body
    assert meta == b'{"auth_required":true,"epoch":7,"node_id":"n-1","nonce":"' + b"ab" * 32 + b'"}'


def test_empty_json_meta_is_an_empty_object() -> None:
    assert decode_json(b"") == {}


@pytest.mark.parametrize(
    ("meta", "fragment"),
    [
        (b"[1,2]", "not a JSON object"),
        (b'"text"', "not a JSON object"),
        (b"{", "not JSON"),
        (b"\xff{}", "not JSON"),
        (b"NaN", "not a JSON object"),
    ],
)
def test_decode_json_rejects_anything_but_a_json_object(meta: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        decode_json(meta)


@pytest.mark.parametrize("meta", [b"1" * 5000, b"[" * 100_000], ids=["huge-int", "deep-nesting"])
def test_decode_json_turns_every_malformed_message_into_protocol_error(meta: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_json(meta)


# -- errors <-> status ----------------------------------------------------------------


ERROR_STATUS = [
    (ProtocolError, Status.PROTOCOL),
    (AuthError, Status.AUTH),
    (CapacityError, Status.CAPACITY),
    (IntegrityError, Status.INTEGRITY),
    (MetadataError, Status.METADATA),
]


@pytest.mark.parametrize(("error", "status"), ERROR_STATUS)
def test_error_for_status_raises_the_matching_class_with_the_node_message(
    error: type[KVPoolError], status: Status
) -> None:
    exc = error_for_status(status, "disk on fire")

    assert type(exc) is error
    assert str(exc) == "node: disk on fire"


@pytest.mark.parametrize(("error", "status"), ERROR_STATUS)
def test_status_for_error_maps_each_error_class_back(error: type[KVPoolError], status: Status) -> None:
    assert status_for_error(error("x")) is status
    assert status_for_error(error_for_status(status, "x")) is status


@pytest.mark.parametrize("status", [Status.OK, Status.INTERNAL, 99])
def test_error_for_unmapped_status_is_a_plain_kvpool_error(status: int) -> None:
    exc = error_for_status(status, "boom")

    assert type(exc) is KVPoolError
    assert str(exc) == "node: boom"


@pytest.mark.parametrize(
    "exc", [KVPoolError("x"), ConfigError("k", "x"), NodeUnavailable("x"), NcclError("x"), RuntimeError("x")]
)
def test_status_for_other_errors_is_internal(exc: BaseException) -> None:
    assert status_for_error(exc) is Status.INTERNAL


# -- hostile input: decode or ProtocolError, never anything else ----------------------------------


def _decodes_or_protocol_error(call: Callable[[], T], expected: type) -> None:
    """Run a decoder on hostile input: it returns a well-typed value or raises ProtocolError."""
    try:
        result = call()
    except ProtocolError:
        return
    assert isinstance(result, expected)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=72))
def test_random_bytes_never_crash_decode_header(data: bytes) -> None:
    _decodes_or_protocol_error(lambda: decode_header(data), Header)
    _decodes_or_protocol_error(lambda: decode_header(data[:36].ljust(36, b"\x00")), Header)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), st.integers(0, 255), st.binary(min_size=34, max_size=34))
def test_random_headers_with_the_right_magic_decode_or_raise_protocol_error(version: int, op: int, rest: bytes) -> None:
    data = MAGIC + rest
    data = data[:2] + bytes([version, op]) + data[4:]
    _decodes_or_protocol_error(lambda: decode_header(data), Header)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.integers(0, 2**64 - 1))
def test_random_bytes_never_crash_decode_items(data: bytes, data_len: int) -> None:
    _decodes_or_protocol_error(lambda: PutBatch.decode_items(data, data_len), list)
    # Give the fuzzer a plausible count so it reaches the per-item fields.
    _decodes_or_protocol_error(lambda: PutBatch.decode_items(count(1) + data, data_len), list)
    _decodes_or_protocol_error(lambda: PutBatch.decode_request(count(1) + data, data_len), tuple)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_decode_keys(data: bytes) -> None:
    _decodes_or_protocol_error(lambda: decode_keys(data), list)
    _decodes_or_protocol_error(lambda: decode_keys(count(2) + data), list)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.lists(st.text(min_size=1, max_size=8), max_size=3), st.integers(0, 2**32))
def test_random_bytes_never_crash_decode_get_response(data: bytes, keys: list[str], data_len: int) -> None:
    _decodes_or_protocol_error(lambda: GetBatch.decode_answer(data, keys, data_len), list)
    _decodes_or_protocol_error(lambda: GetBatch.decode_answer(count(len(keys)) + b"\x01" + data, keys, data_len), list)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.builds(
            ItemMeta,
            key=st.text(min_size=1, max_size=40),
            nbytes=st.integers(0, DEFAULT_LIMITS.max_data_bytes),
            checksum=st.integers(0, 2**64 - 1),
            dtype=st.sampled_from(["uint8", "bfloat16", "float16", "float32", "float8_e4m3fn"]),
            shape=st.lists(st.integers(0, 2**40), max_size=8).map(tuple),
            fmt=st.integers(0, 65535),
        ),
        max_size=5,
    )
)
def test_any_valid_items_round_trip(items: list[ItemMeta]) -> None:
    total = sum(i.nbytes for i in items)

    assert PutBatch.decode_items(PutBatch.encode_items(items), total) == items
    found = [i if n % 2 == 0 else None for n, i in enumerate(items)]
    expected_len = sum(i.nbytes for i in found if i is not None)
    keys = [i.key for i in items]
    assert GetBatch.decode_answer(GetBatch.encode_answer(found), keys, expected_len) == found


# -- INVENTORY (admin) --------------------------------------------------------------------
def test_an_inventory_answer_decodes_into_typed_rows() -> None:
    assert decode_json(Inventory.encode_request("k@3", 500)) == {"after": "k@3", "limit": 500}
    meta = encode_json({"items": [["k@4", "dram", 16, 7], ["k@5", "nvme", 0, 2**64 - 1]], "more": True})
    assert Inventory.decode_answer(meta) == InventoryPage(
        (InventoryRow("k@4", "dram", 16, 7), InventoryRow("k@5", "nvme", 0, 2**64 - 1)), True
    )
    assert Inventory.decode_answer(encode_json({"items": [], "more": False})) == InventoryPage((), False)


@pytest.mark.parametrize(
    "body",
    [
        {"items": [["k", "dram", 16]], "more": False},  # a row short of its checksum
        {"items": [["", "dram", 16, 1]], "more": False},  # an empty key
        {"items": [["k", "dram", -1, 1]], "more": False},
        {"items": [["k", "dram", 16, 2**64]], "more": False},
        {"items": [[1, "dram", 16, 1]], "more": False},
        {"items": "k", "more": False},
        {"items": []},  # no "more"
    ],
)
def test_a_malformed_inventory_answer_is_a_protocol_error(body: dict[str, object]) -> None:
    with pytest.raises(ProtocolError, match="INVENTORY"):
        Inventory.decode_answer(encode_json(body))


@pytest.mark.parametrize("limit", [0, -1, 10_001])
def test_an_inventory_request_outside_the_page_limit_is_refused(limit: int) -> None:
    with pytest.raises(ProtocolError, match=r"1\.\.10000"):
        Inventory.encode_request("", limit)


def test_the_node_side_of_inventory_is_the_same_codec() -> None:
    assert Inventory.decode_request(Inventory.encode_request("k@3", 500)) == ("k@3", 500)
    assert Inventory.decode_request(b"") == ("", 1000)  # an empty request: the first page
    page = InventoryPage((InventoryRow("k@4", "dram", 16, 7), InventoryRow("k@5", "nvme", 0, 2**64 - 1)), True)
    assert Inventory.decode_answer(Inventory.encode_answer(page)) == page
    with pytest.raises(ProtocolError, match=r"1\.\.10000"):
        Inventory.decode_request(encode_json({"after": "", "limit": 0}))


# -- STAT -------------------------------------------------------------------------------
def _stat_body() -> dict[str, object]:
    """A STAT answer as a node of this version sends it (keys as docs/operations.md lists them)."""
    return {
        "node_id": "n1",
        "epoch": 3,
        "uptime_s": 12.5,
        "counters": {"gets": 4, "hits": 3},
        "objects": 2,
        "leases": 1,
        "arena": {"path": "/dev/shm/a", "size_bytes": 64, "grown_bytes": 32, "allocated_bytes": 16, "fallbacks": 0},
        "tiers": {
            "dram": {"capacity_bytes": 64, "used_bytes": 16, "objects": 2},
            "nvme": {"capacity_bytes": 128, "used_bytes": 0, "objects": 0, "disk_full": False},
        },
        "recovery": {
            "files": 1,
            "bytes": 100,
            "quarantined": 0,
            "temp_removed": 2,
            "seconds": 0.25,
            "indexed": 1,
            "progress": 0.5,
            "done": False,
        },
        "latency": {"bounds_s": [0.001, 1.0], "ops": {"get_batch": {"counts": [1, 0, 0], "sum_s": 0.0005}}},
        "recent": {"window_s": 12.5, "requests_per_s": 0.32, "gets": 4, "hits": 3},
        "republish": {"running": True, "pending": 7, "published": 3, "seconds": 0.5},
        "pinned_chunks": 1,
        "pinned_bytes": 4096,
        "tenants": {
            "alice": {"held_bytes": 8, "quota_bytes": -1, "puts": 2, "hits": 1, "misses": 0, "quota_evictions": 0}
        },
    }


def test_a_stat_answer_decodes_into_a_typed_report_and_encodes_back_to_the_same_json() -> None:
    meta = encode_json(_stat_body())
    report = Stat.decode_answer(meta)
    assert report.tiers["nvme"] == TierReport(128, 0, 0, disk_full=False)
    assert report.tiers["dram"].disk_full is None  # NVMe only
    assert report.arena == ArenaReport("/dev/shm/a", 64, 32, 16, 0)
    assert report.recovery == RecoveryReport(1, 100, 0, 2, 0.25, indexed=1, progress=0.5, done=False)
    assert report.republish == RepublishReport(running=True, pending=7, published=3, seconds=0.5)
    assert report.recent == RecentReport(12.5, 0.32, 4, 3)
    assert Stat.encode_answer(report) == meta  # the wire is unchanged, byte for byte
    assert list(report.tiers["nvme"].to_json()) == ["capacity_bytes", "disk_full", "objects", "used_bytes"]
    assert (report.tenants["alice"].pool_quota_bytes, report.tenants["alice"].pool_share_bytes) == (-1, -1)


def test_a_tenants_pool_quota_and_share_go_through_stat_and_back() -> None:
    body = _stat_body()
    body["tenants"]["alice"] |= {"pool_quota_bytes": 64, "pool_share_bytes": 40}
    report = Stat.decode_answer(encode_json(body))
    assert (report.tenants["alice"].pool_quota_bytes, report.tenants["alice"].pool_share_bytes) == (64, 40)
    assert Stat.encode_answer(report) == encode_json(body)


def test_a_stat_answer_of_a_node_without_arena_recovery_or_latency_decodes_with_none() -> None:
    body = _stat_body()
    body.update(arena=None, recovery=None)
    del body["latency"], body["leases"], body["republish"]
    report = Stat.decode_answer(encode_json(body))
    assert (report.arena, report.recovery, report.latency, report.leases, report.republish) == (None,) * 3 + (0, None)
    assert isinstance(report, NodeReport)


def test_the_recovery_of_a_node_that_recovered_before_serving_decodes_as_finished() -> None:
    """A node of an earlier version sends no progress: it recovered everything before it served."""
    body = _stat_body()
    body["recovery"] = {"files": 4, "bytes": 100, "quarantined": 0, "temp_removed": 0, "seconds": 0.25}
    recovery = Stat.decode_answer(encode_json(body)).recovery
    assert recovery is not None and (recovery.indexed, recovery.progress, recovery.done) == (4, 1.0, True)


@pytest.mark.parametrize(
    "change",
    [
        {"node_id": 7},
        {"epoch": "3"},
        {"counters": {"gets": "4"}},
        {"counters": {"gets": True}},
        {"objects": None},
        {"tiers": []},
        {"tiers": {"dram": {"capacity_bytes": 64, "used_bytes": 16}}},
        {"tiers": {"nvme": {"capacity_bytes": 1, "used_bytes": 0, "objects": 0, "disk_full": "no"}}},
        {"recent": {"window_s": 1.0}},
        {"arena": {"path": 1}},
        {"recovery": {"files": 1}},
        {"recovery": {"files": 1, "bytes": 1, "quarantined": 0, "temp_removed": 0, "seconds": 0, "done": 1}},
        {"republish": {"running": True, "pending": 1}},
        {"republish": {"running": 1, "pending": 1, "published": 0, "seconds": 0}},
        {"latency": [1]},
    ],
)
def test_a_malformed_stat_answer_is_a_protocol_error_naming_the_field(change: dict[str, object]) -> None:
    body = _stat_body() | change
    with pytest.raises(ProtocolError):
        Stat.decode_answer(encode_json(body))


# -- TOUCH -------------------------------------------------------------------------------------
def test_touch_chains_round_trip_and_their_keys_are_bounded_in_all() -> None:
    from backend.protocol.reads import Touch

    chains = [["a@0", "a@1", "a@2"], ["b@0"]]
    assert Touch.decode_request(Touch.encode_request(chains)) == chains
    small = Limits(max_items=3)
    with pytest.raises(ProtocolError, match="exceed"):
        Touch.encode_request(chains, small)  # 4 keys in all
    with pytest.raises(ProtocolError, match="TOUCH chain"):
        Touch.decode_request(Touch.encode_request(chains), small)  # a node counts them in all, too
    with pytest.raises(ProtocolError, match="empty"):
        Touch.encode_request([["a@0"], []])
    with pytest.raises(ProtocolError, match="TOUCH chain"):
        Touch.decode_request(count(1) + count(0))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_decode_touch(data: bytes) -> None:
    from backend.protocol.reads import Touch

    _decodes_or_protocol_error(lambda: Touch.decode_request(data), list)
    _decodes_or_protocol_error(lambda: Touch.decode_request(count(1) + count(2) + data), list)
