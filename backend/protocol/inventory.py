"""INVENTORY and VERIFY_BATCH, the admin ops: page through the keys a node holds; have it re-check its copies.

VERIFY_BATCH's request is a key list (``encode_keys``) and its answer a :class:`Verified`
flag per key (``encode_flags``); INVENTORY's request and answer are JSON.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from backend.errors import ProtocolError
from backend.protocol.frame import DEFAULT_LIMITS, Limits, Op, OpCodec
from backend.protocol.meta import FlagsAnswer, KeysRequest, decode_json, encode_json

__all__ = ["MAX_INVENTORY_PAGE", "Verified", "InventoryRow", "InventoryPage", "Inventory", "VerifyBatch"]

MAX_INVENTORY_PAGE = 10_000  # rows one INVENTORY answer may carry


class Verified(enum.IntEnum):
    """Per-key outcome of a VERIFY_BATCH, in the response's flag list."""

    OK = 0  # the copy's checksum is right
    MISSING = 1  # the node does not hold the key
    CORRUPT = 2  # the node dropped or quarantined that copy when it found it


@dataclass(frozen=True)
class InventoryRow:
    """One chunk a node holds, as INVENTORY lists it."""

    key: str
    tier: str
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class InventoryPage:
    """One INVENTORY answer: rows in key order, and whether keys after the last one remain."""

    rows: tuple[InventoryRow, ...]
    more: bool


class Inventory(OpCodec):
    """INVENTORY: a page of the keys a node holds, after a key; JSON both ways."""

    op = Op.INVENTORY

    @staticmethod
    def encode_request(after: str, limit: int) -> bytes:
        """Meta of an INVENTORY request: up to ``limit`` keys greater than ``after`` ("" for the first page)."""
        if not 0 < limit <= MAX_INVENTORY_PAGE:
            raise ProtocolError(f"INVENTORY limit {limit} is outside 1..{MAX_INVENTORY_PAGE}")
        return encode_json({"after": after, "limit": limit})

    @staticmethod
    def decode_request(meta: bytes | bytearray | memoryview) -> tuple[str, int]:
        """``(after, limit)`` of an INVENTORY request (``limit`` 1000 when absent)."""
        request = decode_json(meta)
        after, limit = request.get("after", ""), request.get("limit", 1000)
        if not isinstance(after, str) or not isinstance(limit, int) or not 0 < limit <= MAX_INVENTORY_PAGE:
            raise ProtocolError(f"INVENTORY wants {{after: str, limit: 1..{MAX_INVENTORY_PAGE}}}")
        return after, limit

    @staticmethod
    def encode_answer(page: InventoryPage) -> bytes:
        """Meta of an INVENTORY answer: ``{"items": [[key, tier, nbytes, checksum], ...], "more": bool}``."""
        items = [[row.key, row.tier, row.nbytes, row.checksum] for row in page.rows]
        return encode_json({"items": items, "more": page.more})

    @staticmethod
    def decode_answer(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> InventoryPage:
        """An INVENTORY answer ``{"items": [[key, tier, nbytes, checksum], ...], "more": bool}``, checked row by row."""
        body = decode_json(meta)
        items, more = body.get("items"), body.get("more")
        if not isinstance(items, list) or len(items) > MAX_INVENTORY_PAGE or not isinstance(more, bool):
            raise ProtocolError(f"INVENTORY response wants {{items: list of at most {MAX_INVENTORY_PAGE}, more: bool}}")
        rows = []
        for item in items:
            try:
                key, tier, nbytes, item_sum = item
            except (TypeError, ValueError):
                raise ProtocolError(f"INVENTORY row {str(item)[:80]} is not [key, tier, nbytes, checksum]") from None
            if (
                not isinstance(key, str)
                or not 0 < len(key.encode("utf-8")) <= limits.max_key_bytes
                or not isinstance(tier, str)
                or not isinstance(nbytes, int)
                or not 0 <= nbytes <= limits.max_data_bytes
                or not isinstance(item_sum, int)
                or not 0 <= item_sum < 2**64
            ):
                raise ProtocolError(f"INVENTORY row for {str(key)[:80]!r} is malformed or out of range")
            rows.append(InventoryRow(key, tier, nbytes, item_sum))
        return InventoryPage(tuple(rows), more)


class VerifyBatch(KeysRequest, FlagsAnswer, OpCodec):
    """VERIFY_BATCH: a key list, answered with a :class:`Verified` flag per key."""

    op = Op.VERIFY_BATCH
