"""A put on the node: bytes into reserved DRAM, verified, then the index commit, then the ack.

Crash ordering: receive every byte into space reserved in the tier -> verify each
chunk's checksum -> insert into the tier -> commit the index entries to Redis in one
pipeline (side by side with the removals of what the batch evicted: one round trip) ->
ack. A key becomes visible only at the commit, after its bytes are complete; a put that fails anywhere before the commit leaves nothing behind. If the
commit itself fails the chunks are dropped again and the client is told, so nothing
is acknowledged that readers cannot find.

The commit waits for Redis at most half the put's ``wait_ms`` (:func:`commit_wait_s`):
the client waits twice ``wait_ms`` (its ``progress_timeout_s``) for the answer, so a paused or
slow Redis costs the put an answer in time (``METADATA``, "Redis slow"), never the
node its place among the client's live nodes.

Bytes come off the socket (PUT_BATCH) or out of the client's shared-memory stage
(PUT_STAGED); both go through :meth:`PutReceiver.take_chunks`, which reserves room as
the bytes arrive, never far ahead of them (``intake.py``). A request that declares more
than this node can ever hold is refused before anything is reserved
(:meth:`PutReceiver.refuse_oversized`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

from backend.config.values import ms_to_s
from backend.counters import NodeCounter
from backend.errors import CapacityError, MetadataError, ProtocolError
from backend.metadata import Location
from backend.node.context import NodeContext
from backend.node.index.publisher import IndexPublisher
from backend.node.memory.buffers import ChunkBuffer
from backend.node.serve.peer import Peer
from backend.node.store.intake import STAGED_WINDOW_BYTES, AheadBounds, ChunkSource, Received, RoomAhead
from backend.node.store.tiers import DRAM
from backend.protocol import ItemMeta, checksum
from backend.protocol.puts import PUT_BUSY, PUT_INTEGRITY, PUT_NO_ROOM, PUT_STORED, PutBatch, PutOptions, PutStaged
from backend.shm import HEADER_BYTES, ArenaView
from backend.threads import map_in_threads
from backend.transport import BULK_BYTES, Buffer

__all__ = ["PutReceiver", "Received", "commit_wait_s"]

BULK_COPY_THREADS = 2  # threads one staged put copies on (two cores' worth)
COMMIT_WAIT_SHARE = 0.5  # of a put's wait_ms, how long its index commit may wait for Redis
MIN_COMMIT_WAIT_S = 0.05  # even a put that asks for no wait gets this long for its commit


def commit_wait_s(options: PutOptions) -> float:
    """How long a put's index commit may wait for Redis (and never longer than Redis's own timeout).

    A client waits ``progress_timeout_s`` = 2 x ``wait_ms`` for a node's answer (docs/protocol.md), and
    the node may hold the put ``wait_ms`` for room: half of ``wait_ms`` for the commit leaves a
    quarter of the client's timeout for the bytes and the reply.
    """
    return max(ms_to_s(options.wait_ms) * COMMIT_WAIT_SHARE, MIN_COMMIT_WAIT_S)


class PutReceiver:
    """Receives puts into the node's tiers and commits them to the index."""

    def __init__(self, ctx: NodeContext, publisher: IndexPublisher) -> None:
        self.ctx = ctx
        self.publisher = publisher
        self.ahead = RoomAhead(AheadBounds.for_dram(ctx.tiers.dram_capacity_bytes), on_freed=ctx.tiers.wake_waiters)
        self._own_ids = itertools.count(1)  # for requests that name no put: negative, unlike a client's

    def refuse_oversized(self, items: Sequence[ItemMeta]) -> None:
        """CapacityError, naming the sizes, for a request this node can never hold: a chunk larger
        than its DRAM tier, or chunks larger in all than every tier together. Nothing is reserved."""
        tiers = self.ctx.tiers
        dram_bytes = tiers.dram_capacity_bytes
        for item in items:
            if item.nbytes > dram_bytes:
                raise CapacityError(
                    f"chunk {item.key[:80]!r} is {item.nbytes} bytes, larger than node {self.ctx.node_id}'s DRAM "
                    f"tier ({dram_bytes} bytes): it can never be stored there"
                )
        total = sum(item.nbytes for item in items)
        if total > tiers.capacity_bytes:
            raise CapacityError(
                f"a put of {len(items)} chunks, {total} bytes in all, is larger than node {self.ctx.node_id} can "
                f"ever hold ({tiers.capacity_bytes} bytes, {dram_bytes} of them DRAM)"
            )

    async def receive(self, peer: Peer, items: list[ItemMeta], options: PutOptions) -> Received:
        """Receive a PUT_BATCH's chunks off its connection (see :meth:`take_chunks`)."""
        source = _FromSocket(peer, self.ahead.bounds.connection_bytes)
        return await self.take_chunks(items, source, options)

    async def receive_staged(self, meta: bytearray, peer: Peer) -> tuple[Received, PutOptions]:
        """Copy a PUT_STAGED's chunks out of the client's stage (see :meth:`take_chunks`); with its options."""
        name, token, items, offsets, options = PutStaged.decode_request(meta, self.ctx.config.limits)
        self.refuse_oversized(items)  # (take_chunks checks again: before the stage is even mapped)
        stage = peer.stage(name, token)
        for item, offset in zip(items, offsets):  # before anything is reserved for them
            if offset < HEADER_BYTES or offset + item.nbytes > stage.size_bytes:
                raise ProtocolError(
                    f"PUT_STAGED offset of {item.key!r}: {offset}+{item.nbytes} is outside the stage "
                    f"({stage.size_bytes} bytes)"
                )
        self.ctx.counters[NodeCounter.STAGED_PUT_BYTES] += sum(item.nbytes for item in items)
        return await self.take_chunks(items, _FromStage(self.ctx, stage, items, offsets), options), options

    async def take_chunks(self, items: list[ItemMeta], source: ChunkSource, options: PutOptions) -> Received:
        """Bring each chunk into reserved DRAM and verify it; returns a PUT outcome per item.

        Room is reserved as the bytes arrive (``intake.py``): a window of chunks at a time,
        then ``source`` brings the window's bytes (from the socket in one transfer, or from
        a stage; on worker threads, checksums included); a chunk larger than a window comes
        in parts. A verified chunk enters the tiers at once (so a batch larger than DRAM can
        demote its own first chunks to NVMe), but is not visible to readers before the index
        commit. A chunk this node already holds with the same bytes is not stored twice (and
        so cannot be lost if this put fails). Every chunk is marked with the put's id
        (``options.put_id``, shared by the stripes of one client put), so no stripe of the
        put evicts another's chunks. An item with no room is dropped (``source`` reads its
        bytes past): at once when nothing could make room (``PUT_NO_ROOM``), else once
        DRAM stayed full of other puts in flight until ``options.wait_ms`` after the request
        came (``PUT_BUSY``). A request larger than this node can ever hold raises
        CapacityError before anything is reserved (:meth:`refuse_oversized`).
        """
        self.refuse_oversized(items)
        put_id = options.put_id or -next(self._own_ids)
        # A frame's bytes get frame_timeout_s (OpTable.put_batch): the wait leaves half of it for them.
        wait_s = min(ms_to_s(options.wait_ms), self.ctx.config.frame_timeout_s / 2)
        until = asyncio.get_running_loop().time() + wait_s
        # A frame that never completes (peer gone, stalled) leaves nothing behind.
        return await self.ctx.tiers.take(items, self.ahead, source, put_id=put_id, until=until)

    async def _flush_evictions(self, timeout_s: float) -> None:
        # Within the commit's wait too: an answer late for the flush's sake marks the node down.
        await self.publisher.flush_index_within(timeout_s)

    async def commit(self, received: Received, options: PutOptions = PutOptions()) -> tuple[bytes, list[Buffer]]:
        """Make the stored chunks visible in the index (waiting for Redis at most :func:`commit_wait_s`),
        then answer each item's outcome."""
        ctx, tiers, counters = self.ctx, self.ctx.tiers, self.ctx.counters
        flags: list[int] = []
        visible: list[tuple[str, Location]] = []
        for flag, item, _ in received:
            if flag == PUT_STORED and not tiers.holds(item.key, item.checksum, item.fingerprint):
                # Evicted while its request waited for room (DRAM full of puts in flight): never
                # acknowledge it. Busy, not no room: the pressure passes, a later put is stored.
                flag = PUT_BUSY
            if flag == PUT_STORED:
                visible.append((item.key, ctx.location(item, tiers.tier_of(item.key) or DRAM)))
            flags.append(flag)
        counters[NodeCounter.PUT_REFUSED_NO_ROOM] += flags.count(PUT_NO_ROOM)
        counters[NodeCounter.PUT_REFUSED_BUSY] += flags.count(PUT_BUSY)
        counters[NodeCounter.INTEGRITY_FAILURES] += flags.count(PUT_INTEGRITY)
        try:
            # The commit and what the batch evicted go to Redis side by side: one round trip before
            # the ack, not two. They touch different keys (an evicted key is not held, a committed one
            # is). The evictions are kept for the heartbeat if their flush fails.
            wait_s = commit_wait_s(options)
            committed, flushed = await asyncio.gather(
                ctx.index.commit(visible, wait_s), self._flush_evictions(wait_s), return_exceptions=True
            )
            for outcome in (committed, flushed):  # the flush answers only errors other than Redis's
                if isinstance(outcome, BaseException):
                    raise outcome
        except MetadataError as exc:
            # Not visible, so not kept: a put is acknowledged only once readers can find it.
            await tiers.drop_uncommitted([c for _, _, c in received if c is not None])
            self.publisher.refused(exc)  # a full Redis is logged by the first put it refuses
            raise
        finally:
            tiers.settle([c for _, _, c in received if c is not None])  # committed or dropped: they may move now
        if visible:
            if ctx.events is not None:
                records = options.tokens  # the chunks' token records, from a client that sent them
                keys = [key for key, _ in visible]
                ctx.events.stored(keys, [records.get(key) for key in keys] if records else None)  # committed
            self.publisher.took_writes()  # a commit that needed memory landed: Redis is not full (any more)
        counters[NodeCounter.PUTS] += len(visible)
        # The batch's chain, in prefix order, was used; what it stored counts for its tenants.
        tiers.committed([item.key for _, item, _ in received], [key for key, _ in visible])
        counters[NodeCounter.PUT_BYTES] += sum(loc.nbytes for _, loc in visible)
        return PutBatch.encode_answer(flags), []  # PUT_STAGED is answered as PUT_BATCH


