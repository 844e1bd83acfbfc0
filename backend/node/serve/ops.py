"""What the node answers to each request op: one handler per op, in one table.

Every op's handler is in :attr:`OpTable.table`, looked up by op code. It gets the
request (``peer.py``: header, meta section) and the :class:`~backend.node.serve.peer.Peer`
it came on, runs in stream order, and hands its answer to ``peer.answer``. Most ops
carry no data: their whole work is the answer (``_beside``). PUT_BATCH receives its
bytes in its handler, since they must leave the socket in order; verification,
commit and reply overlap with the next request (``puts.py``). The read ops (GET, EXISTS,
CHANNEL_GET, LEASE, RELEASE, TOUCH) are ``read_ops.py``'s. Each handler decodes its request,
makes one call of the store (``TierManager``), and encodes the answer. HELLO and AUTH are not
here: the session answers them itself (they decide whether the connection may ask
anything else).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from backend.counters import NodeCounter
from backend.errors import AuthError, CapacityError, KVPoolError, ProtocolError
from backend.node.context import NodeContext
from backend.node.index.publisher import ANSWER_FLUSH_S, IndexPublisher
from backend.node.serve.peer import Answer, Peer, Reply, Request
from backend.node.serve.puts import PutReceiver
from backend.node.serve.read_ops import ChannelServing, ReadOps
from backend.node.serve.tenancy import check_keys, refused_op
from backend.node.stats import NodeStats
from backend.protocol import Op
from backend.protocol.events import MAX_EVENTS_TOKEN_BYTES, Events, EventsEntry, EventsPage
from backend.protocol.inventory import Inventory, InventoryPage, InventoryRow, Verified, VerifyBatch
from backend.protocol.pins import Pin, Pins, Unpin
from backend.protocol.puts import PutBatch
from backend.protocol.reads import DeleteBatch
from backend.protocol.reports import Ping, Stat

__all__ = ["OpTable"]

Handler = Callable[[Request, Peer], Awaitable[None]]  # runs in stream order; answers through the peer
Answering = Callable[[bytearray, Peer], Awaitable[Reply]]  # an op with no data: its answer from its meta

CARRY_DATA = frozenset({Op.PUT_BATCH})  # the ops whose frames have a data section


class OpTable:
    """The node's operations: op code -> handler."""

    def __init__(self, ctx: NodeContext, stats: NodeStats, publisher: IndexPublisher, puts: PutReceiver) -> None:
        self.ctx = ctx
        self.stats = stats
        self.publisher = publisher
        self.puts = puts
        self.reads = ReadOps(ctx)  # read_ops.py
        reads = self.reads
        answering: dict[int, Answering] = {
            Op.GET_BATCH: reads.get_batch,
            Op.EXISTS_BATCH: reads.exists_batch,
            Op.DELETE_BATCH: self.delete_batch,
            Op.INVENTORY: self.inventory,
            Op.VERIFY_BATCH: self.verify_batch,
            Op.LEASE: reads.lease,
            Op.RELEASE: reads.release,
            Op.PUT_STAGED: self.put_staged,
            Op.CHANNEL_GET: reads.channel_get,
            Op.STAT: self.stat,
            Op.PING: self.ping,
            Op.TOUCH: reads.touch,
            Op.PIN: self.pin,
            Op.UNPIN: self.unpin,
            Op.PINS: self.pins,
            Op.EVENTS: self.events,
        }
        self.table: dict[int, Handler] = {op: _beside(answer) for op, answer in answering.items()}
        self.table[Op.PUT_BATCH] = self.put_batch

    def use_channel(self, channel: ChannelServing) -> None:
        """Answer CHANNEL_GET with ``channel`` (``nccl_channel.channel.ChannelServer``)."""
        self.reads.channel = channel

    @staticmethod
    def carries_data(op: int) -> bool:
        """Whether a frame of ``op`` may have a data section (any other op's is a protocol error)."""
        return op in CARRY_DATA

    async def handle(self, request: Request, peer: Peer) -> None:
        """Run ``request``'s handler: in stream order, its answer handed to ``peer``."""
        handler = self.table.get(request.op)
        if handler is None:
            await peer.answer(request, _refusal(ProtocolError(f"op {request.op} is not a request")))
            return
        refused = refused_op(peer.tenant, request.op, self.ctx.counters)  # tenancy.py
        if refused is not None:
            await peer.answer(request, _refusal(refused))
            return
        await handler(request, peer)

    def _scope(self, peer: Peer, keys: Sequence[str]) -> None:
        """AuthError unless every key is of the tenant whose token ``peer`` proved (any, for the pool token)."""
        check_keys(peer.tenant, keys, self.ctx.counters)

    async def put_batch(self, request: Request, peer: Peer) -> None:
        """PUT_BATCH: its bytes received here, in stream order; verification, commit and reply in its answer."""
        config, puts = self.ctx.config, self.puts
        items, options = PutBatch.decode_request(request.meta, request.data_len, config.limits)
        try:
            self._scope(peer, [item.key for item in items])
            puts.refuse_oversized(items)
        except (CapacityError, AuthError) as exc:
            # Answered at once, before any room is taken; its bytes are read past, so the
            # connection stays in step.
            await peer.answer(request, _refusal(exc))
            async with asyncio.timeout(config.frame_timeout_s):
                await peer.recv_data([request.data_len])
            return
        async with asyncio.timeout(config.frame_timeout_s):
            received = await puts.receive(peer, items, options)
        await peer.answer(request, lambda: puts.commit(received, options))

    async def delete_batch(self, meta: bytearray, peer: Peer) -> Reply:
        ctx = self.ctx
        keys = DeleteBatch.decode_request(meta, ctx.config.limits)
        self._scope(peer, keys)
        deleted = await ctx.tiers.delete_keys(keys)
        # Their index entries go with the next flush, now if Redis answers in time: the client's answer never
        # waits out a paused Redis (an entry that outlives its bytes reads as a miss meanwhile).
        await self.publisher.flush_index_within(ANSWER_FLUSH_S)
        ctx.counters[NodeCounter.DELETES] += len(deleted)
        gone = set(deleted)
        return DeleteBatch.encode_answer([int(key in gone) for key in keys]), []

    async def inventory(self, meta: bytearray, peer: Peer) -> Reply:
        """One page of what this node holds after the request's ``after`` key, in key order."""
        after, limit = Inventory.decode_request(meta)
        held, more = self.ctx.tiers.page(after, limit)
        rows = tuple(InventoryRow(item.key, tier, item.nbytes, item.checksum) for item, tier in held)
        return Inventory.encode_answer(InventoryPage(rows, more)), []

    async def verify_batch(self, meta: bytearray, peer: Peer) -> Reply:
        tiers, keys = self.ctx.tiers, VerifyBatch.decode_request(meta, self.ctx.config.limits)
        self._scope(peer, keys)
        flags = [Verified[(await tiers.verify(k)).upper()] for k in keys]
        if any(flags):  # a dropped corrupt copy leaves the index now (if Redis answers in time), not at the beat
            await self.publisher.flush_index_within(ANSWER_FLUSH_S)
        return VerifyBatch.encode_answer(flags), []

    async def pin(self, meta: bytearray, peer: Peer) -> Reply:
        """PIN: hold keys past any connection (``pins.py``); all or nothing, answered once saved."""
        request = Pin.decode_request(meta, self.ctx.config.limits)
        self._scope(peer, request.keys)
        held, ttl_s = await self.ctx.pins.pin(request)
        return Pin.encode_answer(held, ttl_s), []

    async def unpin(self, meta: bytearray, peer: Peer) -> Reply:
        owner, keys = Unpin.decode_request(meta, self.ctx.config.limits)
        self._scope(peer, keys)
        return Unpin.encode_answer(await self.ctx.pins.unpin(owner, keys)), []

    async def pins(self, meta: bytearray, peer: Peer) -> Reply:
        return Pins.encode_answer(self.ctx.pins.page(*Pins.decode_request(meta))), []

    async def events(self, meta: bytearray, peer: Peer) -> Reply:
        """EVENTS: the ring's entries from a cursor (``events.py``), for a `kvpool events` endpoint."""
        ring = self.ctx.events
        if ring is None:
            raise ProtocolError(
                f"node {self.ctx.node_id} keeps no event ring: start it with --event-ring-keys N (docs/fleet-events.md)"
            )
        since, max_keys, tokens = Events.decode_request(meta)
        page = ring.since(since, max_keys, MAX_EVENTS_TOKEN_BYTES if tokens else 0)
        entries = tuple(EventsEntry(e.seq, int(e.kind), e.keys, e.records if tokens else None) for e in page.entries)
        return Events.encode_answer(EventsPage(entries, page.next_seq, page.gap)), []

    async def put_staged(self, meta: bytearray, peer: Peer) -> Reply:
        puts = self.puts
        received, options = await puts.receive_staged(meta, peer)
        return await puts.commit(received, options)

    async def stat(self, meta: bytearray, peer: Peer) -> Reply:
        return Stat.encode_answer(self.stats.report()), []

    async def ping(self, meta: bytearray, peer: Peer) -> Reply:
        return Ping.encode_answer(self.ctx.node_id, self.ctx.epoch), []


def _beside(answer: Answering) -> Handler:
    """The handler of an op with no data section: its whole work is its answer, beside the next requests."""

    async def handle(request: Request, peer: Peer) -> None:
        await peer.answer(request, lambda: answer(request.meta, peer))

    return handle


def _refusal(exc: KVPoolError) -> Answer:
    """An answer that is ``exc`` (answered as an error frame)."""

    async def refuse() -> Reply:
        raise exc

    return refuse
