"""EVENTS: read a node's ring of recent stores and removals (``backend/node/events.py``); JSON both ways.

Request ``{"since": SEQ, "max_keys": N}``, with ``"tokens": true`` from a reader that wants the
token records; answer ``{"next": SEQ, "gap": BOOL, "entries": [[SEQ, KIND, [KEY, ...]], ...]}``
with KIND 1 (stored, in prefix order) or 2 (removed). A stored entry of which some key came with a
token record (``tokens.py``) has, for a reader that asked, a fourth element: one record per key, in
base64, or null. A node without a ring answers with the ``UNSUPPORTED`` status's error.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from backend.errors import ProtocolError
from backend.protocol.frame import DEFAULT_LIMITS, Limits, Op, OpCodec
from backend.protocol.meta import check_key, decode_json, encode_json
from backend.protocol.tokens import ChunkTokens, check_record, decode_record

__all__ = [
    "MAX_EVENTS_KEYS",
    "MAX_EVENTS_TOKEN_BYTES",
    "EVENT_STORED",
    "EVENT_REMOVED",
    "EventsEntry",
    "EventsPage",
    "Events",
]

MAX_EVENTS_KEYS = 2048  # keys one EVENTS answer may carry (each entry has at most 1024)
MAX_EVENTS_TOKEN_BYTES = 1 << 20  # token records one EVENTS answer carries, past its first entry
EVENT_STORED = 1
EVENT_REMOVED = 2


@dataclass(frozen=True)
class EventsEntry:
    seq: int
    kind: int  # EVENT_STORED or EVENT_REMOVED
    keys: tuple[str, ...]
    records: tuple[bytes | None, ...] | None = None  # per key, its token record as sent; None: no key has one
    tokens: tuple[ChunkTokens | None, ...] | None = None  # the records decoded (by Events.decode_answer)


@dataclass(frozen=True)
class EventsPage:
    entries: tuple[EventsEntry, ...]
    next_seq: int
    gap: bool  # the ring no longer holds some entries from the cursor asked for


def _seq(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
        raise ProtocolError(f"EVENTS {name} {value!r} is not a sequence number")
    return value


class Events(OpCodec):
    """EVENTS: a page of the node's ring of recent stores and removals, from a sequence number."""

    op = Op.EVENTS

    @staticmethod
    def encode_request(since: int, max_keys: int, tokens: bool = False) -> bytes:
        if not 0 < max_keys <= MAX_EVENTS_KEYS:
            raise ProtocolError(f"EVENTS max_keys {max_keys} is outside 1..{MAX_EVENTS_KEYS}")
        body: dict[str, Any] = {"since": _seq("since", since), "max_keys": max_keys}
        if tokens:  # absent otherwise: the request of an older reader, byte for byte
            body["tokens"] = True
        return encode_json(body)

    @staticmethod
    def decode_request(meta: bytes | bytearray) -> tuple[int, int, bool]:
        """``(since, max_keys, whether the reader wants token records)``."""
        body = decode_json(meta)
        max_keys = body.get("max_keys")
        if not isinstance(max_keys, int) or isinstance(max_keys, bool) or not 0 < max_keys <= MAX_EVENTS_KEYS:
            raise ProtocolError(f"EVENTS max_keys {max_keys!r} is outside 1..{MAX_EVENTS_KEYS}")
        return _seq("since", body.get("since")), max_keys, body.get("tokens") is True

    @staticmethod
    def encode_answer(page: EventsPage) -> bytes:
        return encode_json({"next": page.next_seq, "gap": page.gap, "entries": [_entry(e) for e in page.entries]})

    @staticmethod
    def decode_answer(meta: bytes | bytearray, limits: Limits = DEFAULT_LIMITS) -> EventsPage:
        body = decode_json(meta)
        raw = body.get("entries")
        if not isinstance(raw, list) or not isinstance(body.get("gap"), bool):
            raise ProtocolError("EVENTS answer lacks its entries or gap")
        entries: list[EventsEntry] = []
        total = 0
        for item in raw:
            if not (isinstance(item, list) and len(item) in (3, 4) and isinstance(item[2], list)):
                raise ProtocolError(f"EVENTS entry {str(item)[:80]} is not [seq, kind, keys(, token records)]")
            seq, kind, keys = item[:3]
            if kind not in (EVENT_STORED, EVENT_REMOVED):
                raise ProtocolError(f"EVENTS entry kind {kind!r} is unknown")
            total += len(keys)
            if total > MAX_EVENTS_KEYS:
                raise ProtocolError(f"EVENTS answer carries more than {MAX_EVENTS_KEYS} keys")
            for key in keys:
                if not isinstance(key, str):
                    raise ProtocolError(f"EVENTS key {key!r} is not a string")
                check_key(key, limits)
            records = _records(item[3], keys) if len(item) == 4 else None
            tokens = tuple(None if r is None else decode_record(r) for r in records) if records is not None else None
            entries.append(EventsEntry(_seq("entry seq", seq), kind, tuple(keys), records, tokens))
        return EventsPage(tuple(entries), _seq("next", body.get("next")), body["gap"])


def _entry(e: EventsEntry) -> list[Any]:
    out: list[Any] = [e.seq, e.kind, list(e.keys)]
    if e.records is not None:
        out.append([None if r is None else base64.b64encode(r).decode("ascii") for r in e.records])
    return out


def _records(raw: Any, keys: list[Any]) -> tuple[bytes | None, ...]:
    if not isinstance(raw, list) or len(raw) != len(keys):
        raise ProtocolError("EVENTS entry's token records are not one per key")
    records: list[bytes | None] = []
    for text in raw:
        if text is None:
            records.append(None)
            continue
        try:
            record = base64.b64decode(text, validate=True) if isinstance(text, str) else b""
        except ValueError:  # binascii.Error
            raise ProtocolError("EVENTS token record is not base64") from None
        check_record(record, "EVENTS token record")
        records.append(record)
    return tuple(records)
