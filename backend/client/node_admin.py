"""NodeAdmin: the admin requests a client sends to one named node, typed.

The data path asks the index where a key lives and reads whichever copy answers;
the admin verbs (``backend.admin``: drain, flush, check, status) instead address one
given node: list what it holds (INVENTORY), ask whether it holds keys
(EXISTS_BATCH), have it re-check its copies (VERIFY_BATCH), delete from it alone
(DELETE_BATCH, leaving the index to the caller) and read its figures (STAT). Each
method encodes its request and decodes the answer with ``backend.protocol`` and
returns typed values, so no caller handles frames or reads rows by position.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from backend.client.connection import Connections
from backend.errors import ProtocolError
from backend.metadata import NodeInfo
from backend.protocol import (
    InventoryPage,
    InventoryRow,
    NodeReport,
    Op,
    Verified,
    decode_flags,
    decode_inventory_response,
    decode_node_report,
    encode_inventory_request,
    encode_keys,
)

__all__ = ["NodeAdmin", "INVENTORY_PAGE"]

INVENTORY_PAGE = 1000  # rows per INVENTORY request when walking a node


class NodeAdmin:
    """Admin requests to one node at a time, over the client's connections to it."""

    def __init__(self, connections: Connections) -> None:
        self._connections = connections

    async def _request(self, node: NodeInfo, op: Op, meta: bytes) -> Any:
        return await self._connections.to(node).request(op, meta)

    async def inventory(self, node: NodeInfo, after: str = "", limit: int = INVENTORY_PAGE) -> InventoryPage:
        """Up to ``limit`` chunks ``node`` holds, in key order, all with keys greater than ``after``."""
        return decode_inventory_response(
            await self._request(node, Op.INVENTORY, encode_inventory_request(after, limit))
        )

    async def inventory_pages(self, node: NodeInfo, limit: int = INVENTORY_PAGE) -> AsyncIterator[list[InventoryRow]]:
        """Everything ``node`` holds, one non-empty page at a time (each page's last key is the next cursor)."""
        after = ""
        while True:
            page = await self.inventory(node, after, limit)
            if page.rows:
                yield list(page.rows)
                after = page.rows[-1].key
            if not page.more or not page.rows:
                return

    async def exists(self, node: NodeInfo, keys: Sequence[str]) -> list[bool]:
        """Whether ``node`` itself holds each key (whatever the index says)."""
        if not keys:
            return []
        return [bool(f) for f in decode_flags(await self._request(node, Op.EXISTS_BATCH, encode_keys(keys)), len(keys))]

    async def verify(self, node: NodeInfo, keys: Sequence[str]) -> list[Verified]:
        """Have ``node`` re-check its copy of each key against its checksum, without shipping bytes.

        A copy found corrupt is dropped (DRAM) or quarantined (NVMe) by the node at once.
        """
        if not keys:
            return []
        flags = decode_flags(await self._request(node, Op.VERIFY_BATCH, encode_keys(keys)), len(keys))
        try:
            return [Verified(f) for f in flags]
        except ValueError:
            raise ProtocolError(f"VERIFY_BATCH answer carries an unknown status among {sorted(set(flags))}") from None

    async def delete_on(self, node: NodeInfo, keys: Sequence[str]) -> list[bool]:
        """Delete keys from ``node`` alone (it withdraws its own index entries); whether each was held."""
        if not keys:
            return []
        return [bool(f) for f in decode_flags(await self._request(node, Op.DELETE_BATCH, encode_keys(keys)), len(keys))]

    async def stats(self, node: NodeInfo) -> NodeReport:
        """``node``'s STAT answer: counters, tiers, recent window, latency histograms (docs/operations.md)."""
        return decode_node_report(await self._request(node, Op.STAT, b""))
