"""STAT: what a node reports about itself, as frozen dataclasses that are the JSON on the wire.

STAT's answer is JSON (``encode_json``: keys sorted). Each part is a frozen dataclass with
``to_json`` (the JSON object it is on the wire) and ``from_json`` (that object, checked:
ProtocolError naming the field that is wrong). Fields a node of an older version may
not send (arena, recovery, latency) decode to None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.errors import ProtocolError
from backend.protocol.meta import decode_json, encode_json

__all__ = [
    "TierReport",
    "tiers_from_json",
    "ArenaReport",
    "RecoveryReport",
    "RepublishReport",
    "RecentReport",
    "NodeReport",
    "TenantReport",
    "encode_node_report",
    "decode_node_report",
]


def _field(body: Any, name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """``body[name]``, of one of ``kinds`` (never a bool where a number is wanted)."""
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise ProtocolError(f"{what}: {name!r} is {str(value)[:80]}, not {_kind_names(kinds)}")
    return value


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kinds))


_NUMBER = (int, float)


@dataclass(frozen=True)
class TierReport:
    """One tier of a node (``dram``, ``nvme``): its size, what it holds; ``disk_full`` for NVMe only."""

    capacity_bytes: int
    used_bytes: int
    objects: int
    disk_full: bool | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"capacity_bytes": self.capacity_bytes}  # keys in sorted order, as on the wire
        if self.disk_full is not None:
            out["disk_full"] = self.disk_full
        out["objects"] = self.objects
        out["used_bytes"] = self.used_bytes
        return out

    @classmethod
    def from_json(cls, body: Any) -> TierReport:
        what = "a node's tier"
        disk_full = body.get("disk_full") if isinstance(body, dict) else None
        if disk_full is not None and not isinstance(disk_full, bool):
            raise ProtocolError(f"{what}: 'disk_full' is {str(disk_full)[:80]}, not bool")
        return cls(
            _field(body, "capacity_bytes", int, what),
            _field(body, "used_bytes", int, what),
            _field(body, "objects", int, what),
            disk_full,
        )


def tiers_from_json(body: Any) -> dict[str, TierReport]:
    """A node's ``tiers`` object: tier name -> :class:`TierReport`."""
    if not isinstance(body, dict):
        raise ProtocolError(f"a node's tiers are {str(body)[:80]}, not an object")
    return {str(name): TierReport.from_json(tier) for name, tier in body.items()}


@dataclass(frozen=True)
class ArenaReport:
    """A node's DRAM arena: where it is, its size, how much is backed by memory and in use."""

    path: str
    size_bytes: int
    grown_bytes: int
    allocated_bytes: int
    fallbacks: int  # chunks that found no room in the arena and took a private buffer

    def to_json(self) -> dict[str, Any]:
        return {
            "allocated_bytes": self.allocated_bytes,
            "fallbacks": self.fallbacks,
            "grown_bytes": self.grown_bytes,
            "path": self.path,
            "size_bytes": self.size_bytes,
        }

    @classmethod
    def from_json(cls, body: Any) -> ArenaReport:
        what = "a node's arena"
        return cls(
            _field(body, "path", str, what),
            _field(body, "size_bytes", int, what),
            _field(body, "grown_bytes", int, what),
            _field(body, "allocated_bytes", int, what),
            _field(body, "fallbacks", int, what),
        )


@dataclass(frozen=True)
class RecoveryReport:
    """The NVMe tier's recovery at a node's start, so far: files adopted, their bytes, files set aside, time taken.

    Recovery runs in the background while the node serves (``backend.node.index.recovery``):
    ``progress`` is the fraction of the tier's shard directories scanned, ``indexed`` the
    adopted chunks whose index entries are written, ``done`` whether it has finished. A node
    of an earlier version recovered before it served: absent, they read as finished.
    """

    files: int = 0
    bytes: int = 0
    quarantined: int = 0
    temp_removed: int = 0
    seconds: float = 0.0
    indexed: int = 0
    progress: float = 1.0
    done: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "done": self.done,
            "files": self.files,
            "indexed": self.indexed,
            "progress": self.progress,
            "quarantined": self.quarantined,
            "seconds": self.seconds,
            "temp_removed": self.temp_removed,
        }

    @classmethod
    def from_json(cls, body: Any) -> RecoveryReport:
        what = "a node's recovery"
        files = _field(body, "files", int, what)
        return cls(
            files,
            _field(body, "bytes", int, what),
            _field(body, "quarantined", int, what),
            _field(body, "temp_removed", int, what),
            float(_field(body, "seconds", _NUMBER, what)),
            _field(body, "indexed", int, what) if "indexed" in body else files,
            float(_field(body, "progress", _NUMBER, what)) if "progress" in body else 1.0,
            _field(body, "done", bool, what) if "done" in body else True,
        )


@dataclass(frozen=True)
class RepublishReport:
    """A node's republish of its holdings after Redis lost them (``backend.node.index.republish``).

    ``running`` while a walk is under way; ``pending``: chunks it has yet to publish (an
    estimate: those held when it began, less those published since); ``published`` and
    ``seconds``: the current (else the last) walk's chunks published and time taken.
    """

    running: bool = False
    pending: int = 0
    published: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"pending": self.pending, "published": self.published, "running": self.running, "seconds": self.seconds}

    @classmethod
    def from_json(cls, body: Any) -> RepublishReport:
        what = "a node's republish"
        return cls(
            _field(body, "running", bool, what),
            _field(body, "pending", int, what),
            _field(body, "published", int, what),
            float(_field(body, "seconds", _NUMBER, what)),
        )


