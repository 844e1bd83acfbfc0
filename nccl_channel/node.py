"""The node end of the channel: joins offers meant for this node and sends chunks over the pairs."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

from backend.counters import NodeCounter
from backend.errors import NcclError
from nccl_channel.link import Buffer, Transport, transfer_timeout
from nccl_channel.pairs import MAX_PAIRS, PAIR_TIMEOUT_S, Pair, PairCache, abort_joined
from nccl_channel.rendezvous import Offer, Rendezvous

__all__ = ["ChannelServer"]

logger = logging.getLogger(__name__)


class ChannelServer:
    """The node end: joins offers meant for this node and sends chunks over the pairs."""

    def __init__(
        self,
        transport: Transport,
        rendezvous: Rendezvous,
        node_id: str,
        cluster: str,
        timeout_s: float,
        max_pairs: int = MAX_PAIRS,
        pair_timeout_s: float = PAIR_TIMEOUT_S,
    ) -> None:
        self.transport = transport
        self.rendezvous = rendezvous
        self.node_id = node_id
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.pair_timeout_s = pair_timeout_s
        self.counters: Counter[NodeCounter] = Counter()
        self._pairs = PairCache(max_pairs)
        self._joins: dict[str, asyncio.Task[None]] = {}  # pair_id -> its join, while under way

    @property
    def kind(self) -> str:
        return self.transport.kind

    async def start_join(self, pair_id: str, digest: str) -> None:
        """Take the offer of ``pair_id`` (the one whose digest is ``digest``) and join its pair in the
        background; NcclError if there is no such offer.

        Returns once the offer is taken, so the pairing request is answered at once: the
        join itself (a cold NCCL init takes seconds) is bounded by ``pair_timeout_s``,
        not by any request's timeout.
        """
        if self._pairs.live(pair_id) is not None or pair_id in self._joins:
            return
        if not digest:
            raise NcclError(
                f"the pairing request for pair {pair_id} names no offer digest (a client of an older release?)"
            )
        offer = await self.rendezvous.take(
            pair_id, target=self.node_id, cluster=self.cluster, transport=self.kind, digest=digest
        )
        if pair_id in self._joins:  # a concurrent request for the same pair took it first
            return
        task = asyncio.ensure_future(self._join(pair_id, offer))
        self._joins[pair_id] = task
        task.add_done_callback(lambda done: self._joined(pair_id, done))

    def _joined(self, pair_id: str, task: asyncio.Task[None]) -> None:
        self._joins.pop(pair_id, None)
        if not task.cancelled():
            task.exception()  # logged by _join; a request waiting on it gets it too

    async def _join(self, pair_id: str, offer: Offer) -> None:
        joining = asyncio.ensure_future(
            asyncio.to_thread(self.transport.join, offer.unique_id, 1, None, self.pair_timeout_s)
        )
        try:
            link = await asyncio.shield(joining)
        except asyncio.CancelledError:
            joining.add_done_callback(abort_joined)  # the node is stopping: a link that still lands is aborted
            raise
        except Exception as exc:
            self.counters[NodeCounter.CHANNEL_ERRORS] += 1
            logger.warning("channel: node %s could not pair with %s: %s", self.node_id, offer.initiator, exc)
            raise
        self._pairs.add(pair_id, Pair(pair_id, link))
        self.counters[NodeCounter.CHANNEL_PAIRS] += 1
        logger.info("channel: node %s paired with %s over %s", self.node_id, offer.initiator, self.kind)

    async def join(self, pair_id: str) -> None:
        """Make sure the pair of ``pair_id`` exists: wait for its join (started by the pairing request). NcclError
        on failure."""
        if self._pairs.live(pair_id) is not None:
            return
        task = self._joins.get(pair_id)
        if task is not None:
            await asyncio.shield(task)
        if self._pairs.live(pair_id) is None:
            raise NcclError(f"pair {pair_id} is not on node {self.node_id} (never paired, or its join failed)")

    async def send(self, pair_id: str, buffers: Sequence[Buffer]) -> None:
        """Send ``buffers`` as one batch over the pair of ``pair_id``; a failure drops the pair."""
        pair = self._pairs.live(pair_id)
        if pair is None:
            self.counters[NodeCounter.CHANNEL_ERRORS] += 1
            logger.warning("channel: node %s has no pair %s; nothing sent", self.node_id, pair_id)
            return
        nbytes = sum(len(memoryview(b).cast("B")) for b in buffers)
        async with pair.lock:
            pair.transfer = asyncio.ensure_future(
                asyncio.to_thread(pair.link.send, buffers, transfer_timeout(self.timeout_s, nbytes))
            )
            try:
                await asyncio.shield(pair.transfer)
            except Exception as exc:  # NcclError, or anything else a link let through: never reuse the pair
                self.counters[NodeCounter.CHANNEL_ERRORS] += 1
                self._pairs.retire(pair_id, pair)
                logger.warning("channel: send to pair %s failed, pair dropped: %s", pair_id, exc)
                return
            except BaseException:
                self._pairs.retire(pair_id, pair)  # cancelled (node stopping): aborted once the thread returns
                raise
            finally:
                pair.transfer = None
        self.counters[NodeCounter.CHANNEL_BYTES] += nbytes

    def register_host(self, memory: memoryview) -> None:
        """Memory chunks are sent from (the node's arena, one mapping): the transport may page-lock it once."""
        self.transport.register_host(memory)

    async def close(self) -> None:
        """Abort every pair (never destroy: a gone peer would hang it); bounded."""
        for task in list(self._joins.values()):
            task.cancel()
        await asyncio.gather(*self._joins.values(), return_exceptions=True)
        await self._pairs.close()
