"""The key ops: EXISTS, DELETE, GET_BATCH, LEASE and RELEASE (a same-host read pins, reads the arena, lets go), TOUCH.

A TOUCH is chains of keys (each in prefix order) that lookups found: a count of chains,
then each chain as a key list; at most ``limits.max_items`` keys in all. It is answered
with an empty flag list.

EXISTS and DELETE requests are a key list (``encode_keys``), answered with a flag per key
(``encode_flags``). A GET is a key list and the reader's layout fingerprint
(:meth:`GetBatch.encode_request`), answered with :meth:`GetBatch.encode_answer`; a LEASE is answered
like a GET plus, per found key, its offset in the node's arena. A GET or LEASE of an older
client carries no fingerprint: it is answered in the older form (no fingerprints, and a chunk
of another layout as not found).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from backend.errors import ProtocolError
from backend.protocol.frame import DEFAULT_LIMITS, Limits, Op, OpCodec
from backend.protocol.meta import (
    U8,
    U32,
    U64,
    FlagsAnswer,
    ItemMeta,
    KeysRequest,
    MetaReader,
    OtherLayout,
    bounded,
    check_fingerprint,
    decode_json,
    decode_keys,
    encode_json,
    encode_keys,
    read_item,
    write_item,
)

__all__ = ["ExistsBatch", "DeleteBatch", "GetBatch", "LEASE_MAP", "NO_OFFSET", "Lease", "Release", "Touch"]

# LEASE request flags, and the offset of a leased chunk that has no arena region.
LEASE_MAP = 0x1
NO_OFFSET = 2**64 - 1

_LEASE_HEAD = struct.Struct("<IB")  # ttl_ms, flags
# A GET or LEASE answer's found byte: not held, held (the item follows), held with another layout fingerprint
# than the reader's (nothing follows; only to a request that carried a fingerprint).
_NOT_FOUND, _FOUND, _OTHER_LAYOUT = 0, 1, 2


def _keys_and_fingerprint(reader: MetaReader, limits: Limits, what: str) -> tuple[list[str], int | None]:
    """A key list, then the reader's layout fingerprint if the request carries one (None: an older client)."""
    keys = [reader.key(limits) for _ in range(reader.count(limits))]
    fingerprint = None
    if reader.remaining == U64.size:
        (fingerprint,) = reader.unpack(U64, f"{what} layout fingerprint")
    reader.done()
    return keys, fingerprint


class ExistsBatch(KeysRequest, FlagsAnswer, OpCodec):
    """EXISTS_BATCH: a key list, answered with a flag per key (1: the node holds it)."""

    op = Op.EXISTS_BATCH


class DeleteBatch(KeysRequest, FlagsAnswer, OpCodec):
    """DELETE_BATCH: a key list, answered with a flag per key (1: the node dropped it)."""

    op = Op.DELETE_BATCH


def _write_answer(out: bytearray, entry: ItemMeta | OtherLayout | None, limits: Limits, fingerprints: bool) -> bool:
    """Append one key's found byte and, for a hit, its item (and fingerprint); True for a hit."""
    if entry is None or isinstance(entry, OtherLayout):
        out += U8.pack(_OTHER_LAYOUT if entry is not None and fingerprints else _NOT_FOUND)
        return False
    out += U8.pack(_FOUND)
    write_item(out, entry, limits)
    if fingerprints:
        out += U64.pack(entry.fingerprint)
    return True


Answer = tuple[ItemMeta, int | None] | OtherLayout | None  # a GET or LEASE answer for one key (with its offset)


