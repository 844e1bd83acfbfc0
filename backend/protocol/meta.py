"""The meta section's building blocks: one chunk's :class:`ItemMeta`, the checks on keys and items,
the bounded cursor every op's decoder reads with, and the lists and JSON several ops share.

Each op family's part (``puts``, ``reads``, ``channel``, ``inventory``, ``reports``) builds its
meta from these; nothing here knows an op.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backend.errors import ProtocolError
from backend.protocol.frame import DEFAULT_LIMITS, Limits

__all__ = [
    "ItemMeta",
    "NO_FINGERPRINT",
    "ANY_FINGERPRINT",
    "OtherLayout",
    "check_key",
    "check_item",
    "encode_keys",
    "decode_keys",
    "encode_flags",
    "decode_flags",
    "encode_json",
    "decode_json",
    "KeysRequest",
    "FlagsAnswer",
    "EmptyRequest",
]

# The fixed-width fields, and the helpers below that are not in __all__, are what the op
# families' parts of this package build their metas with; callers outside it never need them.
U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
_ITEM_FIXED = struct.Struct("<QQH")  # nbytes, checksum, fmt

# The layout fingerprint of a chunk (docs/protocol.md, "Layout fingerprints"): an xxh3-64 of the
# writer's KV layout, 0 for a chunk stored without one. A reader that names ANY_FINGERPRINT is
# answered whatever the chunk's (an admin copy, ``kvpool drain``); no real fingerprint is either value.
NO_FINGERPRINT = 0
ANY_FINGERPRINT = 2**64 - 1


@dataclass(frozen=True)
class ItemMeta:
    """One chunk: its key, byte length, xxh3-64 checksum, tensor layout and layout fingerprint (0: none)."""

    key: str
    nbytes: int
    checksum: int
    dtype: str
    shape: tuple[int, ...]
    fmt: int
    fingerprint: int = NO_FINGERPRINT


@dataclass(frozen=True)
class OtherLayout:
    """A read's answer for a key the node holds with another layout fingerprint than the reader's:
    a miss for this reader (no bytes), while the chunk itself is fine."""

    key: str


class MetaReader:
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
        (n,) = self.unpack(U32, "item count")
        if n > limits.max_items:
            raise ProtocolError(f"{n} items exceed the limit of {limits.max_items}")
        return int(n)

    def key(self, limits: Limits) -> str:
        (n,) = self.unpack(U16, "key length")
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
    if not 0 <= item.fingerprint < ANY_FINGERPRINT:
        raise ProtocolError(f"item {item.key[:80]!r}: layout fingerprint {item.fingerprint!r} is not a stored one")
    if not item.dtype.isascii():
        raise ProtocolError(f"item {item.key[:80]!r}: dtype name {item.dtype!r} is not ASCII")
    dtype = item.dtype.encode("ascii")
    if not 0 < len(dtype) <= limits.max_dtype_bytes:
        raise ProtocolError(
            f"dtype name {item.dtype!r} is empty or too long: 1..{limits.max_dtype_bytes} bytes (max_dtype_bytes)"
        )
    return dtype


def check_fingerprint(fingerprint: object, what: str) -> int:
    """``fingerprint`` if it is an integer that fits a u64; a ProtocolError naming ``what`` if not."""
    if not isinstance(fingerprint, int) or isinstance(fingerprint, bool) or not 0 <= fingerprint <= ANY_FINGERPRINT:
        raise ProtocolError(f"{what}: layout fingerprint {fingerprint!r} is not a u64")
    return fingerprint


def write_key(out: bytearray, key: str, limits: Limits) -> None:
    """Append a checked key: its length (u16), then its UTF-8 bytes."""
    raw = check_key(key, limits)
    out += U16.pack(len(raw))
    out += raw


def write_item(out: bytearray, item: ItemMeta, limits: Limits) -> None:
    """Append a checked item: key, nbytes, checksum, fmt, dtype name, shape."""
    dtype = check_item(item, limits)
    write_key(out, item.key, limits)
    out += _ITEM_FIXED.pack(item.nbytes, item.checksum, item.fmt)
    out += U8.pack(len(dtype))
    out += dtype
    out += U8.pack(len(item.shape))
    out += struct.pack(f"<{len(item.shape)}Q", *item.shape)


def read_item(reader: MetaReader, limits: Limits, *, fingerprinted: bool = False) -> ItemMeta:
    """The next item of ``reader`` (as :func:`write_item` wrote it), each length bounded by ``limits``; with
    ``fingerprinted``, the layout fingerprint written after it too (a GET or LEASE answer's)."""
    key = reader.key(limits)
    nbytes, item_sum, fmt = reader.unpack(_ITEM_FIXED, "item header")
    (dtype_len,) = reader.unpack(U8, "dtype length")
    if not 0 < dtype_len <= limits.max_dtype_bytes:
        raise ProtocolError(f"dtype length {dtype_len} outside 1..{limits.max_dtype_bytes}")
    dtype = reader.text(dtype_len, "dtype")
    (ndim,) = reader.unpack(U8, "ndim")
    if ndim > limits.max_ndim:
        raise ProtocolError(f"{ndim} dimensions exceed the limit of {limits.max_ndim}")
    shape = struct.unpack(f"<{ndim}Q", reader.take(8 * ndim, "shape"))
    fingerprint = int(reader.unpack(U64, "layout fingerprint")[0]) if fingerprinted else NO_FINGERPRINT
    return ItemMeta(key, int(nbytes), int(item_sum), dtype, tuple(int(d) for d in shape), int(fmt), fingerprint)


def bounded(meta: bytearray, limits: Limits) -> bytes:
    """``meta`` as bytes, once it is known to fit ``limits.max_meta_bytes``."""
    if len(meta) > limits.max_meta_bytes:
        raise ProtocolError(f"meta section of {len(meta)} bytes exceeds {limits.max_meta_bytes}; send fewer items")
    return bytes(meta)


def encode_keys(keys: Sequence[str], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of GET/EXISTS/DELETE requests."""
    if len(keys) > limits.max_items:
        raise ProtocolError(f"{len(keys)} keys exceed the limit of {limits.max_items}")
    out = bytearray(U32.pack(len(keys)))
    for key in keys:
        write_key(out, key, limits)
    return bounded(out, limits)


def decode_keys(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> list[str]:
    reader = MetaReader(meta)
    keys = [reader.key(limits) for _ in range(reader.count(limits))]
    reader.done()
    return keys


def encode_flags(flags: Sequence[int]) -> bytes:
    """Meta of EXISTS/DELETE/PUT responses: one status byte per item."""
    if any(not 0 <= f <= 255 for f in flags):
        raise ProtocolError("a result flag is outside 0..255")
    return U32.pack(len(flags)) + bytes(flags)


def decode_flags(meta: bytes | bytearray | memoryview, expected: int) -> list[int]:
    reader = MetaReader(meta)
    (n,) = reader.unpack(U32, "flag count")
    if n != expected:
        raise ProtocolError(f"response carries {n} results for {expected} requested")
    flags = list(reader.take(n, "flags"))
    reader.done()
    return flags


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


class KeysRequest:
    """The request of an op that is a key list (EXISTS_BATCH, DELETE_BATCH, VERIFY_BATCH)."""

    encode_request = staticmethod(encode_keys)
    decode_request = staticmethod(decode_keys)


class FlagsAnswer:
    """The answer of an op that is one status byte per item (EXISTS, DELETE, VERIFY, the puts, TOUCH)."""

    encode_answer = staticmethod(encode_flags)
    decode_answer = staticmethod(decode_flags)


class EmptyRequest:
    """The request of an op that carries nothing (STAT, PING): a node reads nothing of its meta."""

    @staticmethod
    def encode_request() -> bytes:
        return b""

    @staticmethod
    def decode_request(meta: bytes | bytearray | memoryview) -> None:
        return None
