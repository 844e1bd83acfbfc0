"""The read-only verbs: ``status``, ``nodes``, ``ls`` and ``stats``.

``status``, ``nodes`` and ``stats`` return typed values (:class:`PoolStatus`, :class:`NodeRow`,
:class:`PoolStats`) built from the nodes' typed STAT answers (``backend.protocol.reports.NodeReport``);
``ls`` streams JSON-ready rows, one SCAN batch at a time.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from backend.admin.shared import key_pattern, stats_of
from backend.client import PoolClient
from backend.counters import NodeCounter
from backend.errors import MetadataError
from backend.latency import Histogram, LatencyHistograms
from backend.metadata import LiveNamespaces, RedisMemory
from backend.protocol.reports import TierReport, tiers_from_json


@dataclass(frozen=True)
class RecentHits:
    """Gets and hits over the nodes' recent windows (the longest of them is ``window_s``)."""

    window_s: float
    gets: int
    hits: int

    @property
    def hit_rate(self) -> float | None:
        return round(self.hits / self.gets, 4) if self.gets else None


@dataclass(frozen=True)
class StatusNode:
    """One registered node, as ``kvpool status`` lists it."""

    node_id: str
    address: str
    alive: bool
    draining: bool
    epoch: int
    capacity_bytes: int
    used_bytes: int
    objects: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PoolStatus:
    """What ``kvpool status`` shows: Redis, the nodes, capacity and tiers, objects, hit rates."""

    redis_url: str
    rtt_ms: float
    namespace: str
    alive: int  # nodes
    dead: int
    draining: int
    capacity_bytes: int  # of the live nodes, as are the figures below
    used_bytes: int
    free_bytes: int
    objects: int
    tiers: dict[str, TierReport]  # summed over the nodes that answered STAT
    gets: int
    hits: int
    recent: RecentHits
    node_list: tuple[StatusNode, ...]
    redis_memory: RedisMemory | None = None  # None: Redis did not say (INFO not allowed to this user)
    # With no live node here: the namespaces of this Redis that have some (a URL naming the wrong one?).
    elsewhere: LiveNamespaces | None = None

    @property
    def hit_rate(self) -> float | None:
        return round(self.hits / self.gets, 4) if self.gets else None

    def to_json(self) -> dict[str, Any]:
        redis: dict[str, Any] = {"url": self.redis_url, "reachable": True, "rtt_ms": self.rtt_ms}
        if self.redis_memory is not None:
            redis.update(
                full=self.redis_memory.full,
                used_memory_bytes=self.redis_memory.used_bytes,
                maxmemory_bytes=self.redis_memory.max_bytes,
                maxmemory_policy=self.redis_memory.policy,
            )
        return {
            "redis": redis,
            "namespace": self.namespace,
            "nodes": {"alive": self.alive, "dead": self.dead, "draining": self.draining},
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "objects": self.objects,
            "tiers": {
                name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "objects": t.objects}
                for name, t in self.tiers.items()
            },
            "gets": self.gets,
            "hits": self.hits,
            "hit_rate": self.hit_rate,
            "recent": {
                "window_s": self.recent.window_s,
                "gets": self.recent.gets,
                "hits": self.recent.hits,
                "hit_rate": self.recent.hit_rate,
            },
            "node_list": [n.to_json() for n in self.node_list],
            "namespaces_with_live_nodes": None if self.elsewhere is None else dict(self.elsewhere.live),
        }


async def redis_memory(client: PoolClient) -> RedisMemory | None:
    """Redis's memory (whether it is full), or None where Redis does not say (an ACL user without INFO)."""
    try:
        return await client.index.memory()
    except MetadataError:
        return None


async def pool_status(client: PoolClient) -> PoolStatus:
    """Redis, nodes, capacity, objects and hit rate: what ``kvpool status`` shows."""
    rtt_ms = await client.index.ping()
    memory = await redis_memory(client)
    nodes = await client.index.nodes()
    stats = await stats_of(client, nodes)
    alive = [n for n in nodes if n.alive]
    for node in alive:
        if node.node_id in stats:
            node.used_bytes = sum(t.used_bytes for t in stats[node.node_id].tiers.values())
            node.object_count = stats[node.node_id].objects
    tiers: dict[str, TierReport] = {}
    for s in stats.values():
        for name, tier in s.tiers.items():
            total = tiers.get(name, TierReport(0, 0, 0))
            tiers[name] = TierReport(
                total.capacity_bytes + tier.capacity_bytes,
                total.used_bytes + tier.used_bytes,
                total.objects + tier.objects,
            )
    return PoolStatus(
        redis_url=client.config.redis_url,
        rtt_ms=round(rtt_ms, 3),
        namespace=client.config.namespace,
        alive=len(alive),
        dead=len(nodes) - len(alive),
        draining=sum(1 for n in nodes if n.draining),
        capacity_bytes=sum(n.capacity_bytes for n in alive),
        used_bytes=sum(n.used_bytes for n in alive),
        free_bytes=sum(n.free_bytes for n in alive),
        objects=sum(n.object_count for n in alive),
        tiers=tiers,
        gets=sum(s.counters.get(NodeCounter.GETS, 0) for s in stats.values()),
        hits=sum(s.counters.get(NodeCounter.HITS, 0) for s in stats.values()),
        recent=RecentHits(
            window_s=max((s.recent.window_s for s in stats.values()), default=0),
            gets=sum(s.recent.gets for s in stats.values()),
            hits=sum(s.recent.hits for s in stats.values()),
        ),
        node_list=tuple(
            StatusNode(
                node_id=n.node_id,
                address=n.address,
                alive=n.alive,
                draining=n.draining,
                epoch=n.epoch,
                capacity_bytes=n.capacity_bytes,
                used_bytes=n.used_bytes,
                objects=n.object_count,
            )
            for n in nodes
        ),
        redis_memory=memory,
        elsewhere=None if alive else await client.index.live_namespaces(),
    )


