"""What the node answers to each request op: one handler per op, in one table.

Every op's handler is in :attr:`OpTable.table`, looked up by op code. It gets the
request (``peer.py``: header, meta section) and the :class:`~backend.node.serve.peer.Peer`
it came on, runs in stream order, and hands its answer to ``peer.answer``. Most ops
carry no data: their whole work is the answer (``_beside``). PUT_BATCH receives its
bytes in its handler, since they must leave the socket in order; verification,
commit and reply overlap with the next request (``puts.py``). HELLO and AUTH are not
here: the session answers them itself (they decide whether the connection may ask
anything else).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from backend.counters import NodeCounter
from backend.errors import AuthError, CapacityError, KVPoolError, ProtocolError
from backend.node.context import NodeContext
from backend.node.index.publisher import ANSWER_FLUSH_S, IndexPublisher
from backend.node.serve.peer import Answer, Peer, Reply, Request
from backend.node.serve.puts import PutReceiver
from backend.node.serve.tenancy import check_keys, refuse_mapped_read, refused_op
from backend.node.stats import NodeStats
from backend.node.store.bookkeeping import NO_SLOT
from backend.node.store.dram import StoredChunk
from backend.node.store.leases import MAX_LEASE_TTL_MS
from backend.protocol import ItemMeta, Op
from backend.protocol.channel import ChannelGet
from backend.protocol.events import MAX_EVENTS_TOKEN_BYTES, Events, EventsEntry, EventsPage
from backend.protocol.inventory import Inventory, InventoryPage, InventoryRow, Verified, VerifyBatch
from backend.protocol.meta import ANY_FINGERPRINT, NO_FINGERPRINT, OtherLayout
from backend.protocol.pins import Pin, Pins, Unpin
from backend.protocol.puts import PutBatch
from backend.protocol.reads import LEASE_MAP, NO_OFFSET, DeleteBatch, ExistsBatch, GetBatch, Lease, Release, Touch
from backend.protocol.reports import Ping, Stat
from backend.transport import Buffer

__all__ = ["OpTable"]

Handler = Callable[[Request, Peer], Awaitable[None]]  # runs in stream order; answers through the peer
Answering = Callable[[bytearray, Peer], Awaitable[Reply]]  # an op with no data: its answer from its meta

CARRY_DATA = frozenset({Op.PUT_BATCH})  # the ops whose frames have a data section


class ChannelServing(Protocol):
    """What the ops and the node ask of the channel server (nccl_channel.node.ChannelServer)."""

    counters: Counter[NodeCounter]

    @property
    def kind(self) -> str: ...

    async def start_join(self, session: str, digest: str) -> None: ...

    async def join(self, session: str) -> None: ...

    async def send(self, session: str, buffers: Sequence[Buffer]) -> None: ...

    async def close(self) -> None: ...


class OpTable:
    """The node's operations: op code -> handler."""

    def __init__(self, ctx: NodeContext, stats: NodeStats, publisher: IndexPublisher, puts: PutReceiver) -> None:
        self.ctx = ctx
        self.stats = stats
        self.publisher = publisher
        self.puts = puts
        self.channel: ChannelServing | None = None  # once the node serves one (use_channel)
        answering: dict[int, Answering] = {
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
            Op.TOUCH: self.touch,
            Op.PIN: self.pin,
            Op.UNPIN: self.unpin,
            Op.PINS: self.pins,
            Op.EVENTS: self.events,
        }
        self.table: dict[int, Handler] = {op: _beside(answer) for op, answer in answering.items()}
        self.table[Op.PUT_BATCH] = self.put_batch

    def use_channel(self, channel: ChannelServing) -> None:
        """Answer CHANNEL_GET with ``channel`` (``nccl_channel.channel.ChannelServer``)."""
        self.channel = channel

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

    def _other_layout(self, key: str, stored: int | None, fingerprint: int | None) -> OtherLayout | None:
        """OtherLayout (counted) if this node holds ``key`` stored with another layout fingerprint (``stored``;
        None: not held) than the reader's (``fingerprint``; None: an older client's read, which names none),
        else None."""
        if stored is None or fingerprint == ANY_FINGERPRINT:
            return None
        if stored == (NO_FINGERPRINT if fingerprint is None else fingerprint):
            return None
        self.ctx.counters[NodeCounter.LAYOUT_MISSES] += 1
        return OtherLayout(key)

    async def _read(self, key: str, fingerprint: int | None) -> StoredChunk | OtherLayout | None:
        """``key``'s chunk for a reader of ``fingerprint`` (an NVMe hit is promoted), OtherLayout when it is stored
        with another one (looked at before the fetch, so such a chunk is not promoted, and after), or None."""
        tiers = self.ctx.tiers
        if fingerprint != ANY_FINGERPRINT:  # the stored fingerprint from its table row, no ItemMeta built
            slot = tiers.table.slot(key)
            other = self._other_layout(key, None if slot == NO_SLOT else tiers.table.fingerprint(slot), fingerprint)
            if other is not None:
                return other
        chunk = await tiers.get(key)
        if chunk is None:
            return None
        return self._other_layout(key, chunk.meta.fingerprint, fingerprint) or chunk

    async def _fetch(
        self, keys: list[str], fingerprint: int | None, *, channel: bool
    ) -> tuple[list[ItemMeta | OtherLayout | None], list[Buffer]]:
        """Each key's chunk (an NVMe hit is promoted), within one reply's data limit; keys past it are misses.

        A reply never exceeds what a client accepts (``limits.max_data_bytes``); the
        client reads the keys answered as misses again (over TCP, or in its next GET).
        A chunk stored with another layout fingerprint than the reader's is OtherLayout, and
        its bytes are never read (docs/protocol.md, "Layout fingerprints"). Counted as the
        channel's gets, hits and misses with ``channel``.
        """
        tiers, counters = self.ctx.tiers, self.ctx.counters
        found: list[ItemMeta | OtherLayout | None] = []
        data: list[Buffer] = []
        budget = self.ctx.config.limits.max_data_bytes
        for key in keys:
            counters[NodeCounter.CHANNEL_GETS if channel else NodeCounter.GETS] += 1
            chunk = await self._read(key, fingerprint)
            if isinstance(chunk, OtherLayout):
                tiers.quotas.count_read(key, hit=False)
                counters[NodeCounter.CHANNEL_MISSES if channel else NodeCounter.MISSES] += 1
                found.append(chunk)
                continue
            if chunk is not None and chunk.meta.nbytes > budget:
                counters[NodeCounter.GET_OVER_FRAME_LIMIT] += 1
                chunk = None
            tiers.quotas.count_read(key, hit=chunk is not None)
            if chunk is None:
                counters[NodeCounter.CHANNEL_MISSES if channel else NodeCounter.MISSES] += 1
                found.append(None)
            else:
                counters[NodeCounter.CHANNEL_HITS if channel else NodeCounter.HITS] += 1
                found.append(chunk.meta)
                data.append(chunk.buffer)
                budget -= chunk.meta.nbytes
        tiers.held.touch_chain(keys)  # read as one chain, in prefix order (the eviction order links and touches it)
        return found, data

    async def get_batch(self, meta: bytearray, peer: Peer) -> Reply:
        limits = self.ctx.config.limits
        keys, fingerprint = GetBatch.decode_request(meta, limits)
        self._scope(peer, keys)
        found, data = await self._fetch(keys, fingerprint, channel=False)
        self.ctx.counters[NodeCounter.GET_BYTES] += sum(item.nbytes for item in found if isinstance(item, ItemMeta))
        return GetBatch.encode_answer(found, limits, fingerprints=fingerprint is not None), data

    async def exists_batch(self, meta: bytearray, peer: Peer) -> Reply:
        tiers, keys = self.ctx.tiers, ExistsBatch.decode_request(meta, self.ctx.config.limits)
        self._scope(peer, keys)
        return ExistsBatch.encode_answer([int(tiers.contains(key)) for key in keys]), []

    async def delete_batch(self, meta: bytearray, peer: Peer) -> Reply:
        ctx = self.ctx
        keys = DeleteBatch.decode_request(meta, ctx.config.limits)
        self._scope(peer, keys)
        deleted = [key for key in keys if await ctx.tiers.delete(key)]
        # Their index entries go with the next flush, now if Redis answers in time: the client's answer never
        # waits out a paused Redis (an entry that outlives its bytes reads as a miss meanwhile).
        ctx.tiers.changes.put_back(set(deleted), {})
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

    async def lease(self, meta: bytearray, peer: Peer) -> Reply:
        """Pin the keys this node holds for the peer (its connection); with LEASE_MAP, also answer their arena offsets.

        A mapped read is a GET whose bytes the client copies itself: the chunk is
        fetched (an NVMe hit is promoted into the arena) and the lease holds the
        chunk object, so its region outlives a concurrent delete or eviction.
        Without LEASE_MAP this is a lock only: nothing moves, so it never waits.
        """
        ctx, tiers, counters = self.ctx, self.ctx.tiers, self.ctx.counters
        ttl_ms, lease_flags, keys, fingerprint = Lease.decode_request(meta, ctx.config.limits)
        if ttl_ms > MAX_LEASE_TTL_MS:
            raise ProtocolError(f"lease ttl_ms {ttl_ms} exceeds {MAX_LEASE_TTL_MS}")
        want_map = bool(lease_flags & LEASE_MAP)
        self._scope(peer, keys)
        if want_map:
            refuse_mapped_read(peer.tenant, counters)
        found: list[tuple[ItemMeta, int] | OtherLayout | None] = []
        held: list[str] = []
        chunks: list[StoredChunk] = []
        arena = tiers.shm_arena  # a private arena's offsets mean nothing to a client
        for key in keys:
            if want_map:  # a read: only of a chunk of the reader's layout (a lock pins whatever is held)
                counters[NodeCounter.GETS] += 1
                chunk = await self._read(key, fingerprint)
                tiers.quotas.count_read(key, hit=chunk is not None and not isinstance(chunk, OtherLayout))
                if chunk is None or isinstance(chunk, OtherLayout):
                    counters[NodeCounter.MISSES] += 1
                    found.append(chunk)
                    continue
                offset = arena.offset_of(chunk.buffer) if arena is not None else None
                counters[NodeCounter.HITS] += 1
                if offset is not None:
                    counters[NodeCounter.SHM_GET_BYTES] += chunk.meta.nbytes
                found.append((chunk.meta, NO_OFFSET if offset is None else offset))
                chunks.append(chunk)
            else:
                item = tiers.meta_of(key)
                found.append(None if item is None else (item, NO_OFFSET))
                if item is None:
                    continue
            held.append(key)
        tiers.held.touch_chain(held)  # a lease is taken to read: the chain was used
        lease_id = tiers.leases.grant(held, chunks, ttl_ms, owner=peer) if held else 0
        if lease_id and peer.closed:
            tiers.leases.release_owner(peer)  # it closed while we fetched: its teardown has already run
        return Lease.encode_answer(lease_id, found, ctx.config.limits, fingerprints=fingerprint is not None), []

    async def release(self, meta: bytearray, peer: Peer) -> Reply:
        lease_id, keys = Release.decode_request(meta, self.ctx.config.limits)
        if peer.tenant is not None and self.ctx.tiers.leases.owner_of(lease_id) is not peer:
            return Release.encode_answer(0), []  # a tenant ends only its own leases (ids are guessable)
        return Release.encode_answer(self.ctx.tiers.leases.release(lease_id, keys)), []

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
                f"node {self.ctx.node_id} keeps no event ring: start it with --event-ring-keys N (docs/fleet.md)"
            )
        since, max_keys, tokens = Events.decode_request(meta)
        page = ring.since(since, max_keys, MAX_EVENTS_TOKEN_BYTES if tokens else 0)
        entries = tuple(EventsEntry(e.seq, int(e.kind), e.keys, e.records if tokens else None) for e in page.entries)
        return Events.encode_answer(EventsPage(entries, page.next_seq, page.gap)), []

    async def put_staged(self, meta: bytearray, peer: Peer) -> Reply:
        puts = self.puts
        received, options = await puts.receive_staged(meta, peer)
        return await puts.commit(received, options)

    async def channel_get(self, meta: bytearray, peer: Peer) -> Reply:
        """CHANNEL_GET: join the pair if new, answer which keys are held, send their bytes over the pair."""
        ctx, channel = self.ctx, self.channel
        if channel is None:
            raise ProtocolError(f"node {ctx.node_id} serves no channel (start it with --channel)")
        request = ChannelGet.decode_request(meta, ctx.config.limits)
        pair, keys = request.pair_id, request.keys
        if not keys:
            # Pairing: answered once the offer is taken; the join runs on with its own deadline,
            # so a slow NCCL init never holds this request (and the client's connection) open.
            await channel.start_join(pair, request.offer)
            return ChannelGet.encode_answer([], ctx.config.limits), []
        await channel.join(pair)  # NcclError: answered as an error; the client falls back to TCP
        # Keys past the limit, and of another layout, are answered null: the client reads them over TCP.
        found, buffers = await self._fetch(keys, request.fingerprint, channel=True)
        if buffers:
            # The client receives after reading the answer; the pair's lock keeps batches in order.
            ctx.spawn(channel.send(pair, buffers))
        rows = [item if isinstance(item, ItemMeta) else None for item in found]
        return ChannelGet.encode_answer(rows, ctx.config.limits, fingerprints=request.fingerprint is not None), []

    async def touch(self, meta: bytearray, peer: Peer) -> Reply:
        """TOUCH: chains a client's lookups found, each touched as one batch (the eviction order's
        ``touch_chain``); keys not held are skipped."""
        ctx = self.ctx
        chains = Touch.decode_request(meta, ctx.config.limits)
        for chain in chains:
            self._scope(peer, chain)
        for chain in chains:
            ctx.tiers.held.touch_chain(chain)
            ctx.counters[NodeCounter.TOUCHED_KEYS] += len(chain)
        return Touch.encode_answer([]), []

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
