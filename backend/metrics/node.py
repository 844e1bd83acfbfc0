"""The Prometheus mapping of a pool node's stats: ``NodeCollector`` and its families.

Read at scrape time from ``PoolNode.report()`` and ``health()``, so nothing on the data
path pays for metrics. Every name emitted here is listed in docs/metrics.md (a test
keeps them in step).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from backend.counters import NodeCounter
from backend.latency import LatencyHistograms
from backend.protocol.reports import NodeReport, RecoveryReport, TenantReport, TierReport

__all__ = ["METRIC_NAME", "NODE_COUNTERS", "NODE_PREFIX", "NodeCollector"]

logger = logging.getLogger(__name__)

NODE_PREFIX = "kvpool_node_"

METRIC_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# Counters a node always exposes, 0 until they first happen, so that rate() and ratios
# work from the first scrape. Any other counter the node reports appears once non-zero.
NODE_COUNTERS: dict[NodeCounter, str] = {
    NodeCounter.PUTS: "Chunks stored and committed to the index.",
    NodeCounter.PUT_BYTES: "Payload bytes of chunks stored.",
    NodeCounter.PUT_REFUSED_NO_ROOM: "Chunks of a put refused for lack of room (the client tries another node).",
    NodeCounter.PUT_REFUSED_BUSY: "Chunks of a put refused as busy: DRAM stayed full of puts in flight until the put's deadline.",
    NodeCounter.GETS: "Keys asked for by GET requests.",
    NodeCounter.HITS: "Keys a GET found and returned.",
    NodeCounter.MISSES: "Keys a GET did not return.",
    NodeCounter.GET_BYTES: "Payload bytes returned by GETs.",
    NodeCounter.GET_OVER_FRAME_LIMIT: "Chunks held but not returned because the response frame was full (also misses).",
    NodeCounter.DELETES: "Chunks removed by DELETE requests.",
    NodeCounter.EVICTIONS: "Chunks dropped from DRAM for room (no NVMe tier, or the disk would not take them).",
    NodeCounter.DEMOTIONS: "Chunks moved from DRAM to NVMe.",
    NodeCounter.PROMOTIONS: "Chunks read back from NVMe into DRAM.",
    NodeCounter.LAYOUT_MISSES: "Keys a read found stored with another KV layout fingerprint than the reader's: "
    "answered as misses, no bytes.",
    NodeCounter.NVME_WRITES: "Files written to the NVMe tier.",
    NodeCounter.NVME_READS: "Chunks read from the NVMe tier.",
    NodeCounter.NVME_EVICTIONS: "Files deleted from the NVMe tier for room.",
    NodeCounter.DISK_FULL: "Disk-full episodes: the disk refused an NVMe write (ENOSPC/EDQUOT) and demotion paused.",
    NodeCounter.INTEGRITY_FAILURES: "Checksum mismatches: on arrival of a put, in DRAM, or on NVMe read.",
    NodeCounter.QUARANTINED: "NVMe files moved to quarantine/.",
    NodeCounter.REPUBLISHED: "Index entries republished after Redis lost the namespace.",
    NodeCounter.AUTH_FAILURES: "Requests refused for a missing or wrong token.",
    NodeCounter.TENANT_REFUSALS: "Requests of a tenant token's connection refused: another tenant's keys, "
    "an admin op, the arena, stages or the channel.",
    NodeCounter.TLS_FAILURES: "Connections closed because their TLS handshake failed (a plaintext client, an untrusted peer).",
    NodeCounter.PROTOCOL_ERRORS: "Connections or requests refused as malformed.",
    NodeCounter.REQUEST_ERRORS: "Requests answered with an error.",
    NodeCounter.STALLED_CONNECTIONS: "Connections closed because a frame stalled mid-way.",
    NodeCounter.HANDSHAKE_TIMEOUTS: "Connections closed because they did not finish their handshake in time.",
    NodeCounter.CONNECTIONS_SHED: "Connections closed, oldest first, beyond the cap on those without a finished handshake.",
    NodeCounter.ACCEPT_ERRORS: "Failed accepts (EMFILE and the like).",
    NodeCounter.REQUESTS: "Requests answered successfully (HELLO and AUTH not counted).",
    NodeCounter.SHM_GET_BYTES: "Payload bytes same-host clients copied from the shared-memory arena (not sent).",
    NodeCounter.STAGED_PUT_BYTES: "Payload bytes of staged puts: copied in from same-host clients' stages (not received).",
    NodeCounter.STAGES_REMOVED: "Put stages of same-host clients that died without closing them, removed by the node.",
    NodeCounter.LEASES_GRANTED: "Leases granted (same-host reads and locks).",
    NodeCounter.LEASES_RELEASED: "Leases ended by their client.",
    NodeCounter.LEASES_EXPIRED: "Leases ended by their deadline (client gone or slow).",
    NodeCounter.LEASES_REFUSED: "Leases refused because the node held its maximum.",
    NodeCounter.LEASES_DISCONNECTED: "Leases ended because the connection that took them closed (client gone).",
    NodeCounter.CONNECTIONS_ACCEPTED: "Client connections accepted.",
}
# STAT carries the names as strings (a node of another version may report names this one lacks).
_COUNTER_HELP = {str(name): text for name, text in NODE_COUNTERS.items()}


class NodeCollector:
    """Reads one node's ``report()`` and ``health()`` at scrape time and yields its families."""

    def __init__(self, report: Callable[[], NodeReport], health: Callable[[], dict[str, Any]]) -> None:
        self.report = report
        self.health = health

    def collect(self) -> Iterator[Metric]:
        report = self.report()
        node = report.node_id
        yield from _node_counters(node, report.counters)
        yield _gauge("uptime_seconds", "Seconds since the node process started.", node, report.uptime_s)
        yield _gauge("epoch", "Epoch this node took at its start (a restart takes a new one).", node, report.epoch)
        yield _gauge("objects", "Distinct chunks held, over all tiers.", node, report.objects)
        yield _gauge("leases", "Leases currently held by clients (pins included).", node, report.leases)
        yield _gauge(
            "pinned_chunks", "Chunks held now under a pin (kvpool pin): never evicted.", node, report.pinned_chunks
        )
        yield _gauge("pinned_bytes", "Bytes of the chunks held now under a pin.", node, report.pinned_bytes)
        arena = report.arena
        if arena is not None:
            yield _gauge(
                "arena_allocated_bytes", "Bytes of the shared-memory arena in use.", node, arena.allocated_bytes
            )
            yield _gauge(
                "arena_grown_bytes", "Bytes of the shared-memory arena backed by memory.", node, arena.grown_bytes
            )
        if report.tenants:
            yield from _tenant_metrics(node, report.tenants)
        healthy = 1 if self.health().get("status") == "ok" else 0
        yield _gauge("healthy", "1 while /health answers ok, else 0.", node, healthy)
        yield from _tier_gauges(node, report.tiers)
        if report.recovery is not None:
            yield from _recovery_gauges(node, report.recovery)
        republish = report.republish
        if republish is not None:
            yield _gauge(
                "republish_running",
                "1 while the node republishes what it holds after Redis lost its index entries, else 0.",
                node,
                float(republish.running),
            )
            yield _gauge(
                "republish_pending",
                "Chunks the republish under way has yet to publish (estimated from those held when it began).",
                node,
                republish.pending,
            )
        latency = report.latency
        histograms = _latency_histogram(node, latency) if latency else None
        if histograms is not None:
            yield histograms


