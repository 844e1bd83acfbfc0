"""PUT_BATCH and PUT_STAGED: the items a put sends, its options, and the per-item outcome a node answers.

A PUT_BATCH's meta is its items (:meth:`PutBatch.encode_items`), then the put options; its data is
the chunks' bytes. A PUT_STAGED carries no data: the bytes wait in the client's shared-memory
stage on the node's host (``backend.shm``), and the meta names the stage, its token and each
item's offset in it. Both are answered with one flag per item (:class:`~backend.protocol.meta.FlagsAnswer`).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backend.errors import ProtocolError, PutOutcome
from backend.protocol.frame import DEFAULT_LIMITS, Limits, Op, OpCodec
from backend.protocol.meta import (
    ANY_FINGERPRINT,
    U8,
    U32,
    U64,
    FlagsAnswer,
    ItemMeta,
    MetaReader,
    bounded,
    read_item,
    write_item,
)
from backend.protocol.tokens import decode_token_section, encode_token_section

__all__ = [
    "PUT_STORED",
    "PUT_INTEGRITY",
    "PUT_NO_ROOM",
    "PUT_BUSY",
    "put_outcome",
    "PutBatch",
    "MAX_PUT_WAIT_MS",
    "DEFAULT_PUT_WAIT_MS",
    "PutOptions",
    "MAX_STAGE_NAME_BYTES",
    "STAGE_TOKEN_BYTES",
    "PutStaged",
]

# Per-item outcome of a PUT_BATCH or PUT_STAGED, in the response's flag list.
PUT_STORED = 0
PUT_INTEGRITY = 1
PUT_NO_ROOM = 2
PUT_BUSY = 3  # DRAM stayed full of puts in flight until the request's wait ran out
_PUT_OUTCOMES = {
    PUT_STORED: PutOutcome.STORED,
    PUT_INTEGRITY: PutOutcome.CORRUPT,
    PUT_NO_ROOM: PutOutcome.NO_ROOM,
    PUT_BUSY: PutOutcome.BUSY,
}


def put_outcome(flag: int) -> PutOutcome:
    """The outcome a node's PUT flag stands for (a flag this side does not know: the chunk is not stored)."""
    return _PUT_OUTCOMES.get(flag, PutOutcome.FAILED)


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
    ``tokens``: chunk key -> its token record (``tokens.py``), for a node that keeps an event
    ring; sent only to the nodes whose registry entry says they keep them (``event_tokens``).
    """

    put_id: int = 0
    wait_ms: int = DEFAULT_PUT_WAIT_MS
    tokens: Mapping[str, bytes] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.put_id < 2**64 or not 0 <= self.wait_ms <= MAX_PUT_WAIT_MS:
            raise ProtocolError(
                f"put options out of range: put_id {self.put_id}, wait_ms {self.wait_ms} (0..{MAX_PUT_WAIT_MS})"
            )


def _put_trailer(reader: MetaReader, items: list[ItemMeta]) -> tuple[list[ItemMeta], PutOptions]:
    """The items with their layout fingerprints and the put options, from what follows the items: nothing
    (an older client: the defaults), the options (exactly their size left), the options and one u64
    fingerprint per item, or those and the token section (``tokens.py``). Anything else is left for
    ``reader.done()`` to refuse."""
    left, with_fingerprints = reader.remaining, _PUT_OPTIONS.size + U64.size * len(items)
    if left != _PUT_OPTIONS.size and left < with_fingerprints:
        return items, PutOptions()
    put_id, wait_ms = reader.unpack(_PUT_OPTIONS, "put options")
    if reader.remaining:
        fingerprints = struct.unpack(f"<{len(items)}Q", reader.take(U64.size * len(items), "layout fingerprints"))
        items = [
            item if not fp else dataclasses.replace(item, fingerprint=int(fp)) for item, fp in zip(items, fingerprints)
        ]
        if any(item.fingerprint == ANY_FINGERPRINT for item in items):
            raise ProtocolError("a put item carries the any-layout fingerprint, which no chunk is stored with")
    tokens = decode_token_section(reader, items) if reader.remaining else None
    return items, PutOptions(int(put_id), int(wait_ms), tokens)


def _options_and_fingerprints(items: Sequence[ItemMeta], options: PutOptions, room: int) -> bytes:
    """The put options, then the items' layout fingerprints if any item has one or a token record (none: the
    older form), then the token section if any item has a record and it fits in ``room`` bytes with the rest
    (else the chunks go without their records: a put never fails for them)."""
    out = _PUT_OPTIONS.pack(options.put_id, options.wait_ms)
    records = options.tokens or {}
    with_tokens = any(item.key in records for item in items)
    section = encode_token_section(items, records) if with_tokens else b""
    if len(out) + U64.size * len(items) + len(section) > room:
        section = b""
    if section or any(item.fingerprint for item in items):
        out += struct.pack(f"<{len(items)}Q", *(item.fingerprint for item in items))
    return out + section


class PutBatch(FlagsAnswer, OpCodec):
    """PUT_BATCH: the items and put options, the chunks' bytes as data; answered with a put flag per item."""

    op = Op.PUT_BATCH

    @staticmethod
    def encode_items(items: Sequence[ItemMeta], limits: Limits = DEFAULT_LIMITS) -> bytes:
        """Meta of a PUT_BATCH request: item count, then each item's meta."""
        if len(items) > limits.max_items:
            raise ProtocolError(f"{len(items)} items exceed the limit of {limits.max_items}")
        out = bytearray(U32.pack(len(items)))
        for item in items:
            write_item(out, item, limits)
        return bounded(out, limits)

    @staticmethod
    def decode_items(
        meta: bytes | bytearray | memoryview, data_len: int, limits: Limits = DEFAULT_LIMITS
    ) -> list[ItemMeta]:
        """Decode PUT_BATCH meta and check the items add up to the declared data length."""
        reader = MetaReader(meta)
        items = [read_item(reader, limits) for _ in range(reader.count(limits))]
        reader.done()
        total = sum(item.nbytes for item in items)
        if total != data_len:
            raise ProtocolError(f"items declare {total} bytes but the frame carries {data_len}")
        return items

    @staticmethod
    def encode_request(items: Sequence[ItemMeta], options: PutOptions, limits: Limits = DEFAULT_LIMITS) -> bytes:
        """Meta of a PUT_BATCH request: the items (as :meth:`PutBatch.encode_items`), then the put options and, when an
        item has a layout fingerprint, every item's fingerprint."""
        head = PutBatch.encode_items(items, limits)
        return bounded(
            bytearray(head + _options_and_fingerprints(items, options, limits.max_meta_bytes - len(head))), limits
        )

    @staticmethod
    def decode_request(
        meta: bytes | bytearray | memoryview, data_len: int, limits: Limits = DEFAULT_LIMITS
    ) -> tuple[list[ItemMeta], PutOptions]:
        """Decode PUT_BATCH meta (items, the put options and fingerprints if present); the items must add up to
        ``data_len``."""
        reader = MetaReader(meta)
        items = [read_item(reader, limits) for _ in range(reader.count(limits))]
        items, options = _put_trailer(reader, items)
        reader.done()
        total = sum(item.nbytes for item in items)
        if total != data_len:
            raise ProtocolError(f"items declare {total} bytes but the frame carries {data_len}")
        return items, options