@dataclass(frozen=True)
class RecentReport:
    """A node's requests, gets and hits over its recent window (``window_s``)."""

    window_s: float
    requests_per_s: float
    gets: int
    hits: int

    def to_json(self) -> dict[str, Any]:
        return {"gets": self.gets, "hits": self.hits, "requests_per_s": self.requests_per_s, "window_s": self.window_s}

    @classmethod
    def from_json(cls, body: Any) -> RecentReport:
        what = "a node's recent figures"
        return cls(
            _field(body, "window_s", _NUMBER, what),
            _field(body, "requests_per_s", _NUMBER, what),
            _field(body, "gets", int, what),
            _field(body, "hits", int, what),
        )


@dataclass(frozen=True)
class TenantReport:
    """One tenant on one node: its bytes held, its quota on each node (-1: none), its quota over the pool
    and this node's share of it (-1: none), and what its keys saw."""

    held_bytes: int
    quota_bytes: int
    puts: int
    hits: int
    misses: int
    quota_evictions: int = 0
    pool_quota_bytes: int = -1
    pool_share_bytes: int = -1

    def to_json(self) -> dict[str, Any]:
        body = {
            "held_bytes": self.held_bytes,
            "quota_bytes": self.quota_bytes,
            "puts": self.puts,
            "hits": self.hits,
            "misses": self.misses,
            "quota_evictions": self.quota_evictions,
        }
        if self.pool_quota_bytes >= 0:  # a tenant without a pool quota is answered as before pool quotas
            body |= {"pool_quota_bytes": self.pool_quota_bytes, "pool_share_bytes": self.pool_share_bytes}
        return body

    @classmethod
    def from_json(cls, body: Any) -> TenantReport:
        what = "STAT tenant"
        fields = [
            _field(body, name, int, what)
            for name in ("held_bytes", "quota_bytes", "puts", "hits", "misses", "quota_evictions")
        ]
        # Absent: no pool quota (or a node of the release before pool quotas).
        pool = [
            _field(body, name, int, what) if name in body else -1 for name in ("pool_quota_bytes", "pool_share_bytes")
        ]
        return cls(*fields, *pool)


@dataclass(frozen=True)
class NodeReport:
    """STAT's answer: a node's identity, counters, tiers, arena, recovery, republish, recent rates and latency.

    ``latency`` is ``backend.latency.LatencyHistograms.to_json()`` as it is (read it with
    ``LatencyHistograms.from_json``, which checks it); None from a node that keeps none.
    """

    node_id: str
    epoch: int
    uptime_s: float
    counters: dict[str, int]
    objects: int
    leases: int
    tiers: dict[str, TierReport]
    recent: RecentReport
    arena: ArenaReport | None = None
    recovery: RecoveryReport | None = None
    latency: dict[str, Any] | None = None
    republish: RepublishReport | None = None
    pinned_chunks: int = 0  # chunks held now under a pin (PIN), and their bytes
    pinned_bytes: int = 0
    tenants: dict[str, TenantReport] = field(default_factory=dict)  # per tenant with bytes, a quota or counts

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "epoch": self.epoch,
            "uptime_s": self.uptime_s,
            "counters": dict(self.counters),
            "objects": self.objects,
            "leases": self.leases,
            "arena": self.arena.to_json() if self.arena is not None else None,
            "tiers": {name: tier.to_json() for name, tier in self.tiers.items()},
            "recovery": self.recovery.to_json() if self.recovery is not None else None,
            "latency": self.latency,
            "recent": self.recent.to_json(),
            "republish": self.republish.to_json() if self.republish is not None else None,
            "pinned_chunks": self.pinned_chunks,
            "pinned_bytes": self.pinned_bytes,
            "tenants": {name: tenant.to_json() for name, tenant in self.tenants.items()},
        }

    @classmethod
    def from_json(cls, body: Any) -> NodeReport:
        what = "STAT answer"
        counters = _field(body, "counters", dict, what)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in counters.values()):
            raise ProtocolError(f"{what}: a counter is not an integer")
        arena, recovery, latency = body.get("arena"), body.get("recovery"), body.get("latency")
        republish = body.get("republish")
        if latency is not None and not isinstance(latency, dict):
            raise ProtocolError(f"{what}: 'latency' is {str(latency)[:80]}, not an object")
        return cls(
            node_id=_field(body, "node_id", str, what),
            epoch=_field(body, "epoch", int, what),
            uptime_s=_field(body, "uptime_s", _NUMBER, what),
            counters={str(k): v for k, v in counters.items()},
            objects=_field(body, "objects", int, what),
            leases=_field(body, "leases", int, what) if "leases" in body else 0,
            tiers=tiers_from_json(body.get("tiers")),
            recent=RecentReport.from_json(body.get("recent")),
            arena=ArenaReport.from_json(arena) if arena is not None else None,
            recovery=RecoveryReport.from_json(recovery) if recovery is not None else None,
            latency=latency,
            republish=RepublishReport.from_json(republish) if republish is not None else None,
            # absent from a node of an earlier version, which pins nothing
            pinned_chunks=_field(body, "pinned_chunks", int, what) if "pinned_chunks" in body else 0,
            pinned_bytes=_field(body, "pinned_bytes", int, what) if "pinned_bytes" in body else 0,
            tenants=_tenants_from_json(body.get("tenants")),  # absent from a node of an earlier version
        )


def _tenants_from_json(body: Any) -> dict[str, TenantReport]:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ProtocolError(f"STAT answer: 'tenants' is {str(body)[:80]}, not an object")
    return {str(name): TenantReport.from_json(tenant) for name, tenant in body.items()}


def encode_node_report(report: NodeReport) -> bytes:
    """Meta of a STAT answer."""
    return encode_json(report.to_json())


def decode_node_report(meta: bytes | bytearray | memoryview) -> NodeReport:
    """A STAT answer, checked field by field."""
    return NodeReport.from_json(decode_json(meta))
