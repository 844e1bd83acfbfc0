"""The dead-node reaper: what nodes that died leave in Redis, removed by a live node.

A node killed with ``kill -9`` never deregisters: its registry entry stays, and so do
the index fields that name it. Readers skip them (the node is not alive) and drop the
ones they touch, but nothing else would: a pool whose nodes restart under new ids
(no NVMe directory to keep an id in, port 0) would grow Redis by one registry entry
and every index field it wrote per restart, without bound.

So one live node -- the live node with the lowest id, which every node can work out
from the registry alone -- collects, in steps taken after its heartbeats:

1. A node id that is registered but not alive, or that holds a slot (``NodeSlots``) but
   is no longer registered (it stopped and has not come back), and a slot met in the
   index that no id holds, is *dead* from the moment this reaper first sees it so; after
   ``grace_s`` of that, its registry entry is forgotten and its slot taken back (unless a
   run claims the id again). The time is this process's own monotonic clock: wall clocks
   of other hosts play no part.
2. The sweep: a walk over the whole index done in Redis (``KeyIndex.sweep_step``, one
   SCAN page of ``SWEEP_PAGE`` keys per call, under a millisecond of Redis each), which
   removes every field of a slot dead for ``grace_s``, and every field written by an older
   epoch of a node that is alive now (its previous run's DRAM chunks, which died with it).
   Each call reads and removes atomically, so a write racing the reaper lands after it
   and stays. While there is work that no walk begun since has covered (a slot dead for
   ``grace_s``, a live node's new epoch), the calls run back to back for up to
   ``budget_s`` per step: a dead node of 10^6 chunks is gone in seconds to a minute, not
   33 minutes (docs/scale-redis.md). Otherwise one page per step keeps walking, to find
   slots nobody knows any more.

A node that was collected while it could not reach Redis (frozen, partitioned) finds
its registry entry gone at its next heartbeat and republishes what it holds
(``PoolNode``), so collecting a node that comes back costs misses, never bytes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from backend.counters import NodeCounter
from backend.metadata import SWEEP_PAGE, MetadataStore, NodeInfo

__all__ = ["DeadNodeReaper", "SCAN_COUNT", "DEFAULT_GRACE_S", "STEP_BUDGET_S"]

logger = logging.getLogger(__name__)

SCAN_COUNT = SWEEP_PAGE  # index keys one sweep call reads (under a millisecond of Redis)
DEFAULT_GRACE_S = 300.0  # a node must look dead this long before its entries go
FOLLOWER_CHECK_S = 10.0  # a node that does not collect reads the registry to see whether it should this often
STEP_BUDGET_S = 0.4  # how long one step may sweep when there is work: 40% of the default beat interval


_Walk = tuple[frozenset[int], dict[int, int]]  # the dead slots and live slot epochs a walk began with


class DeadNodeReaper:
    """Removes dead nodes' registry entries, slots and index fields (see the module docstring)."""

    def __init__(
        self, store: MetadataStore, node_id: str, grace_s: float = DEFAULT_GRACE_S, budget_s: float = STEP_BUDGET_S
    ) -> None:
        self.store = store
        self.node_id = node_id
        self.grace_s = grace_s
        self.budget_s = budget_s
        self.counters: Counter[NodeCounter] = Counter()
        self._dead_since: dict[str, float] = {}  # node id, or "#slot" for a slot no id holds -> first seen dead
        self._dead_slots: set[int] = set()  # slots whose fields go, until a walk begun with them ends
        self._met: set[int] = set()  # slots no id holds, met in the index during the current walk
        self._cursor = 0
        self._walk: _Walk | None = None  # what the walk under way began with
        self._covered: _Walk | None = None  # what the last whole walk began with (None: no walk yet)
        self._walk_started = 0.0
        self._walk_removed = 0
        self._next_check = 0.0  # while another node reaps: when to look at the registry again

    async def step(self) -> None:
        """One step: the registry, then the sweep (see the module docstring). Raises MetadataError."""
        now = time.monotonic()
        if now < self._next_check:
            return
        nodes = await self.store.registry.nodes()
        alive = {n.node_id: n for n in nodes if n.alive}
        if not alive or min(alive) != self.node_id:
            self._dead_since.clear()  # another node reaps; start afresh if this one takes over
            self._dead_slots.clear()
            self._cursor, self._walk, self._covered = 0, None, None
            self._next_check = now + FOLLOWER_CHECK_S  # every node reading the registry each beat costs N²
            return
        held = await self.store.connection.slot_map()  # every id that holds a slot
        registered = {n.node_id for n in nodes}
        known = registered | held.keys()  # an id forgotten (neither) needs no tracking; its slot does
        self._dead_since = {k: t for k, t in self._dead_since.items() if k[0] == "#" or k in known}
        for node_id in known:
            self._note(node_id, node_id in alive, now)
        self._dead_slots |= {slot for node_id, slot in held.items() if self._dead_long_enough(node_id, now)}
        self._dead_slots |= {int(k[1:]) for k in self._dead_since if k[0] == "#" and self._dead_long_enough(k, now)}
        await self._forget(nodes, held, registered, now)
        live = {n.slot: n.epoch for n in alive.values() if n.slot}
        self._dead_slots -= live.keys()  # a slot whose node is back (the dead set is this step's view)
        await self._sweep(live, frozenset(self._dead_slots), set(held.values()), now)

    async def _sweep(self, live: dict[int, int], dead: frozenset[int], held: set[int], now: float) -> None:
        """Sweep calls back to back while there is work no walk has covered (within ``budget_s``), else one."""
        deadline = now + self.budget_s
        while True:
            urgent = self._uncovered(live, dead)
            if self._cursor == 0:
                self._begin_walk(live, dead, urgent)
            page = await self.store.index.sweep_step(self._cursor, live, dead)
            self._cursor = page.cursor
            self.counters[NodeCounter.COLLECTOR_KEYS_READ] += page.keys
            if page.removed:
                self.counters[NodeCounter.COLLECTED_INDEX_FIELDS] += page.removed
                self._walk_removed += page.removed
            for slot in page.unknown - held:  # met in the index, held by no id (a node's grace is by its id)
                self._met.add(slot)
                self._note(f"#{slot}", False, now)
            if self._cursor == 0:
                self._end_walk()
                urgent = self._uncovered(live, dead)
            if not urgent or time.monotonic() >= deadline:
                return

    def _uncovered(self, live: dict[int, int], dead: frozenset[int]) -> bool:
        """Whether some field to remove may lie where no walk begun since it was known has been: a slot
        dead since the last whole walk began, a live node's newer epoch, or no whole walk yet."""
        if self._covered is None:
            return True
        covered_dead, covered_live = self._covered
        return bool(dead - covered_dead) or any(covered_live.get(slot, epoch) < epoch for slot, epoch in live.items())

    def _begin_walk(self, live: dict[int, int], dead: frozenset[int], urgent: bool) -> None:
        self._walk = (dead, dict(live))
        self._walk_started, self._walk_removed = time.monotonic(), 0
        if urgent and (dead or self._covered is not None):
            logger.info(
                "node %s: sweeping the index (%d dead node slots, %d live nodes)", self.node_id, len(dead), len(live)
            )

    def _end_walk(self) -> None:
        """A walk over the whole index ended: the dead slots it began with are gone everywhere, and slots
        no id holds that it did not meet need no tracking."""
        if self._walk is not None:
            self._covered = self._walk
            self._dead_slots -= self._walk[0]
        self._walk = None
        self._dead_since = {k: t for k, t in self._dead_since.items() if k[0] != "#" or int(k[1:]) in self._met}
        self._met = set()
        self.counters[NodeCounter.COLLECTOR_SWEEPS] += 1  # the counter names are in STAT and /metrics: kept
        if self._walk_removed:
            logger.info(
                "node %s: swept the index in %.1f s: %d fields of dead nodes and ended runs removed",
                self.node_id,
                time.monotonic() - self._walk_started,
                self._walk_removed,
            )

    def _note(self, node_id: str, is_alive: bool, now: float) -> None:
        if is_alive:
            self._dead_since.pop(node_id, None)
        else:
            self._dead_since.setdefault(node_id, now)

    def _dead_long_enough(self, node_id: str, now: float) -> bool:
        return node_id in self._dead_since and now - self._dead_since[node_id] >= self.grace_s

    async def _forget(self, nodes: list[NodeInfo], held: dict[str, int], registered: set[str], now: float) -> None:
        """Forget registry entries dead for ``grace_s``; take back the slots of ids unregistered that long.
        Their slots stay in the dead set until a walk begun with them ends."""
        for node in nodes:
            if not node.alive and self._dead_long_enough(node.node_id, now):
                await self.store.registry.forget_node(node.node_id)
                self.counters[NodeCounter.COLLECTED_NODES] += 1
                logger.info(
                    "node %s: forgot node %s, dead for %.0f s or more", self.node_id, node.node_id, self.grace_s
                )
        for node_id in held.keys() - registered:
            if self._dead_long_enough(node_id, now):
                await self.store.registry.forget_slot(node_id)