def _tenant_metrics(node: str, tenants: Mapping[str, TenantReport]) -> Iterator[Metric]:
    """Per tenant (label ``tenant``): bytes held here, its quotas (on each node, over the pool, this node's
    share of the latter), and what its keys saw."""
    labels = ["node", "tenant"]
    held = GaugeMetricFamily(
        NODE_PREFIX + "tenant_held_bytes", "Payload bytes of a tenant's chunks held.", labels=labels
    )
    quota = GaugeMetricFamily(
        NODE_PREFIX + "tenant_quota_bytes",
        "A tenant's byte quota on this node (kvpool quota); -1: none.",
        labels=labels,
    )
    pool_quota = GaugeMetricFamily(
        NODE_PREFIX + "tenant_pool_quota_bytes",
        "A tenant's byte quota over the pool (kvpool quota --scope pool); -1: none.",
        labels=labels,
    )
    pool_share = GaugeMetricFamily(
        NODE_PREFIX + "tenant_pool_share_bytes",
        "The bytes of a tenant's pool quota this node may hold until its next heartbeat; -1: no pool quota.",
        labels=labels,
    )
    counts = {
        name: CounterMetricFamily(NODE_PREFIX + "tenant_" + name, documentation, labels=labels)
        for name, documentation in (
            ("puts", "A tenant's chunks stored and committed."),
            ("hits", "A tenant's keys a GET found and returned."),
            ("misses", "A tenant's keys a GET did not return."),
            ("quota_evictions", "A tenant's chunks evicted to keep it within its quota."),
        )
    }
    for name, tenant in sorted(tenants.items()):
        held.add_metric([node, name], tenant.held_bytes)
        quota.add_metric([node, name], tenant.quota_bytes)
        pool_quota.add_metric([node, name], tenant.pool_quota_bytes)
        pool_share.add_metric([node, name], tenant.pool_share_bytes)
        for field, family in counts.items():
            family.add_metric([node, name], getattr(tenant, field))
    yield held
    yield quota
    yield pool_quota
    yield pool_share
    yield from counts.values()


