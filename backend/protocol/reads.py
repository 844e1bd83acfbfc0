"""GET_BATCH's answer, and LEASE/RELEASE: a same-host read pins keys, reads the node's arena, lets go.

A TOUCH is chains of keys (each in prefix order) that lookups found: a count of chains,
then each chain as a key list; at most ``limits.max_items`` keys in all. It is answered
with an empty flag list.

GET, EXISTS and DELETE requests are a key list (``encode_keys``); EXISTS and DELETE are
answered with a flag per key (``encode_flags``), GET with :func:`encode_get_response`. A
LEASE is answered like a GET plus, per found key, its offset in the node's arena.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from backend.errors import ProtocolError
from backend.protocol.frame import DEFAULT_LIMITS, Limits
from backend.protocol.meta import (
    U8,
    U32,
    U64,
    ItemMeta,
    MetaReader,
    bounded,
    decode_keys,
    encode_keys,
    read_item,
    write_item,
)

__all__ = [
    "encode_get_response",
    "decode_get_response",
    "LEASE_MAP",
    "NO_OFFSET",
    "encode_lease_request",
    "decode_lease_request",
    "encode_lease_response",
    "decode_lease_response",
    "encode_release",
    "decode_release",
    "encode_touch",
    "decode_touch",
]

# LEASE request flags, and the offset of a leased chunk that has no arena region.
LEASE_MAP = 0x1
NO_OFFSET = 2**64 - 1

_LEASE_HEAD = struct.Struct("<IB")  # ttl_ms, flags


def encode_get_response(found: Sequence[ItemMeta | None], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of a GET_BATCH response: per key a found byte and, if found, the item."""
    out = bytearray(U32.pack(len(found)))
    for item in found:
        if item is None:
            out += b"\x00"
        else:
            out += b"\x01"
            write_item(out, item, limits)
    return bounded(out, limits)


def _decode_answers(
    reader: MetaReader, keys: Sequence[str], what: str, limits: Limits, *, offsets: bool
) -> list[tuple[ItemMeta, int | None] | None]:
    """Per key of a GET or LEASE answer: None (not found) or its item and, for LEASE, its offset."""
    n = reader.count(limits)
    if n != len(keys):
        raise ProtocolError(f"{what} response carries {n} results for {len(keys)} keys")
    found: list[tuple[ItemMeta, int | None] | None] = []
    for key in keys:
        (flag,) = reader.unpack(U8, "found flag")
        if flag == 0:
            found.append(None)
            continue
        item = read_item(reader, limits)
        if item.key != key:
            raise ProtocolError(f"{what} response answered {item.key!r} for {key!r}")
        offset = None
        if offsets:
            (raw,) = reader.unpack(U64, "offset")
            offset = None if raw == NO_OFFSET else int(raw)
        found.append((item, offset))
    return found


def decode_get_response(
    meta: bytes | bytearray | memoryview, keys: Sequence[str], data_len: int, limits: Limits = DEFAULT_LIMITS
) -> list[ItemMeta | None]:
    reader = MetaReader(meta)
    found = [None if a is None else a[0] for a in _decode_answers(reader, keys, "GET", limits, offsets=False)]
    reader.done()
    total = sum(item.nbytes for item in found if item is not None)
    if total != data_len:
        raise ProtocolError(f"GET response declares {total} bytes but carries {data_len}")
    return found


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
    out = bytearray(U64.pack(lease_id) + U32.pack(len(found)))
    for entry in found:
        if entry is None:
            out += b"\x00"
            continue
        item, offset = entry
        out += b"\x01"
        write_item(out, item, limits)
        out += U64.pack(offset)
    return bounded(out, limits)


def decode_lease_response(
    meta: bytes | bytearray | memoryview, keys: Sequence[str], limits: Limits = DEFAULT_LIMITS
) -> tuple[int, list[tuple[ItemMeta, int | None] | None]]:
    """``(lease_id, per key None or (item, offset or None))`` of a LEASE response."""
    reader = MetaReader(meta)
    (lease_id,) = reader.unpack(U64, "lease id")
    found = _decode_answers(reader, keys, "LEASE", limits, offsets=True)
    reader.done()
    return int(lease_id), found


def encode_release(lease_id: int, keys: Sequence[str] = (), limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of a RELEASE request: the lease id, then the keys to let go (none: all of them)."""
    return U64.pack(lease_id) + encode_keys(keys, limits)


def decode_release(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> tuple[int, list[str]]:
    if len(meta) < U64.size:
        raise ProtocolError("RELEASE meta truncated before its lease id")
    (lease_id,) = U64.unpack(bytes(meta[: U64.size]))
    return int(lease_id), decode_keys(memoryview(meta)[U64.size :], limits)


def encode_touch(chains: Sequence[Sequence[str]], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Meta of a TOUCH request: ``chains``, each a non-empty key list in prefix order."""
    keys = sum(len(chain) for chain in chains)
    if keys > limits.max_items:
        raise ProtocolError(f"{keys} keys exceed the limit of {limits.max_items}")
    if any(not chain for chain in chains):
        raise ProtocolError("a TOUCH chain is empty")
    out = bytearray(U32.pack(len(chains)))
    for chain in chains:
        out += encode_keys(chain, limits)
    return bounded(out, limits)


def decode_touch(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> list[list[str]]:
    reader = MetaReader(meta)
    chains: list[list[str]] = []
    budget = limits.max_items
    for _ in range(reader.count(limits)):
        count = reader.count(limits)
        if not count or count > budget:
            raise ProtocolError(f"a TOUCH chain of {count} keys: chains are 1..{limits.max_items} keys in all")
        budget -= count
        chains.append([reader.key(limits) for _ in range(count)])
    reader.done()
    return chains
