"""The frame: its fixed header, the op and status codes, the limits a peer enforces, and the checksum.

Every frame is a fixed 36-byte header, a *meta* section and a *data* section::

    magic "KV" | version u8 | op u8 | status u16 | flags u16 | meta_len u32
    | request_id u64 | data_len u64 | meta_checksum u64            (little-endian)

``meta`` describes the frame (keys, sizes, per-item checksums, layouts: ``backend.protocol.meta``
and each op family's part); ``data`` is the concatenated chunk payloads. The meta checksum
(xxh3-64) covers the meta section, and the meta section carries an xxh3-64 of every chunk, so
every payload byte is covered without hashing anything twice. Lengths are checked against
:class:`Limits` before anything is allocated. Responses carry the request's op with
``RESPONSE_BIT`` set; a non-zero status makes the meta a UTF-8 error message, and
:func:`error_for_status` / :func:`status_for_error` map statuses to ``backend.errors`` and back.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import xxhash

from backend.errors import (
    AuthError,
    CapacityError,
    IntegrityError,
    KVPoolError,
    MetadataError,
    NodeUnavailable,
    ProtocolError,
)

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER",
    "RESPONSE_BIT",
    "Op",
    "Status",
    "Limits",
    "DEFAULT_LIMITS",
    "Header",
    "checksum",
    "checksum_stream",
    "encode_header",
    "decode_header",
    "verify_meta",
    "error_for_status",
    "status_for_error",
    "OpCodec",
    "CODECS",
]

MAGIC = b"KV"
VERSION = 1
HEADER = struct.Struct("<2sBBHHIQQQ")
RESPONSE_BIT = 0x80


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
    TOUCH = 15  # chains of keys a lookup found: the node's eviction order hears they were used; no answer data
    PIN = 16  # hold keys on the node past any connection, reference-counted, with an optional ttl
    UNPIN = 17  # let go of one of an owner's pins of each key
    PINS = 18  # admin: page through the keys a node pins
    EVENTS = 19  # read the node's ring of recent stores and removals (a `kvpool events` endpoint)


class Status(enum.IntEnum):
    OK = 0
    PROTOCOL = 1
    AUTH = 2
    CAPACITY = 3
    INTEGRITY = 4
    METADATA = 5
    INTERNAL = 6
    UNAVAILABLE = 7  # the node is closing this connection (shed, handshake deadline): request id 0, the reason


class OpCodec:
    """An op's codec in one place: its ``op`` and static methods ``encode_request``, ``decode_request``,
    ``encode_answer`` and ``decode_answer``, the two ends of the wire calling the same class.

    A subclass that names its ``op`` is registered in :data:`CODECS`, one codec per op (HELLO and
    AUTH are the handshake's, ``backend.handshake``)."""

    op: ClassVar[Op]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "op" in cls.__dict__:
            if cls.op in CODECS:
                raise TypeError(f"{cls.__name__}: {cls.op.name} already has its codec, {CODECS[cls.op].__name__}")
            CODECS[cls.op] = cls


CODECS: dict[Op, type[OpCodec]] = {}  # op -> its codec, filled as the op families' parts are imported


@dataclass(frozen=True)
class Limits:
    """Hard limits a node enforces before allocating anything for a frame."""

    max_meta_bytes: int = 4 * 1024 * 1024
    # A HELLO or AUTH, and any frame before its connection is admitted (docs/protocol-connections.md), needs
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
