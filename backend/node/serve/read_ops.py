"""The node's read ops: GET_BATCH, EXISTS_BATCH, CHANNEL_GET, LEASE, RELEASE, TOUCH.

Each decodes its request, makes one store call (``TierManager.read``, ``contains``,
``touch_chains``, ``Leasing``) and encodes the answer; it counts what the store found as the
node's gets, hits and misses (the channel's own, for CHANNEL_GET). The store owns the read's
rules: the layout check, the tenant's read count and the chain touch (``backend.node.store.reads``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from backend.counters import NodeCounter
from backend.errors import ProtocolError
from backend.node.context import NodeContext
from backend.node.serve.peer import Peer, Reply
from backend.node.serve.tenancy import check_keys, refuse_mapped_read
from backend.node.store.leases import MAX_LEASE_TTL_MS
from backend.protocol import ItemMeta
from backend.protocol.channel import ChannelGet
from backend.protocol.meta import OtherLayout
from backend.protocol.reads import LEASE_MAP, NO_OFFSET, ExistsBatch, GetBatch, Lease, Release, Touch
from backend.transport import Buffer

__all__ = ["ChannelServing", "ReadOps"]


class ChannelServing(Protocol):
    """What the ops and the node ask of the channel server (nccl_channel.node.ChannelServer)."""

    counters: Counter[NodeCounter]

    @property
    def kind(self) -> str: ...

    async def start_join(self, session: str, digest: str) -> None: ...

    async def join(self, session: str) -> None: ...

    async def send(self, session: str, buffers: Sequence[Buffer]) -> None: ...

    async def close(self) -> None: ...


class ReadOps:
    """The handlers of the ops that read what the node holds (``OpTable`` answers them beside the next requests)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.channel: ChannelServing | None = None  # once the node serves one (OpTable.use_channel)

    async def get_batch(self, meta: bytearray, peer: Peer) -> Reply:
        limits = self.ctx.config.limits
        keys, fingerprint = GetBatch.decode_request(meta, limits)
        check_keys(peer.tenant, keys, self.ctx.counters)
        found, data = await self._fetch(keys, fingerprint, channel=False)
        self.ctx.counters[NodeCounter.GET_BYTES] += sum(item.nbytes for item in found if isinstance(item, ItemMeta))
        return GetBatch.encode_answer(found, limits, fingerprints=fingerprint is not None), data

    async def exists_batch(self, meta: bytearray, peer: Peer) -> Reply:
        tiers, keys = self.ctx.tiers, ExistsBatch.decode_request(meta, self.ctx.config.limits)
        check_keys(peer.tenant, keys, self.ctx.counters)
        return ExistsBatch.encode_answer([int(tiers.contains(key)) for key in keys]), []

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

    async def lease(self, meta: bytearray, peer: Peer) -> Reply:
        """Pin the keys this node holds for the peer (its connection); with LEASE_MAP, also read them and answer
        their arena offsets (``Leasing.lease``): a mapped read is a GET whose bytes the client copies itself."""
        ctx, counters = self.ctx, self.ctx.counters
        ttl_ms, lease_flags, keys, fingerprint = Lease.decode_request(meta, ctx.config.limits)
        if ttl_ms > MAX_LEASE_TTL_MS:
            raise ProtocolError(f"lease ttl_ms {ttl_ms} exceeds {MAX_LEASE_TTL_MS}")
        mapped = bool(lease_flags & LEASE_MAP)
        check_keys(peer.tenant, keys, counters)
        if mapped:
            refuse_mapped_read(peer.tenant, counters)
        leased = await ctx.tiers.leasing.lease(keys, fingerprint, ttl_ms, peer, mapped=mapped)
        if leased.lease_id and peer.closed:
            ctx.tiers.leasing.end_all_of(peer)  # it closed while we fetched: its teardown has already run
        if mapped:
            hits = [item for item in leased.found if isinstance(item, tuple)]
            counters[NodeCounter.GETS] += len(keys)
            counters[NodeCounter.HITS] += len(hits)
            counters[NodeCounter.MISSES] += len(keys) - len(hits)
            counters[NodeCounter.LAYOUT_MISSES] += sum(isinstance(item, OtherLayout) for item in leased.found)
            counters[NodeCounter.SHM_GET_BYTES] += sum(item.nbytes for item, offset in hits if offset != NO_OFFSET)
        return Lease.encode_answer(
            leased.lease_id, leased.found, ctx.config.limits, fingerprints=fingerprint is not None
        ), []

    async def release(self, meta: bytearray, peer: Peer) -> Reply:
        lease_id, keys = Release.decode_request(meta, self.ctx.config.limits)
        # A tenant ends only its own leases (ids are guessable).
        released = self.ctx.tiers.leasing.release(lease_id, keys, owner=peer if peer.tenant is not None else None)
        return Release.encode_answer(released), []

    async def touch(self, meta: bytearray, peer: Peer) -> Reply:
        """TOUCH: chains a client's lookups found, each touched as one batch (the eviction order's
        ``touch_chain``); keys not held are skipped."""
        ctx = self.ctx
        chains = Touch.decode_request(meta, ctx.config.limits)
        for chain in chains:
            check_keys(peer.tenant, chain, ctx.counters)
        ctx.tiers.touch_chains(chains)
        ctx.counters[NodeCounter.TOUCHED_KEYS] += sum(len(chain) for chain in chains)
        return Touch.encode_answer([]), []

    async def _fetch(
        self, keys: list[str], fingerprint: int | None, *, channel: bool
    ) -> tuple[list[ItemMeta | OtherLayout | None], list[Buffer]]:
        """Each key's chunk within one reply's data limit (``TierManager.read``), counted as the channel's gets,
        hits and misses with ``channel``.

        A reply never exceeds what a client accepts (``limits.max_data_bytes``); the client reads
        the keys answered as misses again (over TCP, or in its next GET).
        """
        fetched = await self.ctx.tiers.read(keys, fingerprint, self.ctx.config.limits.max_data_bytes)
        counters = self.ctx.counters
        hits = len(fetched.chunks)
        counters[NodeCounter.CHANNEL_GETS if channel else NodeCounter.GETS] += len(keys)
        counters[NodeCounter.CHANNEL_HITS if channel else NodeCounter.HITS] += hits
        counters[NodeCounter.CHANNEL_MISSES if channel else NodeCounter.MISSES] += len(keys) - hits
        counters[NodeCounter.GET_OVER_FRAME_LIMIT] += fetched.over_limit
        counters[NodeCounter.LAYOUT_MISSES] += sum(isinstance(item, OtherLayout) for item in fetched.found)
        return fetched.found, [chunk.buffer for chunk in fetched.chunks]
