"""The node's ring of recent stores and removals, read by a ``kvpool events`` endpoint (docs/fleet-events.md).

Off unless ``event_ring_keys`` is set. An entry is appended only after Redis took it: a put's
keys once its index commit landed (``puts.py``), removed keys once their index entries were
withdrawn (``publisher.py``'s flush: evictions, deletes, drains, drops). Appending is O(keys)
and never waits, so a put's ack never waits for a reader. The ring is bounded by the keys it
holds, not per chunk: a reader that falls behind its oldest entry is told (``gap``) and walks
the node's INVENTORY instead.

A put of a client with ``event_tokens`` carries each chunk's token record (its token ids and parent
hash: ``backend/protocol/tokens.py``); the ring keeps those bytes in the entry, beside its keys,
and nowhere else: they leave with the entry. Nothing is kept per chunk outside the ring.

Sequence numbers start at 0 for each process; the reader keys its cursor by the node's epoch,
which a restart changes.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ENTRY_KEYS", "ENTRY_TOKEN_BYTES", "EventKind", "EventRing", "RingEntry", "RingPage"]

ENTRY_KEYS = 1024  # keys in one entry at most: a larger batch is several entries, so one answer stays small
ENTRY_TOKEN_BYTES = 256 * 1024  # token records in one entry at most (past its first key), for the same reason


class EventKind(enum.IntEnum):
    STORED = 1  # keys committed by one put batch, in the batch's (prefix) order
    REMOVED = 2  # keys whose index entries were withdrawn


@dataclass(frozen=True)
class RingEntry:
    seq: int
    kind: EventKind
    keys: tuple[str, ...]
    records: tuple[bytes | None, ...] | None = None  # per key, its token record; None: no key came with one

    @property
    def token_bytes(self) -> int:
        return sum(len(r) for r in self.records if r is not None) if self.records is not None else 0


@dataclass(frozen=True)
class RingPage:
    """What a reader asking from ``since`` gets: entries in order, the next cursor, and whether it missed some."""

    entries: tuple[RingEntry, ...]
    next_seq: int
    gap: bool  # entries at or after ``since`` already left the ring: resynchronise from INVENTORY


class EventRing:
    """Bounded by ``capacity_keys`` keys over all entries (the oldest entries leave first)."""

    def __init__(self, capacity_keys: int) -> None:
        if capacity_keys <= 0:
            raise ValueError(f"event ring capacity {capacity_keys} is not a positive number of keys")
        self.capacity_keys = capacity_keys
        self._entries: deque[RingEntry] = deque()
        self._keys = 0
        self._next_seq = 0

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def stored(self, keys: Sequence[str], records: Sequence[bytes | None] | None = None) -> None:
        """A committed put's ``keys``, with each key's token record where it came with one."""
        self._append(EventKind.STORED, keys, records if records is not None and any(records) else None)

    def removed(self, keys: Sequence[str]) -> None:
        self._append(EventKind.REMOVED, keys, None)

    def _append(self, kind: EventKind, keys: Sequence[str], records: Sequence[bytes | None] | None) -> None:
        # A long batch is cut into parts (an EVENTS answer carries whole entries; see ENTRY_KEYS and
        # ENTRY_TOKEN_BYTES).
        step = min(ENTRY_KEYS, self.capacity_keys)
        start = 0
        while start < len(keys):
            end, held = start + 1, len(records[start] or b"") if records is not None else 0
            while end < min(start + step, len(keys)):
                more = len(records[end] or b"") if records is not None else 0
                if held + more > ENTRY_TOKEN_BYTES:
                    break
                held += more
                end += 1
            part = tuple(keys[start:end])
            kept = tuple(records[start:end]) if records is not None else None
            self._entries.append(RingEntry(self._next_seq, kind, part, kept))
            self._next_seq += 1
            self._keys += len(part)
            start = end
            while self._keys > self.capacity_keys:
                self._keys -= len(self._entries.popleft().keys)

    def since(self, seq: int, max_keys: int, max_token_bytes: int = 0) -> RingPage:
        """Entries from ``seq`` on, whole entries up to about ``max_keys`` keys and, when ``max_token_bytes``
        is given, that many bytes of token records (always at least one entry)."""
        if seq > self._next_seq:
            return RingPage((), self._next_seq, True)  # a cursor this run never gave: resynchronise
        oldest = self._entries[0].seq if self._entries else self._next_seq
        gap = seq < oldest
        out: list[RingEntry] = []
        count = token_bytes = 0
        for entry in self._entries:
            if entry.seq < seq:
                continue
            if out and count + len(entry.keys) > max_keys:
                break
            if out and max_token_bytes and token_bytes + entry.token_bytes > max_token_bytes:
                break
            out.append(entry)
            count += len(entry.keys)
            token_bytes += entry.token_bytes
        next_seq = out[-1].seq + 1 if out else self._next_seq
        return RingPage(tuple(out), next_seq, gap)