@dataclass(frozen=True)
class NodeRow:
    """One registered node, as ``kvpool nodes`` shows it: from its STAT answer, or the registry without one."""

    node_id: str
    host: str  # the node machine's hostname, as it registered ("" from a node that did not say)
    address: str
    cluster: str
    epoch: int
    alive: bool
    draining: bool
    uptime_s: float
    tiers: dict[str, TierReport]
    requests_per_s: float | None  # None: the node did not answer STAT
    last_heartbeat_s: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "host": self.host,
            "address": self.address,
            "cluster": self.cluster,
            "epoch": self.epoch,
            "alive": self.alive,
            "draining": self.draining,
            "uptime_s": self.uptime_s,
            "tiers": {name: tier.to_json() for name, tier in self.tiers.items()},
            "requests_per_s": self.requests_per_s,
            "last_heartbeat_s": self.last_heartbeat_s,
        }


async def node_rows(client: PoolClient) -> list[NodeRow]:
    """One row per registered node: what ``kvpool nodes`` shows."""
    nodes = await client.index.nodes()
    stats = await stats_of(client, nodes)
    now = time.time()
    rows = []
    for n in nodes:
        s = stats.get(n.node_id)
        rows.append(
            NodeRow(
                node_id=n.node_id,
                host=n.hostname,
                address=n.address,
                cluster=n.cluster,
                epoch=n.epoch,
                alive=n.alive,
                draining=n.draining,
                uptime_s=round(s.uptime_s if s else now - n.started_at, 1),
                tiers=s.tiers if s else tiers_from_json(n.tiers),
                requests_per_s=s.recent.requests_per_s if s else None,
                last_heartbeat_s=round(now - n.heartbeat_at, 1) if n.heartbeat_at else None,
            )
        )
    return rows


async def iter_keys(
    client: PoolClient, *, model: str | None = None, prefix: str | None = None, limit: int | None = None
) -> AsyncIterator[dict[str, Any]]:
    """Stream index entries (SCAN, never KEYS): key, node, its host, tier, size, and the node epoch that
    wrote it. The CLI holds one SCAN batch (1,000 keys) at a time, however large the index."""
    hosts = {n.node_id: n.hostname for n in await client.index.nodes()}
    count = 0
    async for batch in client.index.scan_entries(key_pattern(model, prefix)):
        for key, entry in batch:
            for loc in entry:
                yield {
                    "key": key,
                    "node_id": loc.node_id,
                    "host": hosts.get(loc.node_id, ""),
                    "tier": loc.tier,
                    "nbytes": loc.nbytes,
                    "epoch": loc.epoch,
                }
            count += 1
            if limit is not None and count >= limit:
                return


@dataclass(frozen=True)
class OpLatency:
    """One op's requests served and estimated p50/p99 service time, over the nodes."""

    count: int
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class PoolStats:
    """What ``kvpool stats`` shows: counters summed over the nodes, and service time per op."""

    nodes: int  # that answered STAT
    counters: dict[str, int]  # by name
    latency: dict[str, OpLatency]  # by op, ops never served left out

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "counters": dict(self.counters),
            "latency": {op: dataclasses.asdict(v) for op, v in self.latency.items()},
        }


async def pool_stats(client: PoolClient) -> PoolStats:
    """Counters summed over live nodes, and per op the requests served and p50/p99 service time.

    The quantiles are estimated from the nodes' latency histograms added together
    (``backend.latency``), so they cover every request since each node started.
    """
    nodes = await client.index.nodes()
    stats = await stats_of(client, nodes)
    totals: dict[str, int] = defaultdict(int)
    summed: dict[str, Histogram] = {}
    for s in stats.values():
        for name, value in s.counters.items():
            totals[name] += value
        if s.latency is None:
            continue  # a node of a version before the histograms
        for op, histogram in LatencyHistograms.from_json(s.latency).ops.items():
            if op not in summed:
                summed[op] = Histogram(histogram.bounds)
            if histogram.bounds == summed[op].bounds:  # nodes of one version share their buckets
                summed[op].add(histogram)
    latency = {
        op: OpLatency(h.count, round(h.quantile(0.5) * 1000, 3), round(h.quantile(0.99) * 1000, 3))
        for op, h in sorted(summed.items())
        if h.count
    }
    return PoolStats(len(stats), dict(sorted(totals.items())), latency)
