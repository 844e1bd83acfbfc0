"""The wire format between clients and pool nodes (spec: docs/protocol.md).

Every frame is a fixed 36-byte header, a *meta* section and a *data* section::

    magic "KV" | version u8 | op u8 | status u16 | flags u16 | meta_len u32
    | request_id u64 | data_len u64 | meta_checksum u64            (little-endian)

``meta`` describes the frame (keys, sizes, per-item checksums, layouts); ``data`` is
the concatenated chunk payloads. The meta checksum (xxh3-64) covers the meta section,
and the meta section carries an xxh3-64 of every chunk, so every payload byte is
covered without hashing anything twice. Lengths are checked against :class:`Limits`
before anything is allocated. Responses carry the request's op with ``RESPONSE_BIT``
set; a non-zero status makes the meta a UTF-8 error message.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from backend.errors import (
    AuthError,
    CapacityError,
    IntegrityError,
    KVPoolError,
    MetadataError,
    NodeUnavailable,
    ProtocolError,
    PutOutcome,
)

__all__ = [
    "VERSION",
    "HEADER",
    "Op",
    "Status",
    "Header",
    "ItemMeta",
    "Limits",
    "checksum",
    "check_key",
    "check_item",
    "encode_put_staged",
    "decode_put_staged",
    "PutOptions",
    "encode_put_batch",
    "decode_put_batch",
    "PUT_STORED",
    "PUT_INTEGRITY",
    "PUT_NO_CAPACITY",
    "PUT_BUSY",
    "put_outcome",
    "MAX_PUT_WAIT_MS",
    "verify_meta",
    "encode_header",
    "decode_header",
    "encode_items",
    "decode_items",
    "encode_keys",
    "decode_keys",
    "encode_flags",
    "decode_flags",
    "encode_get_response",
    "decode_get_response",
    "encode_json",
    "decode_json",
    "encode_lease_request",
    "decode_lease_request",
    "encode_lease_response",
    "decode_lease_response",
    "encode_release",
    "decode_release",
    "LEASE_MAP",
    "NO_OFFSET",
    "error_for_status",
    "status_for_error",
    "ChannelRequest",
    "encode_channel_request",
    "decode_channel_request",
    "encode_channel_response",
    "decode_channel_response",
    "InventoryRow",
    "InventoryPage",
    "MAX_INVENTORY_PAGE",
    "encode_inventory_request",
    "decode_inventory_response",
    "decode_inventory_request",
    "encode_inventory_response",
    "Verified",
    "TierReport",
    "tiers_from_json",
    "ArenaReport",
    "RecoveryReport",
    "RepublishReport",
    "RecentReport",
    "NodeReport",
    "encode_node_report",
    "decode_node_report",
]

MAGIC = b"KV"
VERSION = 1
HEADER = struct.Struct("<2sBBHHIQQQ")
RESPONSE_BIT = 0x80

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_ITEM_FIXED = struct.Struct("<QQH")  # nbytes, checksum, fmt
_U64 = struct.Struct("<Q")
_LEASE_HEAD = struct.Struct("<IB")  # ttl_ms, flags


class Op(enum.IntEnum):
    HELLO = 1
    AUTH = 2
    PUT_BATCH = 3
    GET_BATCH = 4
    EXISTS_BATCH = 5
    DELETE_BATCH = 6
    STAT = 7
    PING = 8
    INVENTORY = 9  # admin: page through the keys a node holds
    VERIFY_BATCH = 10  # admin: a node re-checks its own copies' checksums
    LEASE = 11  # pin keys for a while; with LEASE_MAP, answer same-host arena offsets
    RELEASE = 12  # end a lease (or its hold on some keys)
    CHANNEL_GET = 13  # ask for chunks whose bytes travel over the channel (nccl_channel), not this socket
    PUT_STAGED = 14  # a put whose bytes wait in the client's shared-memory stage on the node's host


class Status(enum.IntEnum):
    OK = 0
    PROTOCOL = 1
    AUTH = 2
    CAPACITY = 3
    INTEGRITY = 4
    METADATA = 5
    INTERNAL = 6
    UNAVAILABLE = 7  # the node is closing this connection (shed, handshake deadline): request id 0, the reason


# LEASE request flags, and the offset of a leased chunk that has no arena region.
LEASE_MAP = 0x1
NO_OFFSET = 2**64 - 1

# Per-item outcome of a PUT_BATCH or PUT_STAGED, in the response's flag list.
PUT_STORED = 0
PUT_INTEGRITY = 1
PUT_NO_CAPACITY = 2
PUT_BUSY = 3  # DRAM stayed full of puts in flight until the request's wait ran out
_PUT_OUTCOMES = {
    PUT_STORED: PutOutcome.STORED,
    PUT_INTEGRITY: PutOutcome.CORRUPT,
    PUT_NO_CAPACITY: PutOutcome.NO_ROOM,
    PUT_BUSY: PutOutcome.BUSY,
}


def put_outcome(flag: int) -> PutOutcome:
    """The outcome a node's PUT flag stands for (a flag this side does not know: the chunk is not stored)."""
    return _PUT_OUTCOMES.get(flag, PutOutcome.FAILED)


