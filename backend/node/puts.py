"""A put on the node: bytes into reserved DRAM, verified, then the index commit, then the ack.

Crash ordering: receive every byte into space reserved in the tier -> verify each
chunk's checksum -> insert into the tier -> commit the index entries to Redis in one
pipeline (side by side with the removals of what the batch evicted: one round trip) ->
ack. A key becomes visible only at the commit, after its bytes are complete; a put that fails anywhere before the commit leaves nothing behind. If the
commit itself fails the chunks are dropped again and the client is told, so nothing
is acknowledged that readers cannot find.

The commit waits for Redis at most half the put's ``wait_ms`` (:func:`commit_wait_s`):
the client waits twice ``wait_ms`` (its ``timeout_ms``) for the answer, so a paused or
slow Redis costs the put an answer in time (``METADATA``, "Redis slow"), never the
node its place among the client's live nodes.

Bytes come off the socket (PUT_BATCH) or out of the client's shared-memory stage
(PUT_STAGED); both go through :meth:`PutReceiver.take_chunks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from backend.errors import BusyError, CapacityError, MetadataError, ProtocolError
from backend.metadata import Location
from backend.node.buffers import ChunkBuffer
from backend.node.context import NodeContext
from backend.node.dram import StoredChunk
from backend.node.publisher import IndexPublisher
from backend.node.tiers import DRAM
from backend.protocol import (
    PUT_BUSY,
    PUT_INTEGRITY,
    PUT_NO_CAPACITY,
    PUT_STORED,
    ItemMeta,
    PutOptions,
    checksum,
    decode_put_staged,
    encode_flags,
)
from backend.threads import map_in_threads
from backend.transport import BULK_BYTES, Buffer, FrameSocket

if TYPE_CHECKING:
    from backend.node.session import Session

__all__ = ["PutReceiver", "Received", "commit_wait_s"]

BULK_COPY_THREADS = 2  # threads one staged put copies on (two cores' worth)
PUT_WINDOW_BYTES = 64 * 1024 * 1024  # a put's chunks are received this many bytes at a time
COMMIT_WAIT_SHARE = 0.5  # of a put's wait_ms, how long its index commit may wait for Redis
MIN_COMMIT_WAIT_S = 0.05  # even a put that asks for no wait gets this long for its commit

Received = list[tuple[int, ItemMeta, StoredChunk | None]]  # per item: PUT outcome, item, chunk inserted


def commit_wait_s(options: PutOptions) -> float:
    """How long a put's index commit may wait for Redis (and never longer than Redis's own timeout).

    A client waits ``timeout_ms`` = 2 x ``wait_ms`` for a node's answer (docs/protocol.md), and
    the node may hold the put ``wait_ms`` for room: half of ``wait_ms`` for the commit leaves a
    quarter of the client's timeout for the bytes and the reply.
    """
    return max(options.wait_ms * COMMIT_WAIT_SHARE / 1000, MIN_COMMIT_WAIT_S)


class PutReceiver:
    """Receives puts into the node's tiers and commits them to the index."""

    def __init__(self, ctx: NodeContext, publisher: IndexPublisher) -> None:
        self.ctx = ctx
        self.publisher = publisher
        self._own_ids = itertools.count(1)  # for requests that name no put: negative, unlike a client's

    async def receive(self, conn: FrameSocket, items: list[ItemMeta], options: PutOptions) -> Received:
        """Receive a PUT_BATCH's chunks off the socket (see :meth:`take_chunks`)."""

        async def fill(window: list[tuple[ItemMeta, ChunkBuffer]]) -> list[int]:
            return await conn.recv_many([buffer for _, buffer in window], checksum)

        return await self.take_chunks(items, fill, conn.discard, options)

    async def receive_staged(self, meta: bytearray, session: Session) -> tuple[Received, PutOptions]:
        """Copy a PUT_STAGED's chunks out of the client's stage (see :meth:`take_chunks`); with its options."""
        name, token, items, offsets, options = decode_put_staged(meta, self.ctx.config.limits)
        stage = session.stage(name, token)
        offset_of = {id(item): offset for item, offset in zip(items, offsets)}

        def copy(job: tuple[ItemMeta, ChunkBuffer]) -> int:
            item, buffer = job
            try:
                return stage.copy_checked(buffer, offset_of[id(item)])
            except ValueError as exc:
                raise ProtocolError(f"PUT_STAGED offset of {item.key!r}: {exc}") from None

        async def fill(window: list[tuple[ItemMeta, ChunkBuffer]]) -> list[int]:
            if sum(item.nbytes for item, _ in window) < BULK_BYTES:
                return [copy(job) for job in window]
            return await map_in_threads(self.ctx.bulk, BULK_COPY_THREADS, copy, window)

        async def drop(nbytes: int) -> None:
            pass  # nothing to read off a socket

        self.ctx.counters["staged_put_bytes"] += sum(item.nbytes for item in items)
        return await self.take_chunks(items, fill, drop, options), options

    async def take_chunks(
        self,
        items: list[ItemMeta],
        fill: Callable[[list[tuple[ItemMeta, ChunkBuffer]]], Awaitable[list[int]]],
        drop: Callable[[int], Awaitable[None]],
        options: PutOptions,
    ) -> Received:
        """Bring each chunk into reserved DRAM and verify it; returns a PUT outcome per item.

        Chunks come in windows of up to ``PUT_WINDOW_BYTES``: space for each is reserved
        first, then ``fill`` brings the window's bytes (from the socket in one transfer,
        or from a stage; on worker threads, checksums included) and answers each chunk's
        checksum. A verified chunk enters the tiers at once (so a batch larger than DRAM
        can demote its own first chunks to NVMe), but is not visible to readers before the
        index commit. A chunk this node already holds with the same bytes is not stored
        twice (and so cannot be lost if this put fails). Every chunk is marked with the
        put's id (``options.put_id``, shared by the stripes of one client put), so no stripe
        of the put evicts another's chunks. An item with no room is dropped (``drop``
        reads its bytes off the socket): at once when nothing could make room
        (``PUT_NO_CAPACITY``), else once DRAM stayed full of other puts in flight until
        ``options.wait_ms`` after the request came (``PUT_BUSY``).
        """
        tiers = self.ctx.tiers
        put_id = options.put_id or -next(self._own_ids)
        # The session gives a frame's bytes frame_timeout_s: the wait leaves half of it for them.
        wait_s = min(options.wait_ms / 1000, self.ctx.config.frame_timeout_s / 2)
        until = asyncio.get_running_loop().time() + wait_s
        received: Received = []
        window: list[tuple[ItemMeta, ChunkBuffer]] = []  # reserved, bytes not brought yet

        def let_go() -> None:  # about to wait for room: what this request inserted may move meanwhile
            tiers.settle([chunk for _, _, chunk in received if chunk is not None])

        async def receive_window() -> None:
            try:
                digests = await fill(window)
            except BaseException:
                for item, _ in window:
                    tiers.release(item.nbytes)
                window.clear()
                raise
            for (item, buffer), digest in zip(window, digests):
                if digest != item.checksum:
                    tiers.release(item.nbytes)
                    received.append((PUT_INTEGRITY, item, None))
                elif tiers.holds(item.key, item.checksum):
                    tiers.release(item.nbytes)
                    tiers.claim(item.key, put_id)
                    received.append((PUT_STORED, item, None))
                else:
                    chunk = StoredChunk(item, buffer)
                    tiers.insert(chunk, put_id)
                    received.append((PUT_STORED, item, chunk))
            window.clear()

        async def reserve(item: ItemMeta) -> int:
            """Reserve room for ``item``: PUT_STORED if it has some, else the refusal's flag."""
            try:
                if window:  # holding reservations, it may not wait: another waiter may wait for them
                    try:
                        await tiers.reserve(item.nbytes, put_id=put_id)
                        return PUT_STORED
                    except CapacityError:
                        await receive_window()  # the window's chunks land: they can make room for others
                await tiers.reserve(item.nbytes, until=until, put_id=put_id, before_wait=let_go)
            except BusyError:
                return PUT_BUSY
            except CapacityError:
                return PUT_NO_CAPACITY
            return PUT_STORED

        try:
            for item in items:
                flag = await reserve(item)
                if flag != PUT_STORED:
                    await drop(item.nbytes)
                    received.append((flag, item, None))
                    continue
                window.append((item, tiers.take_buffer(item.nbytes)))
                if sum(i.nbytes for i, _ in window) >= PUT_WINDOW_BYTES:
                    await receive_window()
            if window:
                await receive_window()
        except BaseException:
            # The frame never completed (peer gone, stalled): nothing of it stays.
            await self._discard_uncommitted([c for _, _, c in received if c is not None])
            raise
        return received

    async def _discard_uncommitted(self, chunks: list[StoredChunk]) -> None:
        self.ctx.tiers.settle(chunks)
        for chunk in chunks:
            await self.ctx.tiers.discard(chunk)

    async def _flush_evictions(self, timeout_s: float) -> None:
        # Within the commit's wait too: an answer late for the flush's sake marks the node down.
        with contextlib.suppress(MetadataError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.publisher.flush_index()

    async def commit(self, received: Received, options: PutOptions = PutOptions()) -> tuple[bytes, list[Buffer]]:
        """Make the stored chunks visible in the index (waiting for Redis at most :func:`commit_wait_s`),
        then answer each item's outcome."""
        ctx, tiers, counters = self.ctx, self.ctx.tiers, self.ctx.counters
        flags: list[int] = []
        visible: list[tuple[str, Location]] = []
        for flag, item, _ in received:
            if flag == PUT_STORED and not tiers.holds(item.key, item.checksum):
                # Evicted while its request waited for room (DRAM full of puts in flight): never
                # acknowledge it. Busy, not no room: the pressure passes, a later put is stored.
                flag = PUT_BUSY
            if flag == PUT_STORED:
                visible.append((item.key, ctx.location(item, tiers.tier_of(item.key) or DRAM)))
            flags.append(flag)
        counters["put_rejected_capacity"] += flags.count(PUT_NO_CAPACITY)
        counters["put_rejected_busy"] += flags.count(PUT_BUSY)
        counters["integrity_failures"] += flags.count(PUT_INTEGRITY)
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
            await self._discard_uncommitted([c for _, _, c in received if c is not None])
            self.publisher.refused(exc)  # a full Redis is logged by the first put it refuses
            raise
        finally:
            tiers.settle([c for _, _, c in received if c is not None])  # committed or dropped: they may move now
        counters["puts"] += len(visible)
        counters["put_bytes"] += sum(loc.nbytes for _, loc in visible)
        return encode_flags(flags), []