def _decode_answers(
    reader: MetaReader, keys: Sequence[str], what: str, limits: Limits, *, offsets: bool, fingerprints: bool
) -> list[Answer]:
    """Per key of a GET or LEASE answer: None (not found), OtherLayout, or its item (with its fingerprint when
    ``fingerprints``) and, for LEASE, its offset."""
    n = reader.count(limits)
    if n != len(keys):
        raise ProtocolError(f"{what} response carries {n} results for {len(keys)} keys")
    found: list[Answer] = []
    for key in keys:
        (flag,) = reader.unpack(U8, "found flag")
        if flag == _NOT_FOUND:
            found.append(None)
            continue
        if flag == _OTHER_LAYOUT and fingerprints:
            found.append(OtherLayout(key))
            continue
        if flag != _FOUND:
            raise ProtocolError(f"{what} response has found flag {flag} for {key[:80]!r}")
        item = read_item(reader, limits, fingerprinted=fingerprints)
        if item.key != key:
            raise ProtocolError(f"{what} response answered {item.key!r} for {key!r}")
        offset = None
        if offsets:
            (raw,) = reader.unpack(U64, "offset")
            offset = None if raw == NO_OFFSET else int(raw)
        found.append((item, offset))
    return found


class GetBatch(OpCodec):
    """GET_BATCH: keys and the reader's layout fingerprint; answered per key with its item (bytes as data) or a miss."""

    op = Op.GET_BATCH

    @staticmethod
    def encode_request(keys: Sequence[str], fingerprint: int, limits: Limits = DEFAULT_LIMITS) -> bytes:
        """Meta of a GET_BATCH request: the keys (as :func:`encode_keys`), then the reader's layout fingerprint."""
        return bounded(bytearray(encode_keys(keys, limits) + U64.pack(check_fingerprint(fingerprint, "GET"))), limits)

    @staticmethod
    def decode_request(
        meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
    ) -> tuple[list[str], int | None]:
        """``(keys, the reader's layout fingerprint)`` of a GET_BATCH request (None: an older client's, without one)."""
        return _keys_and_fingerprint(MetaReader(meta), limits, "GET")

    @staticmethod
    def encode_answer(
        found: Sequence[ItemMeta | OtherLayout | None], limits: Limits = DEFAULT_LIMITS, *, fingerprints: bool = True
    ) -> bytes:
        """Meta of a GET_BATCH response: per key a found byte and, if found, the item and its layout fingerprint.
        ``fingerprints=False``: the older form, for a request without a fingerprint (another layout: not found)."""
        out = bytearray(U32.pack(len(found)))
        for entry in found:
            _write_answer(out, entry, limits, fingerprints)
        return bounded(out, limits)

    @staticmethod
    def decode_answer(
        meta: bytes | bytearray | memoryview,
        keys: Sequence[str],
        data_len: int,
        limits: Limits = DEFAULT_LIMITS,
        *,
        fingerprints: bool = True,
    ) -> list[ItemMeta | OtherLayout | None]:
        """Per key: its item (hits; their payloads are the data section, in key order), OtherLayout, or None.
        ``fingerprints``: whether the request carried the reader's fingerprint (:meth:`GetBatch.encode_request`)."""
        reader = MetaReader(meta)
        found = [
            a[0] if isinstance(a, tuple) else a
            for a in _decode_answers(reader, keys, "GET", limits, offsets=False, fingerprints=fingerprints)
        ]
        reader.done()
        total = sum(item.nbytes for item in found if isinstance(item, ItemMeta))
        if total != data_len:
            raise ProtocolError(f"GET response declares {total} bytes but carries {data_len}")
        return found


