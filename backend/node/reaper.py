"""The dead-node reaper: what nodes that died leave in Redis, removed by a live node.

A node killed with ``kill -9`` never deregisters: its registry entry stays, and so do
the index fields that name it. Readers skip them (the node is not alive) and drop the
ones they touch, but nothing else would: a pool whose nodes restart under new ids
(no NVMe directory to keep an id in, port 0) would grow Redis by one registry entry
and every index field it wrote per restart, without bound.

So one live node -- the live node with the lowest id, which every node can work out
from the registry alone -- collects, one bounded step per heartbeat:

1. A node not alive (or an id in the index that the registry no longer lists) is
   *dead* from the moment this reaper first sees it so; after ``grace_s`` of that,
   its registry entry is forgotten. The time is this process's own monotonic clock:
   wall clocks of other hosts play no part.
2. One SCAN step over the index (``SCAN_COUNT`` keys, one pipelined lookup) drops every
   field of a node dead for ``grace_s``, and every field written by an older epoch of
   a node that is alive now (its previous run's DRAM chunks, which died with it).
   Each removal is conditional on the field being unchanged, so a write racing the
   reaper always wins. The walk wraps around, so every key is visited again and
   again, at ``SCAN_COUNT`` keys per heartbeat.

A node that was collected while it could not reach Redis (frozen, partitioned) finds
its registry entry gone at its next heartbeat and republishes what it holds
(``PoolNode``), so collecting a node that comes back costs misses, never bytes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from backend.metadata import Location, MetadataStore, NodeInfo

__all__ = ["DeadNodeReaper", "SCAN_COUNT", "DEFAULT_GRACE_S"]

logger = logging.getLogger(__name__)

SCAN_COUNT = 500  # index keys looked at per step: 500 HGETALLs a second from one node, at most
DEFAULT_GRACE_S = 300.0  # a node must look dead this long before its entries go
FOLLOWER_CHECK_S = 10.0  # a node that does not collect reads the registry to see whether it should this often


class DeadNodeReaper:
    """Removes dead nodes' registry entries and index fields, one step at a time."""

    def __init__(self, store: MetadataStore, node_id: str, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.store = store
        self.node_id = node_id
        self.grace_s = grace_s
        self.counters: Counter[str] = Counter()
        self._dead_since: dict[str, float] = {}  # node id -> when this reaper first saw it dead
        self._seen_in_sweep: set[str] = set()  # dead ids met in the index during the current walk
        self._cursor = 0
        self._next_check = 0.0  # while another node reaps: when to look at the registry again

    async def step(self) -> None:
        """One bounded step: registry, then one SCAN step of the index. Raises MetadataError."""
        now = time.monotonic()
        if now < self._next_check:
            return
        nodes = await self.store.nodes()
        alive = {n.node_id: n for n in nodes if n.alive}
        if not alive or min(alive) != self.node_id:
            self._dead_since.clear()  # another node reaps; start afresh if this one takes over
            self._cursor = 0
            self._next_check = now + FOLLOWER_CHECK_S  # every node reading the registry each beat costs N²
            return
        for node in nodes:
            self._note(node.node_id, node.node_id in alive, now)
        await self._forget_registry(nodes, now)
        self._cursor, keys = await self.store.scan_step(self._cursor, count=SCAN_COUNT)
        entries = await self.store.lookup(keys) if keys else []
        stale: list[tuple[str, Location]] = []
        for key, entry in zip(keys, entries):
            for loc in entry:
                if self._stale(loc, alive, now):
                    stale.append((key, loc))
        if stale:
            await self.store.remove_stale(stale)
            self.counters["collected_index_fields"] += len(stale)
        if self._cursor == 0:
            self._end_sweep({n.node_id for n in nodes})

    def _note(self, node_id: str, is_alive: bool, now: float) -> None:
        if is_alive:
            self._dead_since.pop(node_id, None)
        else:
            self._dead_since.setdefault(node_id, now)

    def _dead_long_enough(self, node_id: str, now: float) -> bool:
        return now - self._dead_since.get(node_id, now) >= self.grace_s

    async def _forget_registry(self, nodes: list[NodeInfo], now: float) -> None:
        for node in nodes:
            if not node.alive and self._dead_long_enough(node.node_id, now):
                await self.store.forget_node(node.node_id)
                self.counters["collected_nodes"] += 1
                logger.info(
                    "node %s: forgot node %s, dead for %.0f s or more", self.node_id, node.node_id, self.grace_s
                )

    def _stale(self, loc: Location, alive: dict[str, NodeInfo], now: float) -> bool:
        node = alive.get(loc.node_id)
        if node is not None:
            return loc.epoch < node.epoch  # written by a run of that node that has ended
        self._seen_in_sweep.add(loc.node_id)
        self._note(loc.node_id, False, now)  # not in the registry at all counts as dead too
        return self._dead_long_enough(loc.node_id, now)

    def _end_sweep(self, registered: set[str]) -> None:
        """A walk over the whole index ended: stop tracking dead ids that appear nowhere any more."""
        keep = registered | self._seen_in_sweep
        self._dead_since = {node_id: since for node_id, since in self._dead_since.items() if node_id in keep}
        self._seen_in_sweep = set()
        self.counters["collector_sweeps"] += 1  # the counter names are in STAT and /metrics: kept