@dataclass(frozen=True)
class Limits:
    """Hard limits a node enforces before allocating anything for a frame."""

    max_meta_bytes: int = 4 * 1024 * 1024
    # A HELLO or AUTH, and any frame before its connection is admitted (docs/protocol.md), needs
    # a few hundred bytes: a peer that has proven nothing cannot make the node hold 4 MiB.
    max_handshake_meta_bytes: int = 4096
    max_data_bytes: int = 2 * 1024 * 1024 * 1024
    max_items: int = 4096
    max_key_bytes: int = 1024
    max_dtype_bytes: int = 32
    max_ndim: int = 8


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Header:
    op: int
    status: int
    flags: int
    meta_len: int
    request_id: int
    data_len: int
    meta_checksum: int

    @property
    def is_response(self) -> bool:
        return bool(self.op & RESPONSE_BIT)

    @property
    def base_op(self) -> int:
        return self.op & ~RESPONSE_BIT


@dataclass(frozen=True)
class ItemMeta:
    """One chunk: its key, byte length, xxh3-64 checksum and tensor layout."""

    key: str
    nbytes: int
    checksum: int
    dtype: str
    shape: tuple[int, ...]
    fmt: int


def checksum(data: Any) -> int:
    """xxh3-64 of a bytes-like object (memoryviews are hashed in place)."""
    return int(xxhash.xxh3_64_intdigest(data))


def checksum_stream() -> Any:
    """A running :func:`checksum`: ``update()`` it piece by piece, then ``intdigest()``."""
    return xxhash.xxh3_64()


def encode_header(
    op: int,
    request_id: int,
    meta: bytes | bytearray | memoryview = b"",
    data_len: int = 0,
    status: int = Status.OK,
) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, status, 0, len(meta), request_id, data_len, checksum(meta))


