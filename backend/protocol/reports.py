"""STAT and PING: what a node reports about itself, as frozen dataclasses that are the JSON on the wire.

STAT's answer is JSON (``encode_json``: keys sorted). Each part is a frozen dataclass and a
:class:`~backend.protocol.json_codec.JsonReport`: one codec makes it its JSON object and reads
it back, checking every field (ProtocolError naming the field that is wrong, missing or
unknown). Fields a node of an older version may not send (arena, recovery, latency) decode to None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from backend.errors import ProtocolError
from backend.protocol.frame import Op, OpCodec
from backend.protocol.json_codec import JsonReport, read_json, wire
from backend.protocol.meta import EmptyRequest, decode_json, encode_json

__all__ = [
    "TierReport",
    "tiers_from_json",
    "ArenaReport",
    "RecoveryReport",
    "RepublishReport",
    "RecentReport",
    "NodeReport",
    "TenantReport",
    "Stat",
    "Ping",
]


@dataclass(frozen=True)
class TierReport(JsonReport):
    """One tier of a node (``dram``, ``nvme``): its size, what it holds; ``disk_full`` for NVMe only."""

    what: ClassVar[str] = "a node's tier"

    capacity_bytes: int
    used_bytes: int
    objects: int
    disk_full: bool | None = field(default=None, metadata=wire(absent=None, omit_default=True))


def tiers_from_json(body: Any) -> dict[str, TierReport]:
    """A node's ``tiers`` object (in STAT and in its registry entry): tier name -> :class:`TierReport`."""
    tiers: dict[str, TierReport] = read_json(dict[str, TierReport], body, "a node's tiers")
    return tiers


@dataclass(frozen=True)
class ArenaReport(JsonReport):
    """A node's DRAM arena: where it is, its size, how much is backed by memory and in use."""

    what: ClassVar[str] = "a node's arena"

    path: str
    size_bytes: int
    grown_bytes: int
    allocated_bytes: int
    fallbacks: int  # chunks that found no room in the arena and took a private buffer


@dataclass(frozen=True)
class RecoveryReport(JsonReport):
    """The NVMe tier's recovery at a node's start, so far: files adopted, their bytes, files set aside, time taken.

    Recovery runs in the background while the node serves (``backend.node.index.recovery``):
    ``progress`` is the fraction of the tier's shard directories scanned, ``indexed`` the
    adopted chunks whose index entries are written, ``done`` whether it has finished. A node
    of an earlier version recovered before it served: absent, they read as finished.
    """

    what: ClassVar[str] = "a node's recovery"

    files: int = 0
    bytes: int = 0
    quarantined: int = 0
    temp_removed: int = 0
    seconds: float = 0.0
    indexed: int = field(default=0, metadata=wire(absent_as="files"))
    progress: float = field(default=1.0, metadata=wire(absent=1.0))
    done: bool = field(default=True, metadata=wire(absent=True))


@dataclass(frozen=True)
class RepublishReport(JsonReport):
    """A node's republish of its holdings after Redis lost them (``backend.node.index.republish``).

    ``running`` while a walk is under way; ``pending``: chunks it has yet to publish (an
    estimate: those held when it began, less those published since); ``published`` and
    ``seconds``: the current (else the last) walk's chunks published and time taken.
    """

    what: ClassVar[str] = "a node's republish"

    running: bool = False
    pending: int = 0
    published: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RecentReport(JsonReport):
    """A node's requests, gets and hits over its recent window (``window_s``)."""

    what: ClassVar[str] = "a node's recent figures"

    window_s: float
    requests_per_s: float
    gets: int
    hits: int


@dataclass(frozen=True)
class TenantReport(JsonReport):
    """One tenant on one node: its bytes held, its quota on each node (-1: none), its quota over the pool
    and this node's share of it (-1: none), and what its keys saw."""

    what: ClassVar[str] = "STAT tenant"

    held_bytes: int
    quota_bytes: int
    puts: int
    hits: int
    misses: int
    quota_evictions: int = 0
    # Left out for a tenant without a pool quota (as before pool quotas), and absent: none.
    pool_quota_bytes: int = field(default=-1, metadata=wire(absent=-1, omit_default=True))
    pool_share_bytes: int = field(default=-1, metadata=wire(absent=-1, omit_default=True))


@dataclass(frozen=True)
class NodeReport(JsonReport):
    """STAT's answer: a node's identity, counters, tiers, arena, recovery, republish, recent rates and latency.

    ``latency`` is ``backend.latency.LatencyHistograms.to_json()`` as it is (read it with
    ``LatencyHistograms.from_json``, which checks it); None from a node that keeps none.
    Absent from a node of an earlier version: ``leases`` (0), what it did not keep (None),
    its pins (0) and tenants (none).
    """

    what: ClassVar[str] = "STAT answer"

    node_id: str
    epoch: int
    uptime_s: float
    counters: dict[str, int]
    objects: int
    leases: int = field(metadata=wire(absent=0))
    tiers: dict[str, TierReport]
    recent: RecentReport
    arena: ArenaReport | None = field(default=None, metadata=wire(absent=None))
    recovery: RecoveryReport | None = field(default=None, metadata=wire(absent=None))
    latency: dict[str, Any] | None = field(default=None, metadata=wire(absent=None))
    republish: RepublishReport | None = field(default=None, metadata=wire(absent=None))
    pinned_chunks: int = field(default=0, metadata=wire(absent=0))  # chunks held now under a pin (PIN), and their bytes
    pinned_bytes: int = field(default=0, metadata=wire(absent=0))
    # per tenant with bytes, a quota or counts
    tenants: dict[str, TenantReport] = field(default_factory=dict, metadata=wire(absent={}))


class Stat(EmptyRequest, OpCodec):
    """STAT: an empty request, answered with the node's :class:`NodeReport`."""

    op = Op.STAT

    @staticmethod
    def encode_answer(report: NodeReport) -> bytes:
        """Meta of a STAT answer."""
        return encode_json(report.to_json())

    @staticmethod
    def decode_answer(meta: bytes | bytearray | memoryview) -> NodeReport:
        """A STAT answer, checked field by field."""
        return NodeReport.from_json(decode_json(meta))


class Ping(EmptyRequest, OpCodec):
    """PING: an empty request, answered with the node's id and epoch (a client's check that the node is up)."""

    op = Op.PING

    @staticmethod
    def encode_answer(node_id: str, epoch: int) -> bytes:
        return encode_json({"node_id": node_id, "epoch": epoch})

    @staticmethod
    def decode_answer(meta: bytes | bytearray | memoryview) -> tuple[str, int]:
        """``(node_id, epoch)`` of a PING answer."""
        body = decode_json(meta)
        node_id, epoch = body.get("node_id"), body.get("epoch")
        if not isinstance(node_id, str) or not isinstance(epoch, int) or isinstance(epoch, bool):
            raise ProtocolError(f"PING answer wants {{node_id: str, epoch: int}}, not {str(body)[:80]}")
        return node_id, epoch
