"""When two copies of one key are the same chunk: the one definition every tier and the table use.

The same chunk is the same bytes (their checksum) stored with the same layout fingerprint
(docs/design.md, "KV layout fingerprints"): a put of equal bytes with another fingerprint is
another chunk, stored, and the copy kept on a tier or on disk must carry the fingerprint its
readers ask with (the NVMe header's ``layout``; a restarted node checks reads against it).
``TierManager.holds``, ``DramTier.holds``, ``ChunkTable.same_bytes`` and what the tiers and the
demoter compare (an NVMe file against the DRAM chunk) all ask here, so the rule cannot drift
between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from backend.node.store.keys import NO_SLOT
from backend.protocol import ItemMeta

__all__ = ["Rows", "same_chunk", "same_meta", "slot_holds"]


class Rows(Protocol):
    """What :func:`slot_holds` reads of a ``bookkeeping.ChunkTable`` (which imports this module)."""

    @property
    def checksum(self) -> Sequence[int]: ...

    def fingerprint(self, slot: int) -> int: ...


def same_chunk(checksum: int, fingerprint: int, other_checksum: int, other_fingerprint: int) -> bool:
    """Whether the chunk of ``checksum`` stored with ``fingerprint`` is the other one: the definition."""
    return checksum == other_checksum and fingerprint == other_fingerprint


def same_meta(a: ItemMeta, b: ItemMeta) -> bool:
    """Whether two descriptions of one key's chunk (a file's, a DRAM chunk's, a put's) are the same chunk."""
    return same_chunk(a.checksum, a.fingerprint, b.checksum, b.fingerprint)


def slot_holds(table: Rows, slot: int, checksum: int, fingerprint: int) -> bool:
    """Whether ``slot`` of ``table`` (NO_SLOT: none) holds the chunk of ``checksum`` and ``fingerprint``."""
    return slot != NO_SLOT and same_chunk(table.checksum[slot], table.fingerprint(slot), checksum, fingerprint)