def decode_header(buf: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Parse and bound-check a header; raises ProtocolError before anything is allocated."""
    if len(buf) != HEADER.size:
        raise ProtocolError(f"header is {len(buf)} bytes, expected {HEADER.size}")
    magic, version, op, status, flags, meta_len, request_id, data_len, meta_sum = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}, this side speaks {VERSION}")
    if op & ~RESPONSE_BIT not in _OP_VALUES:
        raise ProtocolError(f"unknown op code {op}")
    if meta_len > limits.max_meta_bytes:
        raise ProtocolError(f"meta section of {meta_len} bytes exceeds {limits.max_meta_bytes}")
    if data_len > limits.max_data_bytes:
        raise ProtocolError(f"data section of {data_len} bytes exceeds {limits.max_data_bytes}")
    return Header(op, status, flags, meta_len, request_id, data_len, meta_sum)


_OP_VALUES = frozenset(int(op) for op in Op)


def verify_meta(header: Header, meta: bytes | bytearray | memoryview) -> None:
    if checksum(meta) != header.meta_checksum:
        raise ProtocolError("meta checksum mismatch")


class _Reader:
    """Bounds-checked cursor over a meta section."""

    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if end > len(self.view):
            raise ProtocolError(f"meta truncated while reading {what}")
        out = self.view[self.pos : end]
        self.pos = end
        return out

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size, what))

    def text(self, n: int, what: str) -> str:
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{what} is not valid UTF-8") from None

    def count(self, limits: Limits) -> int:
        (n,) = self.unpack(_U32, "item count")
        if n > limits.max_items:
            raise ProtocolError(f"{n} items exceed the limit of {limits.max_items}")
        return int(n)

    def key(self, limits: Limits) -> str:
        (n,) = self.unpack(_U16, "key length")
        if n == 0 or n > limits.max_key_bytes:
            raise ProtocolError(f"key length {n} outside 1..{limits.max_key_bytes}")
        return self.text(n, "key")

    @property
    def remaining(self) -> int:
        return len(self.view) - self.pos

    def done(self) -> None:
        if self.pos != len(self.view):
            raise ProtocolError(f"{len(self.view) - self.pos} unexpected trailing meta bytes")


def check_key(key: str, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The key's UTF-8 bytes; a ProtocolError naming the rule if it is not a storable key."""
    if not isinstance(key, str):
        raise ProtocolError(f"key {key!r} is a {type(key).__name__}; keys are str")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError(f"key {key[:80]!r} is not valid UTF-8 ({exc.reason} at index {exc.start})") from None
    if not raw:
        raise ProtocolError(f"key of 0 bytes: a key is 1..{limits.max_key_bytes} UTF-8 bytes (max_key_bytes)")
    if len(raw) > limits.max_key_bytes:
        raise ProtocolError(f"key of {len(raw)} bytes is over max_key_bytes = {limits.max_key_bytes}: {key[:40]!r}...")
    return raw


def check_item(item: ItemMeta, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The item's dtype name in ASCII; a ProtocolError naming the limit if it breaks one."""
    check_key(item.key, limits)
    if not 0 <= item.nbytes <= limits.max_data_bytes:
        raise ProtocolError(
            f"value of {item.key[:80]!r} is {item.nbytes} bytes, over max_data_bytes = {limits.max_data_bytes}"
        )
    if not (0 <= item.checksum < 2**64 and 0 <= item.fmt < 2**16):
        raise ProtocolError(f"item {item.key[:80]!r}: checksum or fmt out of range")
    if any(not 0 <= d < 2**64 for d in item.shape):
        raise ProtocolError(f"item {item.key[:80]!r}: shape {item.shape} has a negative or huge dimension")
    if len(item.shape) > limits.max_ndim:
        raise ProtocolError(f"item {item.key[:80]!r}: shape has more than {limits.max_ndim} dimensions (max_ndim)")
    if not item.dtype.isascii():
        raise ProtocolError(f"item {item.key[:80]!r}: dtype name {item.dtype!r} is not ASCII")
    dtype = item.dtype.encode("ascii")
    if not 0 < len(dtype) <= limits.max_dtype_bytes:
        raise ProtocolError(
            f"dtype name {item.dtype!r} is empty or too long: 1..{limits.max_dtype_bytes} bytes (max_dtype_bytes)"
        )
    return dtype


def _encode_key(out: bytearray, key: str, limits: Limits) -> None:
    raw = check_key(key, limits)
    out += _U16.pack(len(raw))
    out += raw


def _encode_item(out: bytearray, item: ItemMeta, limits: Limits) -> None:
    dtype = check_item(item, limits)
    _encode_key(out, item.key, limits)
    out += _ITEM_FIXED.pack(item.nbytes, item.checksum, item.fmt)
    out += _U8.pack(len(dtype))
    out += dtype
    out += _U8.pack(len(item.shape))
    out += struct.pack(f"<{len(item.shape)}Q", *item.shape)


def _decode_item(reader: _Reader, limits: Limits) -> ItemMeta:
    key = reader.key(limits)
    nbytes, item_sum, fmt = reader.unpack(_ITEM_FIXED, "item header")
    (dtype_len,) = reader.unpack(_U8, "dtype length")
    if not 0 < dtype_len <= limits.max_dtype_bytes:
        raise ProtocolError(f"dtype length {dtype_len} outside 1..{limits.max_dtype_bytes}")
    dtype = reader.text(dtype_len, "dtype")
    (ndim,) = reader.unpack(_U8, "ndim")
    if ndim > limits.max_ndim:
        raise ProtocolError(f"{ndim} dimensions exceed the limit of {limits.max_ndim}")
    shape = struct.unpack(f"<{ndim}Q", reader.take(8 * ndim, "shape"))
    return ItemMeta(key, int(nbytes), int(item_sum), dtype, tuple(int(d) for d in shape), int(fmt))


def encode_items(items: Sequence[ItemMeta], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of a PUT_BATCH request: item count, then each item's meta."""
    if len(items) > limits.max_items:
        raise ProtocolError(f"{len(items)} items exceed the limit of {limits.max_items}")
    out = bytearray(_U32.pack(len(items)))
    for item in items:
        _encode_item(out, item, limits)
    return _bounded(out, limits)


def _bounded(meta: bytearray, limits: Limits) -> bytes:
    if len(meta) > limits.max_meta_bytes:
        raise ProtocolError(f"meta section of {len(meta)} bytes exceeds {limits.max_meta_bytes}; send fewer items")
    return bytes(meta)


def decode_items(
    meta: bytes | bytearray | memoryview, data_len: int, limits: Limits = DEFAULT_LIMITS
) -> list[ItemMeta]:
    """Decode PUT_BATCH meta and check the items add up to the declared data length."""
    reader = _Reader(meta)
    items = [_decode_item(reader, limits) for _ in range(reader.count(limits))]
    reader.done()
    total = sum(item.nbytes for item in items)
    if total != data_len:
        raise ProtocolError(f"items declare {total} bytes but the frame carries {data_len}")
    return items


# -- put options: a PUT_BATCH's or PUT_STAGED's optional trailer ---------------------------
_PUT_OPTIONS = struct.Struct("<QI")  # put_id, wait_ms
MAX_PUT_WAIT_MS = 600_000
DEFAULT_PUT_WAIT_MS = 1000  # a request without options (an older client) waits this long for room


@dataclass(frozen=True)
class PutOptions:
    """What a put request tells the node beyond its items.

    ``put_id`` names the client's put call the request is part of (a put striped over
    several connections, or over several PUT_STAGED parts, sends one id in each): the
    node never evicts a chunk of a put to make room for the same put. 0: the request is
    a put of its own. ``wait_ms``: how long the node may hold the request back waiting
    for room while DRAM is full of other puts in flight, before it answers ``PUT_BUSY``.
    """

    put_id: int = 0
    wait_ms: int = DEFAULT_PUT_WAIT_MS

    def __post_init__(self) -> None:
        if not 0 <= self.put_id < 2**64 or not 0 <= self.wait_ms <= MAX_PUT_WAIT_MS:
            raise ProtocolError(
                f"put options out of range: put_id {self.put_id}, wait_ms {self.wait_ms} (0..{MAX_PUT_WAIT_MS})"
            )


def _put_options(reader: _Reader) -> PutOptions:
    """The trailer if the meta has one (exactly its size left), else the defaults."""
    if reader.remaining != _PUT_OPTIONS.size:
        return PutOptions()
    put_id, wait_ms = reader.unpack(_PUT_OPTIONS, "put options")
    return PutOptions(int(put_id), int(wait_ms))


def encode_put_batch(items: Sequence[ItemMeta], options: PutOptions, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of a PUT_BATCH request: the items (as :func:`encode_items`), then the put options."""
    return _bounded(bytearray(encode_items(items, limits) + _PUT_OPTIONS.pack(options.put_id, options.wait_ms)), limits)


def decode_put_batch(
    meta: bytes | bytearray | memoryview, data_len: int, limits: Limits = DEFAULT_LIMITS
) -> tuple[list[ItemMeta], PutOptions]:
    """Decode PUT_BATCH meta (items, and the put options if present); the items must add up to ``data_len``."""
    reader = _Reader(meta)
    items = [_decode_item(reader, limits) for _ in range(reader.count(limits))]
    options = _put_options(reader)
    reader.done()
    total = sum(item.nbytes for item in items)
    if total != data_len:
        raise ProtocolError(f"items declare {total} bytes but the frame carries {data_len}")
    return items, options


def encode_keys(keys: Sequence[str], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of GET/EXISTS/DELETE requests."""
    if len(keys) > limits.max_items:
        raise ProtocolError(f"{len(keys)} keys exceed the limit of {limits.max_items}")
    out = bytearray(_U32.pack(len(keys)))
    for key in keys:
        _encode_key(out, key, limits)
    return _bounded(out, limits)


def decode_keys(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> list[str]:
    reader = _Reader(meta)
    keys = [reader.key(limits) for _ in range(reader.count(limits))]
    reader.done()
    return keys


def encode_flags(flags: Sequence[int]) -> bytes:
    """Meta of EXISTS/DELETE/PUT responses: one status byte per item."""
    if any(not 0 <= f <= 255 for f in flags):
        raise ProtocolError("a result flag is outside 0..255")
    return _U32.pack(len(flags)) + bytes(flags)


def decode_flags(meta: bytes | bytearray | memoryview, expected: int) -> list[int]:
    reader = _Reader(meta)
    (n,) = reader.unpack(_U32, "flag count")
    if n != expected:
        raise ProtocolError(f"response carries {n} results for {expected} requested")
    flags = list(reader.take(n, "flags"))
    reader.done()
    return flags


def encode_get_response(found: Sequence[ItemMeta | None], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of a GET_BATCH response: per key a found byte and, if found, the item."""
    out = bytearray(_U32.pack(len(found)))
    for item in found:
        if item is None:
            out += b"\x00"
        else:
            out += b"\x01"
            _encode_item(out, item, limits)
    return _bounded(out, limits)


def _decode_answers(
    reader: _Reader, keys: Sequence[str], what: str, limits: Limits, *, offsets: bool
) -> list[tuple[ItemMeta, int | None] | None]:
    """Per key of a GET or LEASE answer: None (not found) or its item and, for LEASE, its offset."""
    n = reader.count(limits)
    if n != len(keys):
        raise ProtocolError(f"{what} response carries {n} results for {len(keys)} keys")
    found: list[tuple[ItemMeta, int | None] | None] = []
    for key in keys:
        (flag,) = reader.unpack(_U8, "found flag")
        if flag == 0:
            found.append(None)
            continue
        item = _decode_item(reader, limits)
        if item.key != key:
            raise ProtocolError(f"{what} response answered {item.key!r} for {key!r}")
        offset = None
        if offsets:
            (raw,) = reader.unpack(_U64, "offset")
            offset = None if raw == NO_OFFSET else int(raw)
        found.append((item, offset))
    return found


def decode_get_response(
    meta: bytes | bytearray | memoryview, keys: Sequence[str], data_len: int, limits: Limits = DEFAULT_LIMITS
) -> list[ItemMeta | None]:
    reader = _Reader(meta)
    found = [None if a is None else a[0] for a in _decode_answers(reader, keys, "GET", limits, offsets=False)]
    reader.done()
    total = sum(item.nbytes for item in found if item is not None)
    if total != data_len:
        raise ProtocolError(f"GET response declares {total} bytes but carries {data_len}")
    return found


MAX_STAGE_NAME_BYTES = 64
STAGE_TOKEN_BYTES = 32


def encode_put_staged(
    stage: str,
    token: str,
    items: Sequence[ItemMeta],
    offsets: Sequence[int],
    limits: Limits = DEFAULT_LIMITS,
    options: PutOptions | None = None,
) -> bytes:
    """Meta of a PUT_STAGED request: the stage's file name and token, the items as in PUT_BATCH,
    each item's offset in the stage, then the put options (none: the node's defaults)."""
    name, secret = stage.encode("ascii"), token.encode("ascii")
    if not 0 < len(name) <= MAX_STAGE_NAME_BYTES or len(secret) != STAGE_TOKEN_BYTES or len(offsets) != len(items):
        raise ProtocolError("PUT_STAGED needs a stage name, its 32-character token and an offset per item")
    out = bytearray(_U8.pack(len(name)) + name + secret)
    out += encode_items(items, limits)
    out += b"".join(_U64.pack(offset) for offset in offsets)
    if options is not None:
        out += _PUT_OPTIONS.pack(options.put_id, options.wait_ms)
    return _bounded(out, limits)


def decode_put_staged(
    meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
) -> tuple[str, str, list[ItemMeta], list[int], PutOptions]:
    """``(stage name, token, items, offsets, options)`` of a PUT_STAGED request (the name is not yet checked)."""
    reader = _Reader(meta)
    (name_len,) = reader.unpack(_U8, "stage name length")
    if not 0 < name_len <= MAX_STAGE_NAME_BYTES:
        raise ProtocolError(f"stage name length {name_len} outside 1..{MAX_STAGE_NAME_BYTES}")
    name = reader.text(name_len, "stage name")
    token = reader.text(STAGE_TOKEN_BYTES, "stage token")
    items = [_decode_item(reader, limits) for _ in range(reader.count(limits))]
    offsets = [int(reader.unpack(_U64, "stage offset")[0]) for _ in items]
    options = _put_options(reader)
    reader.done()
    return name, token, items, offsets, options


def encode_lease_request(keys: Sequence[str], ttl_ms: int, flags: int, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of a LEASE request: ttl, flags, then the keys as in GET."""
    if not 0 < ttl_ms < 2**32 or not 0 <= flags <= 255:
        raise ProtocolError(f"lease ttl_ms {ttl_ms} or flags {flags} out of range")
    return _LEASE_HEAD.pack(ttl_ms, flags) + encode_keys(keys, limits)


def decode_lease_request(
    meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
) -> tuple[int, int, list[str]]:
    """``(ttl_ms, flags, keys)`` of a LEASE request."""
    if len(meta) < _LEASE_HEAD.size:
        raise ProtocolError("LEASE meta truncated before its ttl and flags")
    ttl_ms, flags = _LEASE_HEAD.unpack(bytes(meta[: _LEASE_HEAD.size]))
    if flags & ~LEASE_MAP:
        raise ProtocolError(f"unknown LEASE flags {flags:#x}")
    return int(ttl_ms), int(flags), decode_keys(memoryview(meta)[_LEASE_HEAD.size :], limits)


def encode_lease_response(
    lease_id: int, found: Sequence[tuple[ItemMeta, int] | None], limits: Limits = DEFAULT_LIMITS
) -> bytes:
    """Meta of a LEASE response: the lease id, then per key a found byte and, if found, item + offset."""
    out = bytearray(_U64.pack(lease_id) + _U32.pack(len(found)))
    for entry in found:
        if entry is None:
            out += b"\x00"
            continue
        item, offset = entry
        out += b"\x01"
        _encode_item(out, item, limits)
        out += _U64.pack(offset)
    return _bounded(out, limits)


def decode_lease_response(
    meta: bytes | bytearray | memoryview, keys: Sequence[str], limits: Limits = DEFAULT_LIMITS
) -> tuple[int, list[tuple[ItemMeta, int | None] | None]]:
    """``(lease_id, per key None or (item, offset or None))`` of a LEASE response."""
    reader = _Reader(meta)
    (lease_id,) = reader.unpack(_U64, "lease id")
    found = _decode_answers(reader, keys, "LEASE", limits, offsets=True)
    reader.done()
    return int(lease_id), found


def encode_release(lease_id: int, keys: Sequence[str] = (), limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of a RELEASE request: the lease id, then the keys to let go (none: all of them)."""
    return _U64.pack(lease_id) + encode_keys(keys, limits)


def decode_release(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> tuple[int, list[str]]:
    if len(meta) < _U64.size:
        raise ProtocolError("RELEASE meta truncated before its lease id")
    (lease_id,) = _U64.unpack(bytes(meta[: _U64.size]))
    return int(lease_id), decode_keys(memoryview(meta)[_U64.size :], limits)


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("utf-8")


def decode_json(meta: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        value = json.loads(bytes(meta).decode("utf-8")) if len(meta) else {}
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ProtocolError(f"control message is not JSON: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise ProtocolError("control message is not a JSON object")
    return value


_STATUS_ERRORS: dict[int, type[KVPoolError]] = {
    Status.PROTOCOL: ProtocolError,
    Status.AUTH: AuthError,
    Status.CAPACITY: CapacityError,
    Status.INTEGRITY: IntegrityError,
    Status.METADATA: MetadataError,
}


def error_for_status(status: int, message: str) -> KVPoolError:
    """The exception a client raises for an error frame from a node."""
    if status == Status.UNAVAILABLE:  # sent by the node only, never for an exception it caught
        return NodeUnavailable(message)
    return _STATUS_ERRORS.get(status, KVPoolError)(f"node: {message}")


def status_for_error(exc: BaseException) -> Status:
    """The status a node sends for an exception raised while serving a request."""
    for status, cls in _STATUS_ERRORS.items():
        if isinstance(exc, cls):
            return Status(status)
    return Status.INTERNAL


# -- CHANNEL_GET ------------------------------------------------------------------------
# The request and response are JSON metas with no data section: the bytes travel over
# the channel's communicator, in the order of the keys that were found.
MAX_SESSION_BYTES = 64
MAX_OFFER_DIGEST_CHARS = 128


@dataclass(frozen=True)
class ChannelRequest:
    """A CHANNEL_GET: the pair's rendezvous session, the keys wanted, and, when it pairs (no keys), the
    digest of the offer the client published (``nccl_channel.rendezvous.Offer.digest``)."""

    session: str
    keys: list[str]
    offer: str = ""


def encode_channel_request(
    session: str, keys: Sequence[str], offer: str = "", limits: Limits = DEFAULT_LIMITS
) -> bytes:
    """Meta of a CHANNEL_GET: the rendezvous session of the pair and the keys wanted (none: pair, naming
    ``offer``, the digest of the offer published for it)."""
    if len(keys) > limits.max_items:
        raise ProtocolError(f"{len(keys)} keys exceed the limit of {limits.max_items}")
    body: dict[str, Any] = {"session": session, "keys": list(keys)}
    if offer:
        body["offer"] = offer
    return _bounded(bytearray(encode_json(body)), limits)


def decode_channel_request(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> ChannelRequest:
    body = decode_json(meta)
    session, keys, offer = body.get("session"), body.get("keys"), body.get("offer", "")
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_BYTES or not session.isascii():
        raise ProtocolError(f"CHANNEL_GET session must be 1..{MAX_SESSION_BYTES} ASCII characters")
    if not isinstance(keys, list) or len(keys) > limits.max_items:
        raise ProtocolError(f"CHANNEL_GET keys must be a list of at most {limits.max_items}")
    for key in keys:
        if not isinstance(key, str) or not 0 < len(key.encode("utf-8")) <= limits.max_key_bytes:
            raise ProtocolError(f"CHANNEL_GET key outside 1..{limits.max_key_bytes} bytes")
    if not isinstance(offer, str) or len(offer) > MAX_OFFER_DIGEST_CHARS or not offer.isascii():
        raise ProtocolError(f"CHANNEL_GET offer must be at most {MAX_OFFER_DIGEST_CHARS} ASCII characters")
    return ChannelRequest(session, keys, offer)


def encode_channel_response(found: Sequence[ItemMeta | None], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of a CHANNEL_GET response: per key null or [nbytes, checksum, dtype, shape, fmt]."""
    rows = [
        None if item is None else [item.nbytes, item.checksum, item.dtype, list(item.shape), item.fmt] for item in found
    ]
    return _bounded(bytearray(encode_json({"found": rows})), limits)


def decode_channel_response(
    meta: bytes | bytearray | memoryview, keys: Sequence[str], limits: Limits = DEFAULT_LIMITS
) -> list[ItemMeta | None]:
    rows = decode_json(meta).get("found")
    if not isinstance(rows, list) or len(rows) != len(keys):
        raise ProtocolError(f"CHANNEL_GET response does not carry one result per key ({len(keys)})")
    found: list[ItemMeta | None] = []
    for key, row in zip(keys, rows):
        if row is None:
            found.append(None)
            continue
        try:
            nbytes, item_sum, dtype, shape, fmt = row
            item = ItemMeta(key, int(nbytes), int(item_sum), str(dtype), tuple(int(d) for d in shape), int(fmt))
        except (TypeError, ValueError):
            raise ProtocolError(f"CHANNEL_GET response row for {key[:80]!r} is malformed") from None
        if not 0 <= item.nbytes <= limits.max_data_bytes or len(item.shape) > limits.max_ndim:
            raise ProtocolError(f"CHANNEL_GET response row for {key[:80]!r} is out of range")
        found.append(item)
    return found


# -- INVENTORY and VERIFY_BATCH (admin) -------------------------------------------------
MAX_INVENTORY_PAGE = 10_000  # rows one INVENTORY answer may carry


class Verified(enum.IntEnum):
    """Per-key outcome of a VERIFY_BATCH, in the response's flag list."""

    OK = 0  # the copy's checksum is right
    MISSING = 1  # the node does not hold the key
    CORRUPT = 2  # the node dropped or quarantined that copy when it found it


@dataclass(frozen=True)
class InventoryRow:
    """One chunk a node holds, as INVENTORY lists it."""

    key: str
    tier: str
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class InventoryPage:
    """One INVENTORY answer: rows in key order, and whether keys after the last one remain."""

    rows: tuple[InventoryRow, ...]
    more: bool


def encode_inventory_request(after: str, limit: int) -> bytes:
    """Meta of an INVENTORY request: up to ``limit`` keys greater than ``after`` ("" for the first page)."""
    if not 0 < limit <= MAX_INVENTORY_PAGE:
        raise ProtocolError(f"INVENTORY limit {limit} is outside 1..{MAX_INVENTORY_PAGE}")
    return encode_json({"after": after, "limit": limit})


def decode_inventory_response(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> InventoryPage:
    """An INVENTORY answer ``{"items": [[key, tier, nbytes, checksum], ...], "more": bool}``, checked row by row."""
    body = decode_json(meta)
    items, more = body.get("items"), body.get("more")
    if not isinstance(items, list) or len(items) > MAX_INVENTORY_PAGE or not isinstance(more, bool):
        raise ProtocolError(f"INVENTORY response wants {{items: list of at most {MAX_INVENTORY_PAGE}, more: bool}}")
    rows = []
    for item in items:
        try:
            key, tier, nbytes, item_sum = item
        except (TypeError, ValueError):
            raise ProtocolError(f"INVENTORY row {str(item)[:80]} is not [key, tier, nbytes, checksum]") from None
        if (
            not isinstance(key, str)
            or not 0 < len(key.encode("utf-8")) <= limits.max_key_bytes
            or not isinstance(tier, str)
            or not isinstance(nbytes, int)
            or not 0 <= nbytes <= limits.max_data_bytes
            or not isinstance(item_sum, int)
            or not 0 <= item_sum < 2**64
        ):
            raise ProtocolError(f"INVENTORY row for {str(key)[:80]!r} is malformed or out of range")
        rows.append(InventoryRow(key, tier, nbytes, item_sum))
    return InventoryPage(tuple(rows), more)


def decode_inventory_request(meta: bytes | bytearray | memoryview) -> tuple[str, int]:
    """``(after, limit)`` of an INVENTORY request (``limit`` 1000 when absent)."""
    request = decode_json(meta)
    after, limit = request.get("after", ""), request.get("limit", 1000)
    if not isinstance(after, str) or not isinstance(limit, int) or not 0 < limit <= MAX_INVENTORY_PAGE:
        raise ProtocolError(f"INVENTORY wants {{after: str, limit: 1..{MAX_INVENTORY_PAGE}}}")
    return after, limit


def encode_inventory_response(page: InventoryPage) -> bytes:
    """Meta of an INVENTORY answer: ``{"items": [[key, tier, nbytes, checksum], ...], "more": bool}``."""
    items = [[row.key, row.tier, row.nbytes, row.checksum] for row in page.rows]
    return encode_json({"items": items, "more": page.more})


# -- STAT: what a node reports about itself ---------------------------------------------
# STAT's answer is JSON (encode_json: keys sorted). Each part is a frozen dataclass with
# ``to_json`` (the JSON object it is on the wire) and ``from_json`` (that object, checked:
# ProtocolError naming the field that is wrong). Fields a node of an older version may
# not send (arena, recovery, latency) decode to None.


def _field(body: Any, name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """``body[name]``, of one of ``kinds`` (never a bool where a number is wanted)."""
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise ProtocolError(f"{what}: {name!r} is {str(value)[:80]}, not {_kind_names(kinds)}")
    return value


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kinds))


_NUMBER = (int, float)


@dataclass(frozen=True)
class TierReport:
    """One tier of a node (``dram``, ``nvme``): its size, what it holds; ``disk_full`` for NVMe only."""

    capacity_bytes: int
    used_bytes: int
    objects: int
    disk_full: bool | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"capacity_bytes": self.capacity_bytes}  # keys in sorted order, as on the wire
        if self.disk_full is not None:
            out["disk_full"] = self.disk_full
        out["objects"] = self.objects
        out["used_bytes"] = self.used_bytes
        return out

    @classmethod
    def from_json(cls, body: Any) -> TierReport:
        what = "a node's tier"
        disk_full = body.get("disk_full") if isinstance(body, dict) else None
        if disk_full is not None and not isinstance(disk_full, bool):
            raise ProtocolError(f"{what}: 'disk_full' is {str(disk_full)[:80]}, not bool")
        return cls(
            _field(body, "capacity_bytes", int, what),
            _field(body, "used_bytes", int, what),
            _field(body, "objects", int, what),
            disk_full,
        )


def tiers_from_json(body: Any) -> dict[str, TierReport]:
    """A node's ``tiers`` object: tier name -> :class:`TierReport`."""
    if not isinstance(body, dict):
        raise ProtocolError(f"a node's tiers are {str(body)[:80]}, not an object")
    return {str(name): TierReport.from_json(tier) for name, tier in body.items()}


@dataclass(frozen=True)
class ArenaReport:
    """A node's DRAM arena: where it is, its size, how much is backed by memory and in use."""

    path: str
    size_bytes: int
    grown_bytes: int
    allocated_bytes: int
    fallbacks: int  # chunks that found no room in the arena and took a private buffer

    def to_json(self) -> dict[str, Any]:
        return {
            "allocated_bytes": self.allocated_bytes,
            "fallbacks": self.fallbacks,
            "grown_bytes": self.grown_bytes,
            "path": self.path,
            "size_bytes": self.size_bytes,
        }

    @classmethod
    def from_json(cls, body: Any) -> ArenaReport:
        what = "a node's arena"
        return cls(
            _field(body, "path", str, what),
            _field(body, "size_bytes", int, what),
            _field(body, "grown_bytes", int, what),
            _field(body, "allocated_bytes", int, what),
            _field(body, "fallbacks", int, what),
        )


@dataclass(frozen=True)
class RecoveryReport:
    """The NVMe tier's recovery at a node's start, so far: files adopted, their bytes, files set aside, time taken.

    Recovery runs in the background while the node serves (``backend.node.recovery``):
    ``progress`` is the fraction of the tier's shard directories scanned, ``indexed`` the
    adopted chunks whose index entries are written, ``done`` whether it has finished. A node
    of an earlier version recovered before it served: absent, they read as finished.
    """

    files: int = 0
    bytes: int = 0
    quarantined: int = 0
    temp_removed: int = 0
    seconds: float = 0.0
    indexed: int = 0
    progress: float = 1.0
    done: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "done": self.done,
            "files": self.files,
            "indexed": self.indexed,
            "progress": self.progress,
            "quarantined": self.quarantined,
            "seconds": self.seconds,
            "temp_removed": self.temp_removed,
        }

    @classmethod
    def from_json(cls, body: Any) -> RecoveryReport:
        what = "a node's recovery"
        files = _field(body, "files", int, what)
        return cls(
            files,
            _field(body, "bytes", int, what),
            _field(body, "quarantined", int, what),
            _field(body, "temp_removed", int, what),
            float(_field(body, "seconds", _NUMBER, what)),
            _field(body, "indexed", int, what) if "indexed" in body else files,
            float(_field(body, "progress", _NUMBER, what)) if "progress" in body else 1.0,
            _field(body, "done", bool, what) if "done" in body else True,
        )


@dataclass(frozen=True)
class RepublishReport:
    """A node's republish of its holdings after Redis lost them (``backend.node.republish``).

    ``running`` while a walk is under way; ``pending``: chunks it has yet to publish (an
    estimate: those held when it began, less those published since); ``published`` and
    ``seconds``: the current (else the last) walk's chunks published and time taken.
    """

    running: bool = False
    pending: int = 0
    published: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"pending": self.pending, "published": self.published, "running": self.running, "seconds": self.seconds}

    @classmethod
    def from_json(cls, body: Any) -> RepublishReport:
        what = "a node's republish"
        return cls(
            _field(body, "running", bool, what),
            _field(body, "pending", int, what),
            _field(body, "published", int, what),
            float(_field(body, "seconds", _NUMBER, what)),
        )


@dataclass(frozen=True)
class RecentReport:
    """A node's requests, gets and hits over its recent window (``window_s``)."""

    window_s: float
    requests_per_s: float
    gets: int
    hits: int

    def to_json(self) -> dict[str, Any]:
        return {"gets": self.gets, "hits": self.hits, "requests_per_s": self.requests_per_s, "window_s": self.window_s}

    @classmethod
    def from_json(cls, body: Any) -> RecentReport:
        what = "a node's recent figures"
        return cls(
            _field(body, "window_s", _NUMBER, what),
            _field(body, "requests_per_s", _NUMBER, what),
            _field(body, "gets", int, what),
            _field(body, "hits", int, what),
        )


@dataclass(frozen=True)
class NodeReport:
    """STAT's answer: a node's identity, counters, tiers, arena, recovery, republish, recent rates and latency.

    ``latency`` is ``backend.latency.LatencyHistograms.to_json()`` as it is (read it with
    ``LatencyHistograms.from_json``, which checks it); None from a node that keeps none.
    """

    node_id: str
    epoch: int
    uptime_s: float
    counters: dict[str, int]
    objects: int
    leases: int
    tiers: dict[str, TierReport]
    recent: RecentReport
    arena: ArenaReport | None = None
    recovery: RecoveryReport | None = None
    latency: dict[str, Any] | None = None
    republish: RepublishReport | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "epoch": self.epoch,
            "uptime_s": self.uptime_s,
            "counters": dict(self.counters),
            "objects": self.objects,
            "leases": self.leases,
            "arena": self.arena.to_json() if self.arena is not None else None,
            "tiers": {name: tier.to_json() for name, tier in self.tiers.items()},
            "recovery": self.recovery.to_json() if self.recovery is not None else None,
            "latency": self.latency,
            "recent": self.recent.to_json(),
            "republish": self.republish.to_json() if self.republish is not None else None,
        }

    @classmethod
    def from_json(cls, body: Any) -> NodeReport:
        what = "STAT answer"
        counters = _field(body, "counters", dict, what)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in counters.values()):
            raise ProtocolError(f"{what}: a counter is not an integer")
        arena, recovery, latency = body.get("arena"), body.get("recovery"), body.get("latency")
        republish = body.get("republish")
        if latency is not None and not isinstance(latency, dict):
            raise ProtocolError(f"{what}: 'latency' is {str(latency)[:80]}, not an object")
        return cls(
            node_id=_field(body, "node_id", str, what),
            epoch=_field(body, "epoch", int, what),
            uptime_s=_field(body, "uptime_s", _NUMBER, what),
            counters={str(k): v for k, v in counters.items()},
            objects=_field(body, "objects", int, what),
            leases=_field(body, "leases", int, what) if "leases" in body else 0,
            tiers=tiers_from_json(body.get("tiers")),
            recent=RecentReport.from_json(body.get("recent")),
            arena=ArenaReport.from_json(arena) if arena is not None else None,
            recovery=RecoveryReport.from_json(recovery) if recovery is not None else None,
            latency=latency,
            republish=RepublishReport.from_json(republish) if republish is not None else None,
        )


def encode_node_report(report: NodeReport) -> bytes:
    """Meta of a STAT answer."""
    return encode_json(report.to_json())


def decode_node_report(meta: bytes | bytearray | memoryview) -> NodeReport:
    """A STAT answer, checked field by field."""
    return NodeReport.from_json(decode_json(meta))