def _gauge(name: str, documentation: str, node: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(NODE_PREFIX + name, documentation, labels=["node"])
    family.add_metric([node], value)
    return family


def _node_counters(node: str, counters: Mapping[str, int]) -> Iterator[Metric]:
    values = {str(name): 0 for name in NODE_COUNTERS} | dict(counters)
    for name in sorted(values):
        if not METRIC_NAME.fullmatch(name):
            logger.warning("metrics: node counter %r is not a valid metric name; skipped", name)
            continue
        family = CounterMetricFamily(
            NODE_PREFIX + name, _COUNTER_HELP.get(name, f"Node counter {name}."), labels=["node"]
        )
        family.add_metric([node], values[name])
        yield family


_TIER_GAUGES = {
    "capacity_bytes": "Configured size of the tier.",
    "used_bytes": "Bytes taken in the tier (DRAM: stored plus reserved for puts in flight; NVMe: file sizes).",
    "objects": "Chunks held in the tier.",
    "disk_full": "1 while the disk refuses writes and the node does not demote (NVMe only).",
}


def _tier_gauges(node: str, tiers: Mapping[str, TierReport]) -> Iterator[Metric]:
    for field, documentation in _TIER_GAUGES.items():
        family = GaugeMetricFamily(NODE_PREFIX + "tier_" + field, documentation, labels=["node", "tier"])
        for tier, report in sorted(tiers.items()):
            value = getattr(report, field)  # the gauges are named for TierReport's fields
            if value is not None:
                family.add_metric([node, tier], float(value))
        if family.samples:
            yield family


_RECOVERY_GAUGES = {
    "files": "Chunk files found on NVMe at the last start and adopted so far.",
    "bytes": "Bytes of those files.",
    "indexed": "Of those, chunks whose index entries are written (hits from then on).",
    "progress": "Fraction of the NVMe tier's shard directories scanned (1 once the scan is over).",
    "done": "1 once the last start's recovery is over (every file scanned, adopted and indexed), else 0.",
    "quarantined": "Files quarantined by the last start's scan.",
    "temp_removed": "Temporary files (crash debris) removed by the last start's scan.",
    "seconds": "Duration of the last start's recovery (so far, while it runs).",
}


def _recovery_gauges(node: str, recovery: RecoveryReport) -> Iterator[Metric]:
    for field, documentation in _RECOVERY_GAUGES.items():
        yield _gauge(
            "recovery_" + field, documentation, node, float(getattr(recovery, field))
        )  # RecoveryReport's fields


def _latency_histogram(node: str, latency: Mapping[str, Any]) -> Metric | None:
    """The node's service time per op since it started, in its fixed buckets (``backend.latency``)."""
    family = HistogramMetricFamily(
        NODE_PREFIX + "request_latency_seconds",
        "Service time of successful requests, from header received to reply sent.",
        labels=["node", "op"],
    )
    for op, histogram in sorted(LatencyHistograms.from_json(latency).ops.items()):
        buckets = [("+Inf" if math.isinf(bound) else repr(bound), count) for bound, count in histogram.cumulative()]
        family.add_metric([node, op], buckets, histogram.sum_s)
    return family if family.samples else None
