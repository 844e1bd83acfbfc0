"""What the metadata layer stores: a key's locations, a node's registry record, its id's claim, a heartbeat's
answer, and what Redis says of its memory."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from backend.config.values import format_size
from backend.errors import MetadataError

__all__ = ["Beat", "ClaimHolder", "ClaimHeld", "IndexEntry", "LiveCopies", "Location", "NodeInfo", "RedisMemory"]


@dataclasses.dataclass(frozen=True)
class Location:
    """One copy of a key: which node and epoch wrote it, on which tier, how big, when."""

    node_id: str
    epoch: int
    tier: str
    nbytes: int
    checksum: int
    written_at: int = dataclasses.field(default_factory=lambda: int(time.time()), compare=False)

    def encode(self) -> str:
        return f"{self.epoch}|{self.tier}|{self.nbytes}|{self.checksum}|{self.written_at}"

    @classmethod
    def decode(cls, node_id: str, value: str) -> Location:
        try:
            epoch, tier, nbytes, item_sum, written_at = value.split("|")
            return cls(node_id, int(epoch), tier, int(nbytes), int(item_sum), int(written_at))
        except ValueError:
            raise MetadataError(f"index entry for node {node_id!r} is malformed: {value!r}") from None


IndexEntry = list[Location]


@dataclasses.dataclass(frozen=True)
class LiveCopies:
    """An index read against the node epochs a client holds live (``LiveLookup.lookup_live``).

    ``hits``: one flag per key examined, in order; every key for a full lookup, and for a
    prefix lookup the keys up to and including the first with no live copy.
    ``copies``: each examined key's live copies (empty lists when they were not asked for).
    ``others``: copies outside the live set (dead node, old epoch, or a node the view has
    not seen yet), as ``(key position, copy)``: what a reader may clean or re-check.
    """

    hits: list[bool]
    copies: list[IndexEntry]
    others: list[tuple[int, Location]]

    @property
    def prefix(self) -> int:
        """How many keys from the start have a live copy."""
        return self.hits.index(False) if False in self.hits else len(self.hits)

    @classmethod
    def missing(cls, count: int) -> LiveCopies:
        """Every one of ``count`` keys missing (what a lookup reads as while Redis is down)."""
        return cls([False] * count, [[] for _ in range(count)], [])


@dataclasses.dataclass(frozen=True)
class ClaimHolder:
    """Which process holds a node id: written beside the id's heartbeat, expiring with it, so that a
    node refused the id can say who holds it."""

    epoch: int
    host: str = ""
    port: int = 0
    pid: int = 0
    hostname: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, epoch: int, text: str) -> ClaimHolder:
        """The holder of ``epoch`` as ``text`` describes it; only the epoch when ``text`` is missing,
        malformed, or describes another epoch."""
        try:
            data = json.loads(text) if text else {}
            holder = cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
        except (ValueError, TypeError):
            return cls(epoch)
        return holder if holder.epoch == epoch else cls(epoch)

    def describe(self) -> str:
        if not self.host:
            return f"epoch {self.epoch}"
        return f"epoch {self.epoch} at {self.host}:{self.port} (pid {self.pid} on {self.hostname or 'an unknown host'})"


@dataclasses.dataclass(frozen=True)
class ClaimHeld:
    """A node id's claim as another process holds it: its holder, and how long its heartbeat has left."""

    holder: ClaimHolder
    ttl_left_ms: int  # the heartbeat key's PTTL: a renewal makes it grow


@dataclasses.dataclass(frozen=True)
class Beat:
    """What a heartbeat found: the namespace marker's generation (None if missing), whether the
    node's registry entry had to be created (a live node collected it as dead), and, when another
    process holds the node's id (its beat lapsed and the id was claimed anew), that process:
    the beat then wrote nothing."""

    generation: str | None
    registered_anew: bool
    lost_to: ClaimHolder | None = None


@dataclasses.dataclass(frozen=True)
class RedisMemory:
    """Redis's memory as ``INFO memory`` reports it, and whether it is full: at ``maxmemory`` under a
    policy that evicts nothing (``noeviction``), so that it refuses writes that need memory."""

    used_bytes: int
    max_bytes: int  # 0: no limit
    policy: str

    @property
    def full(self) -> bool:
        return 0 < self.max_bytes <= self.used_bytes and self.policy == "noeviction"

    def describe(self) -> str:
        """The figures, e.g. ``used_memory 3.2 MiB of maxmemory 3.0 MiB (maxmemory-policy noeviction)``."""
        if not self.max_bytes:
            return f"used_memory {format_size(self.used_bytes)}, no maxmemory"
        return (
            f"used_memory {format_size(self.used_bytes)} of maxmemory {format_size(self.max_bytes)} "
            f"(maxmemory-policy {self.policy})"
        )


@dataclasses.dataclass
class NodeInfo:
    """A pool node as the registry knows it."""

    node_id: str
    host: str
    port: int
    epoch: int
    cluster: str = ""
    hostname: str = ""
    pid: int = 0
    started_at: float = 0.0
    capacity_bytes: int = 0
    used_bytes: int = 0
    object_count: int = 0
    tiers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    heartbeat_at: float = 0.0
    shm_path: str = ""  # the node's shared-memory arena, readable by same-host clients
    shm_token: str = ""  # written in the arena's header: proves a client opened this node's file
    channel: str = ""  # channel transport this node serves ("nccl", "cpu"), empty if none
    tls: bool = False  # the node protocol is served over TLS only
    draining: bool = False  # filled by MetadataStore.nodes() from the draining set
    alive: bool = False  # filled by MetadataStore.nodes(), never stored

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)

    def view(self) -> tuple[Any, ...]:
        """What clients keep of this node; when it changes, the registry version is bumped.

        Load counts in tenths of capacity: clients weigh placement and pick replicas by
        it, and it moves on every put, far more often than it matters.
        """
        tenth = self.used_bytes * 10 // self.capacity_bytes if self.capacity_bytes else 0
        return (
            self.epoch,
            self.host,
            self.port,
            self.cluster,
            self.channel,
            self.tls,
            self.shm_path,
            self.shm_token,
            self.capacity_bytes,
            tenth,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data.pop("alive")
        data.pop("draining")  # kept in the draining set, so heartbeats cannot undo a drain
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeInfo:
        try:
            data = json.loads(text)
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (ValueError, TypeError) as exc:
            raise MetadataError(f"registry entry is malformed: {exc}") from None
