"""EVENTS: read a node's ring of recent stores and removals (``backend/node/events.py``); JSON both ways.

Request ``{"since": SEQ, "max_keys": N}``; answer ``{"next": SEQ, "gap": BOOL, "entries":
[[SEQ, KIND, [KEY, ...]], ...]}`` with KIND 1 (stored, in prefix order) or 2 (removed). A node
without a ring answers with the ``UNSUPPORTED`` status's error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.errors import ProtocolError
from backend.protocol.frame import DEFAULT_LIMITS, Limits
from backend.protocol.meta import check_key, decode_json, encode_json

__all__ = [
    "MAX_EVENTS_KEYS",
    "EVENT_STORED",
    "EVENT_REMOVED",
    "EventsEntry",
    "EventsPage",
    "encode_events_request",
    "decode_events_request",
    "encode_events_response",
    "decode_events_response",
]

MAX_EVENTS_KEYS = 2048  # keys one EVENTS answer may carry (each entry has at most 1024)
EVENT_STORED = 1
EVENT_REMOVED = 2


@dataclass(frozen=True)
class EventsEntry:
    seq: int
    kind: int  # EVENT_STORED or EVENT_REMOVED
    keys: tuple[str, ...]


@dataclass(frozen=True)
class EventsPage:
    entries: tuple[EventsEntry, ...]
    next_seq: int
    gap: bool  # the ring no longer holds some entries from the cursor asked for


def _seq(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
        raise ProtocolError(f"EVENTS {name} {value!r} is not a sequence number")
    return value


def encode_events_request(since: int, max_keys: int) -> bytes:
    if not 0 < max_keys <= MAX_EVENTS_KEYS:
        raise ProtocolError(f"EVENTS max_keys {max_keys} is outside 1..{MAX_EVENTS_KEYS}")
    return encode_json({"since": _seq("since", since), "max_keys": max_keys})


def decode_events_request(meta: bytes | bytearray) -> tuple[int, int]:
    body = decode_json(meta)
    max_keys = body.get("max_keys")
    if not isinstance(max_keys, int) or isinstance(max_keys, bool) or not 0 < max_keys <= MAX_EVENTS_KEYS:
        raise ProtocolError(f"EVENTS max_keys {max_keys!r} is outside 1..{MAX_EVENTS_KEYS}")
    return _seq("since", body.get("since")), max_keys


def encode_events_response(page: EventsPage) -> bytes:
    return encode_json(
        {"next": page.next_seq, "gap": page.gap, "entries": [[e.seq, e.kind, list(e.keys)] for e in page.entries]}
    )


def decode_events_response(meta: bytes | bytearray, limits: Limits = DEFAULT_LIMITS) -> EventsPage:
    body = decode_json(meta)
    raw = body.get("entries")
    if not isinstance(raw, list) or not isinstance(body.get("gap"), bool):
        raise ProtocolError("EVENTS answer lacks its entries or gap")
    entries: list[EventsEntry] = []
    total = 0
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], list)):
            raise ProtocolError(f"EVENTS entry {str(item)[:80]} is not [seq, kind, keys]")
        seq, kind, keys = item
        if kind not in (EVENT_STORED, EVENT_REMOVED):
            raise ProtocolError(f"EVENTS entry kind {kind!r} is unknown")
        total += len(keys)
        if total > MAX_EVENTS_KEYS:
            raise ProtocolError(f"EVENTS answer carries more than {MAX_EVENTS_KEYS} keys")
        for key in keys:
            if not isinstance(key, str):
                raise ProtocolError(f"EVENTS key {key!r} is not a string")
            check_key(key, limits)
        entries.append(EventsEntry(_seq("entry seq", seq), kind, tuple(keys)))
    return EventsPage(tuple(entries), _seq("next", body.get("next")), body["gap"])
