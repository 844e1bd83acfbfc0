"""What both ends of the channel share: the peers and sinks they serve, and the pair cache.

A pair is one link and the id it was paired under; transfers on a pair are serialised
by its lock. Retiring a pair aborts its link in a worker thread, and only once no
transfer thread uses it: NCCL forbids concurrent calls on one communicator, and the
event loop never waits on NCCL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from backend.errors import NcclError
from backend.protocol import ItemMeta
from nccl_channel.link import Buffer, Link

__all__ = [
    "Peer",
    "Sink",
    "Request",
    "Pair",
    "PairCache",
    "in_thread",
    "abort_joined",
    "MAX_PAIRS",
    "PAIR_TIMEOUT_S",
    "TEARDOWN_TIMEOUT_S",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAX_PAIRS = 64  # communicators kept per endpoint; the least recently used is closed
TEARDOWN_TIMEOUT_S = 10.0  # bound on an abort or a unique id, each run in a worker thread
PAIR_TIMEOUT_S = 30.0  # deadline of one pairing (both joins); a cold NCCL init can take several seconds


class Peer(Protocol):
    """A node as the channel needs it (``backend.metadata.NodeInfo``): who it is, where, what it serves."""

    @property
    def node_id(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    @property
    def cluster(self) -> str: ...

    @property
    def channel(self) -> str: ...


class Sink(Protocol[T]):  # type: ignore[misc]
    """Where received chunks go (``backend.client.Sink``)."""

    async def allocate(self, meta: ItemMeta) -> tuple[T, Buffer] | None: ...

    def release(self, handle: T) -> None: ...


P = TypeVar("P", bound=Peer, contravariant=True)


class Request(Protocol[P]):
    """Sends one CHANNEL_GET to a node over its TCP protocol; the response meta (``PoolClient.channel_request``)."""

    def __call__(self, node: P, meta: bytes, /) -> Awaitable[bytes]: ...


@dataclasses.dataclass
class Pair:
    pair_id: str
    link: Link
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    transfer: asyncio.Future[Any] | None = None  # the worker thread's send or recv, while one runs
    retired: bool = False


class PairCache:
    """Pairs by key, least recently used first, shared by both ends of the channel.

    Retiring a pair removes it at once; its link is aborted in a worker thread once
    the pair's transfer thread (if any) has returned, so a communicator never sees
    two calls at a time and the event loop never waits on NCCL.
    """

    def __init__(self, max_pairs: int) -> None:
        self.max_pairs = max_pairs
        self._pairs: OrderedDict[Any, Pair] = OrderedDict()
        self._teardowns: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._pairs)

    def live(self, key: Any) -> Pair | None:
        """The pair of ``key`` if it exists and is not broken (marked most recently used)."""
        pair = self._pairs.get(key)
        if pair is None or pair.link.broken:
            return None
        self._pairs.move_to_end(key)
        return pair

    def add(self, key: Any, pair: Pair) -> None:
        """Keep ``pair``; past ``max_pairs``, retire the least recently used pairs no transfer holds."""
        old = self._pairs.get(key)
        if old is not None:
            self.retire(key, old)
        self._pairs[key] = pair
        idle = [k for k, p in self._pairs.items() if not p.lock.locked() and p is not pair]
        for k in idle[: len(self._pairs) - self.max_pairs]:
            self.retire(k, self._pairs[k])

    def retire(self, key: Any, pair: Pair) -> None:
        """Drop ``pair`` now; abort its link off the event loop once its transfer thread returned."""
        if self._pairs.get(key) is pair:
            del self._pairs[key]
        if pair.retired:
            return
        pair.retired = True
        if pair.transfer is not None and not pair.transfer.done():
            pair.link.cancel()
        task = asyncio.ensure_future(abort_after(pair.link, pair.transfer))
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    async def close(self) -> None:
        """Retire every pair and wait (bounded) for their aborts."""
        for key, pair in list(self._pairs.items()):
            self.retire(key, pair)
        if self._teardowns:
            await asyncio.wait(list(self._teardowns), timeout=2 * TEARDOWN_TIMEOUT_S)


async def abort_after(link: Link, transfer: asyncio.Future[Any] | None) -> None:
    if transfer is not None:
        await asyncio.wait([transfer])  # bounded: the thread's own transfer timeout; cancel() shortens it
        if not transfer.cancelled():
            transfer.exception()  # already reported by the transfer's caller
    try:
        await in_thread(link.abort, "aborting a pair")
    except NcclError as exc:
        logger.warning("channel: %s", exc)


async def in_thread(call: Callable[[], T], what: str) -> T:
    """Run a blocking NCCL call in a worker thread, bounded by TEARDOWN_TIMEOUT_S."""
    try:
        async with asyncio.timeout(TEARDOWN_TIMEOUT_S):
            return await asyncio.to_thread(call)
    except TimeoutError:
        raise NcclError(f"{what} timed out after {TEARDOWN_TIMEOUT_S:.0f} s (left to its thread)") from None


def abort_joined(joining: asyncio.Future[Link]) -> None:
    """Abort a link whose join finished after its pairing was given up (never leave it open)."""
    if joining.cancelled() or joining.exception() is not None:
        return
    link = joining.result()
    asyncio.get_running_loop().run_in_executor(None, link.abort)