class Lease(OpCodec):
    """LEASE: pin keys for a while; answered like a GET plus each found key's offset in the node's arena."""

    op = Op.LEASE

    @staticmethod
    def encode_request(
        keys: Sequence[str], ttl_ms: int, flags: int, limits: Limits = DEFAULT_LIMITS, *, fingerprint: int | None = None
    ) -> bytes:
        """Meta of a LEASE request: ttl, flags, then the keys as in GET and, for a read (``LEASE_MAP``), the reader's
        layout fingerprint (None: none is sent, as by an older client; a lock sends none)."""
        if not 0 < ttl_ms < 2**32 or not 0 <= flags <= 255:
            raise ProtocolError(f"lease ttl_ms {ttl_ms} or flags {flags} out of range")
        out = _LEASE_HEAD.pack(ttl_ms, flags) + encode_keys(keys, limits)
        if fingerprint is not None:
            out += U64.pack(check_fingerprint(fingerprint, "LEASE"))
        return bounded(bytearray(out), limits)

    @staticmethod
    def decode_request(
        meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
    ) -> tuple[int, int, list[str], int | None]:
        """``(ttl_ms, flags, keys, the reader's layout fingerprint or None)`` of a LEASE request."""
        if len(meta) < _LEASE_HEAD.size:
            raise ProtocolError("LEASE meta truncated before its ttl and flags")
        ttl_ms, flags = _LEASE_HEAD.unpack(bytes(meta[: _LEASE_HEAD.size]))
        if flags & ~LEASE_MAP:
            raise ProtocolError(f"unknown LEASE flags {flags:#x}")
        keys, fingerprint = _keys_and_fingerprint(MetaReader(memoryview(meta)[_LEASE_HEAD.size :]), limits, "LEASE")
        return int(ttl_ms), int(flags), keys, fingerprint

    @staticmethod
    def encode_answer(
        lease_id: int,
        found: Sequence[tuple[ItemMeta, int] | OtherLayout | None],
        limits: Limits = DEFAULT_LIMITS,
        *,
        fingerprints: bool = False,
    ) -> bytes:
        """Meta of a LEASE response: the lease id, then per key a found byte and, if found, item (+ its layout
        fingerprint, when the request carried the reader's) + offset."""
        out = bytearray(U64.pack(lease_id) + U32.pack(len(found)))
        for entry in found:
            if _write_answer(out, entry[0] if isinstance(entry, tuple) else entry, limits, fingerprints):
                assert isinstance(entry, tuple)
                out += U64.pack(entry[1])
        return bounded(out, limits)

    @staticmethod
    def decode_answer(
        meta: bytes | bytearray | memoryview,
        keys: Sequence[str],
        limits: Limits = DEFAULT_LIMITS,
        *,
        fingerprints: bool = False,
    ) -> tuple[int, list[Answer]]:
        """``(lease_id, per key None, OtherLayout or (item, offset or None))`` of a LEASE response."""
        reader = MetaReader(meta)
        (lease_id,) = reader.unpack(U64, "lease id")
        found = _decode_answers(reader, keys, "LEASE", limits, offsets=True, fingerprints=fingerprints)
        reader.done()
        return int(lease_id), found


class Release(OpCodec):
    """RELEASE: end a lease, or its hold on some keys; answered with how many holds ended."""

    op = Op.RELEASE

    @staticmethod
    def encode_request(lease_id: int, keys: Sequence[str] = (), limits: Limits = DEFAULT_LIMITS) -> bytes:
        """Meta of a RELEASE request: the lease id, then the keys to let go (none: all of them)."""
        return U64.pack(lease_id) + encode_keys(keys, limits)

    @staticmethod
    def decode_request(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> tuple[int, list[str]]:
        if len(meta) < U64.size:
            raise ProtocolError("RELEASE meta truncated before its lease id")
        (lease_id,) = U64.unpack(bytes(meta[: U64.size]))
        return int(lease_id), decode_keys(memoryview(meta)[U64.size :], limits)

    @staticmethod
    def encode_answer(released: int) -> bytes:
        """Meta of a RELEASE answer: ``{"released": N}``, the holds that ended."""
        return encode_json({"released": released})

    @staticmethod
    def decode_answer(meta: bytes | bytearray | memoryview) -> int:
        released = decode_json(meta).get("released")
        if not isinstance(released, int) or isinstance(released, bool) or released < 0:
            raise ProtocolError(f"RELEASE answer: 'released' is {str(released)[:80]}, not a count")
        return released


class Touch(FlagsAnswer, OpCodec):
    """TOUCH: chains of keys lookups found, each in prefix order; answered with an empty flag list."""

    op = Op.TOUCH

    @staticmethod
    def encode_request(chains: Sequence[Sequence[str]], limits: Limits = DEFAULT_LIMITS) -> bytes:
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

    @staticmethod
    def decode_request(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> list[list[str]]:
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
