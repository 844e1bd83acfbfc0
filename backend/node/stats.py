"""What a node counts about itself: counters, recent rates and service times, and the STAT report."""

from __future__ import annotations

import collections
import time
from collections import Counter

from backend.counters import NodeCounter
from backend.latency import LatencyHistograms
from backend.node.context import NodeContext
from backend.protocol.reports import NodeReport, RecentReport, RecoveryReport, RepublishReport

__all__ = ["NodeStats"]

RECENT_WINDOW_S = 300  # "recent" rates in STAT cover the last five minutes
RECENT_SNAPSHOTS = 400


class NodeStats:
    """The node's counters, a snapshot of them per heartbeat, and a service-time histogram per op.

    The STAT report adds the counters of the parts that keep their own (the tiers, the
    leases, and those :meth:`count_also` names: the channel, the dead-node reaper).
    """

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.counters: Counter[NodeCounter] = ctx.counters
        self.recovery: RecoveryReport | None = None  # the NVMe tier's recovery at start, so far (recovery.py)
        self.republish = RepublishReport()  # the republish under way, else the last one (republish.py)
        self._others: list[Counter[NodeCounter]] = []
        self._started_monotonic = time.monotonic()
        self._snapshots: collections.deque[tuple[float, int, int, int]] = collections.deque(maxlen=RECENT_SNAPSHOTS)
        self._snapshots.append((time.monotonic(), 0, 0, 0))  # the window of a young node starts at zero
        self.latency = LatencyHistograms()  # service time per op, for STAT and /metrics

    def served(self, op_name: str, started: float) -> None:
        """One request answered: counted, and its service time recorded."""
        self.counters[NodeCounter.REQUESTS] += 1
        self.latency.observe(op_name, time.perf_counter() - started)

    def tick(self) -> None:
        """Keep a snapshot for the recent rates (once per heartbeat)."""
        self._snapshots.append(self._snapshot())

    def count_also(self, counters: Counter[NodeCounter]) -> None:
        """Report ``counters`` (kept, and counted, by another part) with the node's own."""
        self._others.append(counters)

    def report(self) -> NodeReport:
        """STAT's answer (and what /metrics exports)."""
        store, identity = self.ctx.tiers.upkeep.report(), self.ctx.identity
        counters = self.counters + store.counters
        for other in self._others:
            counters.update(other)
        pinned_chunks, pinned_bytes = self.ctx.pins.totals()
        return NodeReport(
            node_id=identity.node_id,
            epoch=identity.epoch,
            uptime_s=round(time.monotonic() - self._started_monotonic, 3),
            counters={str(name): value for name, value in counters.items() if value > 0},
            objects=store.objects,
            leases=store.leases,
            arena=store.arena,
            tiers=store.tiers,
            recovery=self.recovery,
            latency=self.latency.to_json(),
            recent=self._recent(),
            republish=self.republish,
            pinned_chunks=pinned_chunks,
            pinned_bytes=pinned_bytes,
            tenants=store.tenants,
        )

    def _snapshot(self) -> tuple[float, int, int, int]:
        c = self.counters
        return (time.monotonic(), c[NodeCounter.REQUESTS], c[NodeCounter.GETS], c[NodeCounter.HITS])

    def _recent(self) -> RecentReport:
        """Requests, gets and hits over the last ``RECENT_WINDOW_S`` (or since start)."""
        now = self._snapshot()
        old = next((s for s in self._snapshots if now[0] - s[0] <= RECENT_WINDOW_S), self._snapshots[-1])
        window = max(now[0] - old[0], 1e-3)
        return RecentReport(
            window_s=round(window, 1),
            requests_per_s=round((now[1] - old[1]) / window, 3),
            gets=now[2] - old[2],
            hits=now[3] - old[3],
        )
