"""What every part of one node shares: its config, tiers, pins, index, counters, identity, worker threads and tasks.

The node's parts (``session.py``, ``ops.py``, ``puts.py``, ``publisher.py``, ``stats.py``)
each receive a :class:`NodeContext` and the other parts they use; none holds the node
process (``server.py``), which only builds them, starts them and stops them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from backend.config import NodeConfig
from backend.counters import NodeCounter
from backend.handshake import KeyRing, handshake_key
from backend.metadata import Beat, ClaimHolder, Location, NodeInfo, Quotas, RedisMemory
from backend.node.events import EventRing
from backend.node.store.pins import PinTtl
from backend.node.store.tiers import DRAM, TierManager
from backend.protocol import ItemMeta

__all__ = ["BULK_THREADS", "Identity", "NodeContext", "NodeIndex"]

# Threads that move large replies and puts (``backend.transport``): with one per busy
# connection, two clients' GETs are sent by both cores instead of the event loop's one.
# A thread works a transfer in turns and hands it back to the loop while its peer is
# silent, so stalled peers, however many, hold none of them.
BULK_THREADS = 4


class NodeIndex(Protocol):
    """What the node's parts ask of the index (``backend.metadata.NodeMetadata`` in a node process)."""

    async def commit(self, locations: Sequence[tuple[str, Location]], timeout_s: float | None = None) -> None: ...

    async def remove(self, node_id: str, epoch: int, keys: Sequence[str]) -> None: ...

    async def move(self, locations: Sequence[tuple[str, Location]]) -> None: ...

    async def remove_stale(self, stale: Sequence[tuple[str, Location]]) -> None: ...

    async def ensure_marker(self) -> str: ...

    async def ensure_epoch_at_least(self, epoch: int) -> None: ...

    async def new_epoch(self) -> int: ...

    async def heartbeat(
        self, info: NodeInfo, ttl_ms: int, changed: bool = False, holder: ClaimHolder | None = None
    ) -> Beat: ...

    async def memory(self) -> RedisMemory: ...

    async def quotas(self) -> Quotas: ...

    async def exchange_tenant_bytes(self, node_id: str, held: Mapping[str, int], ttl_ms: int) -> dict[str, int]: ...


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who this node is in the index: its id, the epoch its entries carry (0 until it joined), and the
    address its registry entry gives clients ("host:port"), which its handshake proofs name."""

    node_id: str
    epoch: int = 0
    address: str = ""


class NodeContext:
    """Shared by the sessions, the op handlers, the put path, the publisher and the statistics of one node."""

    def __init__(self, config: NodeConfig, tiers: TierManager, index: NodeIndex) -> None:
        self.config = config
        self.tiers = tiers
        # The pins (pins.py): leases of no connection, kept in the NVMe directory when there is one.
        self.pins = tiers.pin_book(PinTtl(config.pin_ttl_default_s, config.pin_ttl_max_s))
        self.index = index
        # Committed stores and removals for a `kvpool events` endpoint (events.py); None: off.
        self.events = EventRing(config.event_ring_keys) if config.event_ring_keys else None
        self.counters: Counter[NodeCounter] = Counter()
        self.identity = Identity(config.node_id)
        # The handshake keys a client may prove (one; two during a rotation): each token stretched once here.
        # Tenant tokens (each tenant's one; two during a rotation) bind a connection to one tenant's keys (the
        # session's ``tenant``).
        pool_tokens = [token for token in (config.token, config.token_next) if token]
        next_tokens = config.tenant_tokens_next
        self.keys = KeyRing(
            [handshake_key(token, config.namespace) for token in pool_tokens],
            {
                name: [handshake_key(t, config.namespace) for t in (token, next_tokens.get(name, "")) if t]
                for name, token in config.tenant_tokens.items()
            },
        )
        self.bulk = ThreadPoolExecutor(BULK_THREADS, thread_name_prefix="kvpool-node-bulk")
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def epoch(self) -> int:
        return self.identity.epoch

    @property
    def address(self) -> str:
        return self.identity.address

    def joined(self, node_id: str, epoch: int, address: str) -> None:
        """The node claimed ``node_id`` under ``epoch``, reached at ``address`` as its registry entry says
        (``PoolNode.start``): the one place identity is set."""
        self.identity = Identity(node_id, epoch, address)

    def location(self, meta: ItemMeta, tier: str = DRAM) -> Location:
        """Where ``meta``'s chunk is, as this node publishes it in the index."""
        return Location(self.node_id, self.epoch, tier, meta.nbytes, meta.checksum)

    # -- tasks and stopping -----------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of this node: cancelled when the node stops."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def request_stop(self) -> None:
        self._stopping.set()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def cancel_tasks(self) -> None:
        """Cancel every task :meth:`spawn` started and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