MAX_STAGE_NAME_BYTES = 64
STAGE_TOKEN_BYTES = 32


class PutStaged(FlagsAnswer, OpCodec):
    """PUT_STAGED: a put whose bytes wait in the client's stage on the node's host; answered as PUT_BATCH."""

    op = Op.PUT_STAGED

    @staticmethod
    def encode_request(
        stage: str,
        token: str,
        items: Sequence[ItemMeta],
        offsets: Sequence[int],
        limits: Limits = DEFAULT_LIMITS,
        options: PutOptions | None = None,
    ) -> bytes:
        """Meta of a PUT_STAGED request: the stage's file name and token, the items as in PUT_BATCH,
        each item's offset in the stage, then the put options (none: the node's defaults) and, as in
        PUT_BATCH, the fingerprints (an item with one needs ``options``)."""
        name, secret = stage.encode("ascii"), token.encode("ascii")
        if not 0 < len(name) <= MAX_STAGE_NAME_BYTES or len(secret) != STAGE_TOKEN_BYTES or len(offsets) != len(items):
            raise ProtocolError("PUT_STAGED needs a stage name, its 32-character token and an offset per item")
        out = bytearray(U8.pack(len(name)) + name + secret)
        out += PutBatch.encode_items(items, limits)
        out += b"".join(U64.pack(offset) for offset in offsets)
        if options is not None:
            out += _options_and_fingerprints(items, options, limits.max_meta_bytes - len(out))
        elif any(item.fingerprint for item in items):
            raise ProtocolError("PUT_STAGED items with layout fingerprints need put options before them")
        return bounded(out, limits)

    @staticmethod
    def decode_request(
        meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
    ) -> tuple[str, str, list[ItemMeta], list[int], PutOptions]:
        """``(stage name, token, items, offsets, options)`` of a PUT_STAGED request (the name is not yet checked)."""
        reader = MetaReader(meta)
        (name_len,) = reader.unpack(U8, "stage name length")
        if not 0 < name_len <= MAX_STAGE_NAME_BYTES:
            raise ProtocolError(f"stage name length {name_len} outside 1..{MAX_STAGE_NAME_BYTES}")
        name = reader.text(name_len, "stage name")
        token = reader.text(STAGE_TOKEN_BYTES, "stage token")
        items = [read_item(reader, limits) for _ in range(reader.count(limits))]
        offsets = [int(reader.unpack(U64, "stage offset")[0]) for _ in items]
        items, options = _put_trailer(reader, items)
        reader.done()
        return name, token, items, offsets, options
