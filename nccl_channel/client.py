"""The client end of the channel: pairs with nodes lazily and receives chunks over the pairs.

See ``nccl_channel/channel.py`` for the whole exchange. ``PoolClient`` builds it
(``backend.client.channel.open_channel``) and reads through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from backend.counters import ChannelCounter
from backend.errors import KVPoolError, NcclError
from backend.protocol import ItemMeta
from backend.protocol.channel import ChannelGet
from backend.protocol.meta import ANY_FINGERPRINT
from nccl_channel.link import Link, Transport, transfer_timeout
from nccl_channel.outcome import ChannelResult, Landed, NotBrought, Why
from nccl_channel.pairs import MAX_PAIRS, PAIR_TIMEOUT_S, Pair, PairCache, Peer, Request, Sink, abort_joined, in_thread
from nccl_channel.pipeline import Verifier, receive_batch
from nccl_channel.rendezvous import Offer, Rendezvous, new_pair_id

__all__ = ["NcclChannel", "BACKOFF_S"]

logger = logging.getLogger(__name__)

BACKOFF_S = 30.0  # after a channel failure, the client reads that node over TCP this long

N = TypeVar("N", bound=Peer)  # the node record the caller holds (``backend.metadata.NodeInfo``)
T = TypeVar("T")  # a sink's handle


class NcclChannel(Generic[N]):
    """The client end: pairs with nodes lazily, receives chunks over them.

    ``request(node, meta)`` sends one CHANNEL_GET over the node's TCP protocol and
    returns the response meta (``PoolClient.channel_request``).
    """

    def __init__(
        self,
        transport: Transport,
        rendezvous: Rendezvous,
        endpoint_id: str,
        cluster: str,
        request: Request[N],
        timeout_s: float,
        max_pairs: int = MAX_PAIRS,
        backoff_s: float = BACKOFF_S,
        pair_timeout_s: float = PAIR_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self._verifier = Verifier()
        self.rendezvous = rendezvous
        self.endpoint_id = endpoint_id
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.pair_timeout_s = pair_timeout_s
        self.counters: Counter[ChannelCounter] = Counter()
        self._request = request
        self._pairs = PairCache(max_pairs)
        self._creating: dict[tuple[str, int], asyncio.Lock] = {}
        self._pairing: dict[tuple[str, int], asyncio.Task[None]] = {}  # background pairings under way
        self._clock = clock  # the back-off's time (monotonic s); a test advances its own instead of sleeping
        self._backoff_until: dict[str, float] = {}  # node id -> ``clock`` time the channel may try it again
        self._closed = False

    @property
    def kind(self) -> str:
        return self.transport.kind

    def serves(self, node: N) -> bool:
        """Whether ``node`` is reachable over this channel: same cluster, same transport, not backing off."""
        return (
            bool(self.cluster)
            and node.cluster == self.cluster
            and node.channel == self.kind
            and self._clock() >= self._backoff_until.get(node.node_id, 0.0)
        )

    def engaged(self, node: N) -> bool:
        """Whether to read ``node`` over the channel now: it is served and its pair is ready.

        A served node without a pair starts pairing in the background (bounded by
        ``pair_timeout_s``) and answers False, so reads go over TCP until the pair is
        ready instead of waiting for a cold NCCL init. Call it on the event loop.
        """
        if not self.serves(node):
            return False
        ident = (node.node_id, node.epoch)
        if self._pairs.live(ident) is not None:
            return True
        if ident not in self._pairing and not self._closed:
            task = asyncio.ensure_future(self._pair_in_background(node))
            self._pairing[ident] = task
            task.add_done_callback(lambda _: self._pairing.pop(ident, None))
        return False

    async def _pair_in_background(self, node: N) -> None:
        try:
            await self._pair(node)
        except Exception as exc:  # NcclError, the control path's KVPoolError, or a transport's own bug
            self.counters[ChannelCounter.PAIR_FAILURES] += 1
            self._back_off(node)
            logger.warning("channel: pairing with node %s failed; reading it over TCP: %s", node.node_id, exc)

    def pair_count(self) -> int:
        return len(self._pairs)

    async def _pair(self, node: N) -> Pair:
        ident = (node.node_id, node.epoch)
        pair = self._pairs.live(ident)
        if pair is not None:
            return pair
        async with self._creating.setdefault(ident, asyncio.Lock()):
            pair = self._pairs.live(ident)
            if pair is not None:
                return pair
            link, pair_id = await self._connect(node)
            pair = Pair(pair_id, link)
            self._pairs.add(ident, pair)
            self.counters[ChannelCounter.PAIRS_CREATED] += 1
            return pair

    async def _connect(self, node: N) -> tuple[Link, str]:
        if self._closed:
            raise NcclError("the channel is closed")
        pair_id = new_pair_id()
        unique_id, state = await in_thread(self.transport.prepare, "making a unique id")  # NCCL's first takes s
        try:
            offer = Offer(pair_id, self.transport.kind, unique_id, self.endpoint_id, node.node_id, self.cluster)
            await self.rendezvous.publish(offer)
            joining = asyncio.ensure_future(
                asyncio.to_thread(self.transport.join, unique_id, 0, state, self.pair_timeout_s)
            )
            try:
                # Answered as soon as the node took the offer; its join runs on in the background.
                await self._request(node, ChannelGet.encode_request(pair_id, [], offer.digest()))
            except BaseException:
                self.transport.discard(state)  # a CPU accept fails at once instead of at its deadline
                joining.add_done_callback(abort_joined)
                raise
            try:
                link = await asyncio.shield(joining)  # bounded by the transport's own deadline: pair_timeout_s
            except BaseException:
                joining.add_done_callback(abort_joined)  # cancelled: a link that still lands is aborted
                raise
        finally:
            self.transport.discard(state)
        logger.info("channel: paired with node %s over %s (pair %s)", node.node_id, self.kind, pair_id)
        return link, pair_id

    async def get(self, node: N, keys: Sequence[str], sink: Sink[T], fingerprint: int = 0) -> list[ChannelResult[T]]:
        """Fetch ``keys`` from ``node`` over the channel into ``sink`` buffers, each only if it was stored with
        the layout ``fingerprint`` (0: none; the node answers a chunk of another layout as not held).

        Per key, in order: :class:`Landed` (in its sink buffer, checksum verified) or
        :class:`NotBrought` with why (the node does not hold it, the sink had no room,
        the bytes did not match their checksum). Raises NcclError / KVPoolError when the
        pair or the node failed (any other exception, a CUDA error say, is raised as an
        NcclError naming it); the pair is then aborted and dropped.
        """
        if not keys:
            return []
        try:
            pair = await self._pair(node)
        except Exception as exc:
            self._back_off(node)
            if isinstance(exc, KVPoolError):
                raise
            raise _untyped(exc, f"pairing with node {node.node_id}") from exc
        async with pair.lock:
            try:
                reply = await self._request(
                    node, ChannelGet.encode_request(pair.pair_id, keys, fingerprint=fingerprint)
                )
                found = ChannelGet.decode_answer(reply, keys)
                total = sum(item.nbytes for item in found if item is not None)
                timeout_s = transfer_timeout(self.timeout_s, total)
                results = await self._receive(pair, found, sink, timeout_s, fingerprint)
            except BaseException as exc:
                self._pairs.retire((node.node_id, node.epoch), pair)
                self.counters[ChannelCounter.PAIR_FAILURES] += 1
                if not isinstance(exc, Exception):
                    raise  # cancelled: not the node's failure, no back-off
                self._back_off(node)
                if isinstance(exc, KVPoolError):
                    raise
                raise _untyped(exc, f"a transfer from node {node.node_id}") from exc
            finally:
                pair.transfer = None
            self.counters[ChannelCounter.BYTES] += total
            return results

    async def _receive(
        self, pair: Pair, found: list[ItemMeta | None], sink: Sink[T], timeout_s: float, fingerprint: int
    ) -> list[ChannelResult[T]]:
        """Sink buffers first, then the batch straight into them, each chunk verified as it lands. A chunk
        the node sent stored with another layout fingerprint (an older node does not check) is dropped."""
        handles: list[T | None] = [None] * len(found)
        items = [(index, item) for index, item in enumerate(found) if item is not None]
        targets: list[memoryview | None] = []
        verdicts: list[bool] = []
        other_layout = {i for i, item in items if fingerprint != ANY_FINGERPRINT and item.fingerprint != fingerprint}
        try:
            for index, item in items:
                if index in other_layout:
                    targets.append(None)  # received and dropped
                    continue
                allocated = await sink.allocate(item)
                if allocated is None:
                    targets.append(None)  # no room this time: received and dropped, a miss for this call only
                    continue
                handles[index], buffer = allocated
                view = memoryview(buffer).cast("B")
                if len(view) != item.nbytes:
                    raise KVPoolError(f"sink gave {len(view)} bytes for a {item.nbytes}-byte item")
                targets.append(view)
            if items:
                sizes, sums = [item.nbytes for _, item in items], [item.checksum for _, item in items]
                pair.transfer = asyncio.ensure_future(
                    asyncio.to_thread(receive_batch, pair.link, sizes, targets, sums, timeout_s, self._verifier)
                )
                verdicts = (await asyncio.shield(pair.transfer)).verdicts
        except BaseException:
            transfer = pair.transfer
            if transfer is not None and not transfer.done():  # its thread still writes into the buffers
                transfer.add_done_callback(lambda _done: _release(sink, handles))
            else:
                _release(sink, handles)
            raise
        good = {index: ok for (index, _), ok in zip(items, verdicts)}
        results: list[ChannelResult[T]] = []
        for index, handle in enumerate(handles):
            if found[index] is None:
                results.append(NotBrought(Why.NOT_HELD))
            elif index in other_layout:
                results.append(NotBrought(Why.OTHER_LAYOUT))
            elif handle is None:
                results.append(NotBrought(Why.NO_ROOM))
            elif not good[index]:
                sink.release(handle)
                self.counters[ChannelCounter.INTEGRITY_FAILURES] += 1
                results.append(NotBrought(Why.CORRUPT))
            else:
                results.append(Landed(handle))
        return results

    def _back_off(self, node: N) -> None:
        """Read ``node`` over TCP for ``backoff_s``: a failing node should not cost a timeout per batch."""
        self._backoff_until[node.node_id] = self._clock() + self.backoff_s
        logger.info("channel: node %s read over TCP for %.0f s after a channel failure", node.node_id, self.backoff_s)

    async def close(self) -> None:
        """Abort every pair (never destroy: a gone peer would hang it); bounded."""
        self._closed = True
        for task in list(self._pairing.values()):
            task.cancel()
        await asyncio.gather(*self._pairing.values(), return_exceptions=True)
        await self._pairs.close()
        await asyncio.to_thread(self._verifier.close)


def _release(sink: Sink[T], handles: Sequence[T | None]) -> None:
    for handle in handles:
        if handle is not None:
            sink.release(handle)


def _untyped(exc: Exception, what: str) -> NcclError:
    """An exception not of the library (a CUDA error, a transport's own bug) as the NcclError the client expects."""
    return NcclError(f"{what} failed: {type(exc).__name__}: {exc}")
