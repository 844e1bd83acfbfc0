"""What the node answers to each request op: one handler per op, looked up in a table.

A handler takes the request's meta section and the session it came on, and returns
the reply's meta and data buffers. HELLO, AUTH and PUT_BATCH are not here: the
session answers the first two itself (they decide whether the connection may ask
anything else) and receives PUT_BATCH's bytes in stream order before committing it
with :class:`~backend.node.puts.PutReceiver`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from backend.errors import ProtocolError
from backend.node.context import NodeContext
from backend.node.dram import StoredChunk
from backend.node.leases import MAX_LEASE_TTL_MS
from backend.node.publisher import ANSWER_FLUSH_S, IndexPublisher
from backend.node.puts import PutReceiver
from backend.node.stats import NodeStats
from backend.protocol import (
    LEASE_MAP,
    NO_OFFSET,
    InventoryPage,
    InventoryRow,
    ItemMeta,
    Op,
    Verified,
    decode_channel_request,
    decode_inventory_request,
    decode_keys,
    decode_lease_request,
    decode_release,
    encode_channel_response,
    encode_flags,
    encode_get_response,
    encode_inventory_response,
    encode_json,
    encode_lease_response,
    encode_node_report,
)
from backend.transport import Buffer

if TYPE_CHECKING:
    from backend.node.session import Session

__all__ = ["OpHandlers"]

Reply = tuple[bytes, list[Buffer]]
Handler = Callable[[bytearray, "Session"], Awaitable[Reply]]


class OpHandlers:
    """The node's request handlers, by op."""

    def __init__(self, ctx: NodeContext, stats: NodeStats, publisher: IndexPublisher, puts: PutReceiver) -> None:
        self.ctx = ctx
        self.stats = stats
        self.publisher = publisher
        self.puts = puts
        self.channel: Any = None  # nccl_channel.channel.ChannelServer, once the node serves one (use_channel)
        self.table: dict[int, Handler] = {
            Op.GET_BATCH: self.get_batch,
            Op.EXISTS_BATCH: self.exists_batch,
            Op.DELETE_BATCH: self.delete_batch,
            Op.INVENTORY: self.inventory,
            Op.VERIFY_BATCH: self.verify_batch,
            Op.LEASE: self.lease,
            Op.RELEASE: self.release,
            Op.PUT_STAGED: self.put_staged,
            Op.CHANNEL_GET: self.channel_get,
            Op.STAT: self.stat,
            Op.PING: self.ping,
        }

    def use_channel(self, channel: Any) -> None:
        """Answer CHANNEL_GET with ``channel`` (``nccl_channel.channel.ChannelServer``)."""
        self.channel = channel

    async def handle(self, op: int, meta: bytearray, session: Session) -> Reply:
        handler = self.table.get(op)
        if handler is None:
            raise ProtocolError(f"op {op} is not a request")
        return await handler(meta, session)

    async def _fetch(self, keys: list[str], *, channel: bool) -> tuple[list[ItemMeta | None], list[Buffer]]:
        """Each key's chunk (an NVMe hit is promoted), within one reply's data limit; keys past it are misses.

        A reply never exceeds what a client accepts (``limits.max_data_bytes``); the
        client reads the keys answered as misses again (over TCP, or in its next GET).
        Counted as the channel's gets, hits and misses with ``channel``.
        """
        tiers, counters = self.ctx.tiers, self.ctx.counters
        found: list[ItemMeta | None] = []
        data: list[Buffer] = []
        budget = self.ctx.config.limits.max_data_bytes
        for key in keys:
            chunk = await tiers.get(key)
            counters["channel_gets" if channel else "gets"] += 1
            if chunk is not None and chunk.meta.nbytes > budget:
                counters["get_over_frame_limit"] += 1
                chunk = None
            if chunk is None:
                counters["channel_misses" if channel else "misses"] += 1
                found.append(None)
            else:
                counters["channel_hits" if channel else "hits"] += 1
                found.append(chunk.meta)
                data.append(chunk.buffer)
                budget -= chunk.meta.nbytes
        return found, data

    async def get_batch(self, meta: bytearray, session: Session) -> Reply:
        limits = self.ctx.config.limits
        found, data = await self._fetch(decode_keys(meta, limits), channel=False)
        self.ctx.counters["get_bytes"] += sum(item.nbytes for item in found if item is not None)
        return encode_get_response(found, limits), data

    async def exists_batch(self, meta: bytearray, session: Session) -> Reply:
        tiers = self.ctx.tiers
        return encode_flags([int(tiers.contains(key)) for key in decode_keys(meta, self.ctx.config.limits)]), []

    async def delete_batch(self, meta: bytearray, session: Session) -> Reply:
        ctx = self.ctx
        keys = decode_keys(meta, ctx.config.limits)
        deleted = [key for key in keys if await ctx.tiers.delete(key)]
        # Their index entries go with the next flush, now if Redis answers in time: the client's answer never
        # waits out a paused Redis (an entry that outlives its bytes reads as a miss meanwhile).
        ctx.tiers.changes.put_back(set(deleted), {})
        await self.publisher.flush_index_within(ANSWER_FLUSH_S)
        ctx.counters["deletes"] += len(deleted)
        gone = set(deleted)
        return encode_flags([int(key in gone) for key in keys]), []

    async def inventory(self, meta: bytearray, session: Session) -> Reply:
        """One page of what this node holds after the request's ``after`` key, in key order."""
        after, limit = decode_inventory_request(meta)
        held, more = self.ctx.tiers.page(after, limit)
        rows = tuple(InventoryRow(item.key, tier, item.nbytes, item.checksum) for item, tier in held)
        return encode_inventory_response(InventoryPage(rows, more)), []

    async def verify_batch(self, meta: bytearray, session: Session) -> Reply:
        tiers = self.ctx.tiers
        flags = [Verified[(await tiers.verify(k)).upper()] for k in decode_keys(meta, self.ctx.config.limits)]
        if any(flags):  # a dropped corrupt copy leaves the index now (if Redis answers in time), not at the beat
            await self.publisher.flush_index_within(ANSWER_FLUSH_S)
        return encode_flags(flags), []

    async def lease(self, meta: bytearray, session: Session) -> Reply:
        """Pin the keys this node holds for the session; with LEASE_MAP, also answer their arena offsets.

        A mapped read is a GET whose bytes the client copies itself: the chunk is
        fetched (an NVMe hit is promoted into the arena) and the lease holds the
        chunk object, so its region outlives a concurrent delete or eviction.
        Without LEASE_MAP this is a lock only: nothing moves, so it never waits.
        """
        ctx, tiers, counters = self.ctx, self.ctx.tiers, self.ctx.counters
        ttl_ms, lease_flags, keys = decode_lease_request(meta, ctx.config.limits)
        if ttl_ms > MAX_LEASE_TTL_MS:
            raise ProtocolError(f"lease ttl_ms {ttl_ms} exceeds {MAX_LEASE_TTL_MS}")
        want_map = bool(lease_flags & LEASE_MAP)
        found: list[tuple[ItemMeta, int] | None] = []
        held: list[str] = []
        chunks: list[StoredChunk] = []
        arena = tiers.shm_arena  # a private arena's offsets mean nothing to a client
        for key in keys:
            if want_map:
                chunk = await tiers.get(key)
                counters["gets"] += 1
                if chunk is None:
                    counters["misses"] += 1
                    found.append(None)
                    continue
                offset = arena.offset_of(chunk.buffer) if arena is not None else None
                counters["hits"] += 1
                if offset is not None:
                    counters["shm_get_bytes"] += chunk.meta.nbytes
                found.append((chunk.meta, NO_OFFSET if offset is None else offset))
                chunks.append(chunk)
            else:
                item = tiers.meta_of(key)
                found.append(None if item is None else (item, NO_OFFSET))
                if item is None:
                    continue
            held.append(key)
        conn = session.conn
        lease_id = tiers.leases.grant(held, chunks, ttl_ms, owner=conn) if held else 0
        if lease_id and conn.closed:
            tiers.leases.release_owner(conn)  # it closed while we fetched: its teardown has already run
        return encode_lease_response(lease_id, found, ctx.config.limits), []

    async def release(self, meta: bytearray, session: Session) -> Reply:
        lease_id, keys = decode_release(meta, self.ctx.config.limits)
        return encode_json({"released": self.ctx.tiers.leases.release(lease_id, keys)}), []

    async def put_staged(self, meta: bytearray, session: Session) -> Reply:
        puts = self.puts
        received, options = await puts.receive_staged(meta, session)
        return await puts.commit(received, options)

    async def channel_get(self, meta: bytearray, session: Session) -> Reply:
        """CHANNEL_GET: join the pair if new, answer which keys are held, send their bytes over the pair."""
        ctx, channel = self.ctx, self.channel
        if channel is None:
            raise ProtocolError(f"node {ctx.node_id} serves no channel (start it with --channel)")
        request = decode_channel_request(meta, ctx.config.limits)
        pair, keys = request.session, request.keys
        if not keys:
            # Pairing: answered once the offer is taken; the join runs on with its own deadline,
            # so a slow NCCL init never holds this request (and the client's connection) open.
            await channel.start_join(pair, request.offer)
            return encode_channel_response([], ctx.config.limits), []
        await channel.join(pair)  # NcclError: answered as an error; the client falls back to TCP
        found, buffers = await self._fetch(keys, channel=True)  # keys past the limit are read over TCP
        if buffers:
            # The client receives after reading the answer; the pair's lock keeps batches in order.
            ctx.spawn(channel.send(pair, buffers))
        return encode_channel_response(found, ctx.config.limits), []

    async def stat(self, meta: bytearray, session: Session) -> Reply:
        return encode_node_report(self.stats.report()), []

    async def ping(self, meta: bytearray, session: Session) -> Reply:
        return encode_json({"node_id": self.ctx.node_id, "epoch": self.ctx.epoch}), []
