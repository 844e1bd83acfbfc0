"""A chunk's token record: its token ids and its parent chunk's hash, from the engine to a router's events.

The LMCache connector makes one per chunk it puts (``backend/lmcache/token_binding.py``), a put
carries it to nodes that keep an event ring (the put's token section, docs/protocol-ops.md "Put
tokens"), the node keeps the bytes as they came while the entry is in its ring, and EVENTS hands
them to the ``kvpool events`` endpoint, which decodes them into a ``BlockStored``'s ``token_ids``
and ``parent_block_hash``. The node checks a record's header and length, never its ids::

    u8  version        1
    u8  flags          bit 0: the chunk has a parent (else it starts its chain)
    u64 parent         the parent chunk's hash as u64 (as backend/events/keys.py maps block hashes); 0 without one
    u32 count          1 <= count <= MAX_RECORD_TOKENS
    count x u32        the token ids, little-endian

A put's token section follows its layout fingerprints (which a put with tokens always sends)::

    u8  version        1
    count times:       u32 record length (0: no record for this item), then the record
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backend.errors import ProtocolError
from backend.protocol.meta import U8, U32, ItemMeta, MetaReader

__all__ = ["MAX_RECORD_TOKENS", "ChunkTokens", "encode_record", "check_record", "decode_record"]
# encode_token_section and decode_token_section are the put codec's (puts.py), not the package's wire API.

RECORD_VERSION = 1
SECTION_VERSION = 1
MAX_RECORD_TOKENS = 1 << 16  # tokens in one chunk's record (LMCache's chunk_size is 256 by default)
U64_MASK = (1 << 64) - 1
_HEADER = struct.Struct("<BBQI")  # version, flags, parent, count
_HAS_PARENT = 1
_LITTLE_ENDIAN = struct.pack("=I", 1) == struct.pack("<I", 1)  # an array('I') is the wire's bytes as it is


@dataclass(frozen=True, slots=True)
class ChunkTokens:
    """A chunk's token ids and its parent's hash (u64; None: the chunk starts its chain), as a client puts them
    and an EVENTS reader gets them back. ``token_ids`` may be any sequence of ints (an ``array('I')`` keeps
    them in 4 bytes each)."""

    parent: int | None
    token_ids: Sequence[int]


def encode_record(tokens: ChunkTokens) -> bytes:
    """The record of a chunk. The parent is reduced to its low 64 bits (the block hash mapping); ValueError
    for no ids, too many, or an id outside 0..2^32-1."""
    count = len(tokens.token_ids)
    if not 0 < count <= MAX_RECORD_TOKENS:
        raise ValueError(f"a token record holds 1..{MAX_RECORD_TOKENS} token ids, not {count}")
    parent = tokens.parent
    flags = _HAS_PARENT if parent is not None else 0
    given = tokens.token_ids
    if isinstance(given, array) and given.typecode == "I" and given.itemsize == 4 and _LITTLE_ENDIAN:
        ids = given.tobytes()  # array('I') took only ids in 0..2^32-1
    else:
        try:
            ids = struct.pack(f"<{count}I", *given)
        except struct.error:
            raise ValueError("a token id is outside 0..2^32-1") from None
    return _HEADER.pack(RECORD_VERSION, flags, (parent or 0) & U64_MASK, count) + ids


def check_record(record: bytes | memoryview, what: str = "token record") -> None:
    """ProtocolError unless ``record`` is a record of this version whose length matches its count."""
    if len(record) < _HEADER.size:
        raise ProtocolError(f"{what} of {len(record)} bytes is shorter than its header")
    version, flags, _, count = _HEADER.unpack_from(record)
    if version != RECORD_VERSION:
        raise ProtocolError(f"{what} of version {version}: this build reads version {RECORD_VERSION}")
    if flags & ~_HAS_PARENT or not 0 < count <= MAX_RECORD_TOKENS or len(record) != _HEADER.size + 4 * count:
        raise ProtocolError(f"{what} is malformed (flags {flags}, {count} ids in {len(record)} bytes)")


def decode_record(record: bytes | memoryview) -> ChunkTokens:
    check_record(record)
    _, flags, parent, count = _HEADER.unpack_from(record)
    ids = struct.unpack_from(f"<{count}I", record, _HEADER.size)
    return ChunkTokens(int(parent) if flags & _HAS_PARENT else None, ids)


def encode_token_section(items: Sequence[ItemMeta], records: Mapping[str, bytes]) -> bytes:
    """A put's token section: each item's record (by key) or none."""
    out = bytearray(U8.pack(SECTION_VERSION))
    for item in items:
        record = records.get(item.key, b"")
        out += U32.pack(len(record)) + record
    return bytes(out)


def decode_token_section(reader: MetaReader, items: Sequence[ItemMeta]) -> dict[str, bytes]:
    """Each item's record (items without one are left out); ProtocolError for an unknown version or a bad record."""
    (version,) = reader.unpack(U8, "put tokens version")
    if version != SECTION_VERSION:
        raise ProtocolError(f"put tokens of version {version}: this node reads version {SECTION_VERSION}")
    records: dict[str, bytes] = {}
    for item in items:
        (length,) = reader.unpack(U32, "token record length")
        if length:
            record = bytes(reader.take(int(length), "token record"))
            check_record(record, f"token record of {item.key[:80]!r}")
            records[item.key] = record
    return records
