"""NodeAdmin: the admin requests a client sends to one named node, typed.

The data path asks the index where a key lives and reads whichever copy answers;
the admin verbs (``backend.admin``: drain, flush, check, status) instead address one
given node: list what it holds (INVENTORY), ask whether it holds keys
(EXISTS_BATCH), have it re-check its copies (VERIFY_BATCH), delete from it alone
(DELETE_BATCH, leaving the index to the caller), pin and unpin keys on it and list its pins
(PIN, UNPIN, PINS), read its ring of stores and removals (EVENTS) and read its figures (STAT). Each
method encodes its request and decodes the answer with ``backend.protocol`` and
returns typed values, so no caller handles frames or reads rows by position.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from backend.client.connection import Connections
from backend.errors import ProtocolError
from backend.metadata import NodeInfo
from backend.protocol import Op
from backend.protocol.events import MAX_EVENTS_KEYS, Events, EventsPage
from backend.protocol.inventory import Inventory, InventoryPage, InventoryRow, Verified, VerifyBatch
from backend.protocol.pins import Pin, PinPage, PinRequest, PinRow, Pins, Unpin
from backend.protocol.reads import DeleteBatch, ExistsBatch
from backend.protocol.reports import NodeReport, Ping, Stat

__all__ = ["NodeAdmin", "INVENTORY_PAGE", "PINS_PAGE"]

INVENTORY_PAGE = 1000  # rows per INVENTORY request when walking a node
PINS_PAGE = 1000  # rows per PINS request


class NodeAdmin:
    """Admin requests to one node at a time, over the client's connections to it."""

    def __init__(self, connections: Connections) -> None:
        self._connections = connections

    async def _request(self, node: NodeInfo, op: Op, meta: bytes) -> Any:
        return await self._connections.to(node).request(op, meta)

    async def bound_tenant(self, node: NodeInfo) -> str | None:
        """The tenant ``node`` bound this client's connections to in the handshake, its token being that tenant's
        (None: the pool token, or a pool without one); a PING opens a connection if none is open."""
        conns = self._connections.to(node)
        await conns.request(Op.PING, Ping.encode_request())
        return conns.tenant

    async def inventory(self, node: NodeInfo, after: str = "", limit: int = INVENTORY_PAGE) -> InventoryPage:
        """Up to ``limit`` chunks ``node`` holds, in key order, all with keys greater than ``after``."""
        return Inventory.decode_answer(await self._request(node, Op.INVENTORY, Inventory.encode_request(after, limit)))

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
        answer = await self._request(node, Op.EXISTS_BATCH, ExistsBatch.encode_request(keys))
        return [bool(f) for f in ExistsBatch.decode_answer(answer, len(keys))]

    async def verify(self, node: NodeInfo, keys: Sequence[str]) -> list[Verified]:
        """Have ``node`` re-check its copy of each key against its checksum, without shipping bytes.

        A copy found corrupt is dropped (DRAM) or quarantined (NVMe) by the node at once.
        """
        if not keys:
            return []
        flags = VerifyBatch.decode_answer(
            await self._request(node, Op.VERIFY_BATCH, VerifyBatch.encode_request(keys)), len(keys)
        )
        try:
            return [Verified(f) for f in flags]
        except ValueError:
            raise ProtocolError(f"VERIFY_BATCH answer carries an unknown status among {sorted(set(flags))}") from None

    async def delete_on(self, node: NodeInfo, keys: Sequence[str]) -> list[bool]:
        """Delete keys from ``node`` alone (it withdraws its own index entries); whether each was held."""
        if not keys:
            return []
        answer = await self._request(node, Op.DELETE_BATCH, DeleteBatch.encode_request(keys))
        return [bool(f) for f in DeleteBatch.decode_answer(answer, len(keys))]

    async def events(
        self, node: NodeInfo, since: int, max_keys: int = MAX_EVENTS_KEYS, tokens: bool = False
    ) -> EventsPage:
        """``node``'s ring of committed stores and removals from ``since`` (a `kvpool events` endpoint reads it),
        with the stored chunks' token records when ``tokens``."""
        request = Events.encode_request(since, max_keys, tokens)
        return Events.decode_answer(await self._request(node, Op.EVENTS, request))

    async def stats(self, node: NodeInfo) -> NodeReport:
        """``node``'s STAT answer: counters, tiers, recent window, latency histograms (docs/operations.md)."""
        return Stat.decode_answer(await self._request(node, Op.STAT, Stat.encode_request()))

    async def pin(self, node: NodeInfo, request: PinRequest) -> tuple[list[bool], float | None]:
        """Pin keys on ``node``: ``(held per key, the ttl it applied or None for none)``. All or nothing: a key it
        does not hold is False and then nothing was pinned. A ttl its settings refuse: KVPoolError naming it."""
        answer = await self._request(node, Op.PIN, Pin.encode_request(request))
        return Pin.decode_answer(answer, len(request.keys))

    async def unpin(self, node: NodeInfo, owner: str, keys: Sequence[str]) -> list[bool]:
        """Let go of ``owner``'s newest pin of each key on ``node``; whether it had one."""
        if not keys:
            return []
        return Unpin.decode_answer(await self._request(node, Op.UNPIN, Unpin.encode_request(owner, keys)), len(keys))

    async def pins(self, node: NodeInfo, prefix: str = "") -> list[PinRow]:
        """Every key ``node`` pins (of keys starting with ``prefix``), one row per key and owner, in order."""
        rows: list[PinRow] = []
        after: tuple[str, str] | None = None
        while True:
            page: PinPage = Pins.decode_answer(
                await self._request(node, Op.PINS, Pins.encode_request(prefix, after, PINS_PAGE))
            )
            rows.extend(page.rows)
            if not page.more or not page.rows:
                return rows
            after = (page.rows[-1].key, page.rows[-1].owner)