class _FromSocket:
    """A PUT_BATCH's chunk bytes, off its connection: room ahead of them counted for the client's host."""

    def __init__(self, peer: Peer, window_bytes: int) -> None:
        self.peer = peer
        self.host = peer.host
        self.window_bytes = window_bytes

    async def fill(self, window: list[tuple[ItemMeta, ChunkBuffer]]) -> list[int]:
        return await self.peer.recv_data([buffer for _, buffer in window], checksum)

    async def fill_part(self, item: ItemMeta, start: int, view: memoryview, running: Any) -> None:
        def hashed(part: memoryview) -> int:
            running.update(part)  # on the worker thread that received it, as fill's checksums are
            return 0

        await self.peer.recv_data([view], hashed)

    async def drop(self, nbytes: int) -> None:
        await self.peer.recv_data([nbytes])  # a large drop is read on a worker thread, not the loop


class _FromStage:
    """A PUT_STAGED's chunk bytes, copied out of the client's stage: all there already, nothing held ahead."""

    host = ""
    window_bytes = STAGED_WINDOW_BYTES

    def __init__(self, ctx: NodeContext, stage: ArenaView, items: list[ItemMeta], offsets: list[int]) -> None:
        self.ctx = ctx
        self.stage = stage
        self.offset_of = {id(item): offset for item, offset in zip(items, offsets)}

    def _copy(self, job: tuple[ItemMeta, ChunkBuffer]) -> int:
        item, buffer = job
        try:
            return self.stage.copy_checked(buffer, self.offset_of[id(item)])
        except ValueError as exc:
            raise ProtocolError(f"PUT_STAGED offset of {item.key!r}: {exc}") from None

    async def fill(self, window: list[tuple[ItemMeta, ChunkBuffer]]) -> list[int]:
        if sum(item.nbytes for item, _ in window) < BULK_BYTES:
            return [self._copy(job) for job in window]
        return await map_in_threads(self.ctx.bulk, BULK_COPY_THREADS, self._copy, window)

    async def fill_part(self, item: ItemMeta, start: int, view: memoryview, running: Any) -> None:
        self.stage.copy_into(view, self.offset_of[id(item)] + start)
        running.update(view)

    async def drop(self, nbytes: int) -> None:
        pass  # nothing to read off a socket
