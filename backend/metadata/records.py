"""What the metadata layer stores: a key's locations, a node's registry record, its id's claim, a heartbeat's
answer, and what Redis says of its memory."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from backend.config.values import format_size
from backend.errors import MetadataError

__all__ = [
    "Beat",
    "ClaimHolder",
    "ClaimHeld",
    "IndexEntry",
    "LiveCopies",
    "Location",
    "NodeInfo",
    "NodeSlots",
    "LiveNamespaces",
    "RedisFacts",
    "RedisMemory",
    "SweepPage",
    "varint",
]


TIER_CODES = {"dram": 0, "nvme": 1}  # a copy's tier, as its index value packs it (two bits)
_TIER_NAMES = {code: name for name, code in TIER_CODES.items()}
_TIER_BITS = 2
CHECKSUM_BYTES = 8  # xxh3-64, big-endian, the last bytes of a value
UNKNOWN_SLOT_PREFIX = "#"  # a copy whose slot no node id holds reads as node "#<slot>" (no node id has a '#')


def varint(number: int) -> bytes:
    """``number`` (>= 0) as an unsigned LEB128 varint: 7 bits a byte, the high bit set on every byte but the last.

    Prefix-free, so a value that starts with an epoch's varint holds that epoch and no other:
    the scripts compare an epoch by comparing bytes."""
    if number < 0:
        raise ValueError(f"varint of a negative number: {number}")
    out = bytearray()
    while number >= 0x80:
        out.append(number & 0x7F | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``data[pos:]`` and the position after it; ValueError if it does not end or is over 63 bits."""
    number = shift = 0
    while pos < len(data) and shift < 63:
        byte = data[pos]
        number |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return number, pos
        shift += 7
    raise ValueError("truncated varint")


def value_bytes(value: str | bytes) -> bytes:
    """An index value as Redis holds it: the client decodes replies as UTF-8 with surrogates for other bytes."""
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


@dataclasses.dataclass(frozen=True)
class Location:
    """One copy of a key: which node and epoch wrote it, on which tier, how big, with which checksum.

    In Redis it is one field of the key's index hash: the field is the node's *slot* (a small
    number the registry gives each node id, ``NodeSlots``), the value is :meth:`encode`'s bytes.
    ``slot`` is where a copy was read from (0: not read from the index; the id's slot is used).
    """

    node_id: str
    epoch: int
    tier: str
    nbytes: int
    checksum: int
    slot: int = dataclasses.field(default=0, compare=False)

    def encode(self) -> bytes:
        """``varint(epoch) varint(nbytes << 2 | tier code) checksum(8, big-endian)``: 14 bytes for a
        1 MiB chunk of a node epoch under 16,384. The epoch first, so that "still this epoch's"
        is a byte prefix; the checksum last, so that "the same bytes" is the value's last 8 bytes."""
        code = TIER_CODES.get(self.tier)
        if code is None:
            raise MetadataError(f"tier {self.tier!r} has no code in the index (known: {', '.join(TIER_CODES)})")
        if not 0 <= self.checksum < 1 << 64 or self.nbytes < 0 or self.epoch < 0:
            raise MetadataError(f"location {self!r} does not fit the index (epoch, size >= 0; checksum of 64 bits)")
        return varint(self.epoch) + varint(self.nbytes << _TIER_BITS | code) + self.checksum.to_bytes(8, "big")

    @classmethod
    def decode(cls, node_id: str, value: str | bytes, slot: int = 0) -> Location:
        """The copy ``value`` describes, on ``node_id`` (read from field ``slot``); MetadataError if malformed."""
        data = value_bytes(value)
        try:
            epoch, pos = _read_varint(data, 0)
            packed, pos = _read_varint(data, pos)
            tier = _TIER_NAMES[packed & (1 << _TIER_BITS) - 1]
            if len(data) - pos != CHECKSUM_BYTES:
                raise ValueError("not 8 checksum bytes after the epoch and the size")
        except (ValueError, KeyError):
            raise MetadataError(f"index entry for node {node_id!r} is malformed: {data!r}") from None
        return cls(node_id, epoch, tier, packed >> _TIER_BITS, int.from_bytes(data[pos:], "big"), slot)

    @property
    def attributed(self) -> bool:
        """Whether the copy names a node id (False: its slot is held by no node id this reader knows)."""
        return not self.node_id.startswith(UNKNOWN_SLOT_PREFIX)


IndexEntry = list[Location]


class NodeSlots:
    """Which node id holds which slot: the short number an index field names a node by.

    The registry gives each node id a slot when it first claims the id (``kvp:{NS}:slots``,
    from a counter, never reused), and the id keeps it across restarts; a reader learns the
    pairs from the registry. A field of 1-2 digits instead of a node id of up to 128
    characters is what keeps an index entry in Redis's compact encoding (a listpack: values
    up to ``hash-max-listpack-value`` 64 bytes) and under 120 bytes per chunk.
    """

    def __init__(self) -> None:
        self._slot_of: dict[str, int] = {}
        self._node_of: dict[int, str] = {}

    def learn(self, node_id: str, slot: int) -> None:
        """``node_id`` holds ``slot`` now (a pair learnt before for either side is dropped)."""
        if slot <= 0 or self._slot_of.get(node_id) == slot:
            return
        old = self._slot_of.pop(node_id, None)
        if old is not None:
            self._node_of.pop(old, None)
        other = self._node_of.pop(slot, None)
        if other is not None:
            self._slot_of.pop(other, None)
        self._slot_of[node_id] = slot
        self._node_of[slot] = node_id

    def slot_of(self, node_id: str) -> int | None:
        """``node_id``'s slot; a ``#<slot>`` id (a copy no node id held when read) names its slot itself."""
        if node_id.startswith(UNKNOWN_SLOT_PREFIX):
            return int(node_id[1:]) if node_id[1:].isdigit() else None
        return self._slot_of.get(node_id)

    def node_of(self, slot: int) -> str:
        """The node id holding ``slot``, or ``#<slot>`` when no id this reader knows holds it."""
        return self._node_of.get(slot) or f"{UNKNOWN_SLOT_PREFIX}{slot}"

    def known(self, slot: int) -> bool:
        return slot in self._node_of

    def slot_for(self, loc: Location) -> int | None:
        """The field ``loc`` lives in: the slot it was read from, else its node id's."""
        return loc.slot or self.slot_of(loc.node_id)


@dataclasses.dataclass(frozen=True)
class SweepPage:
    """One step of a sweep of the index (``KeyIndex.sweep_step``): where the walk goes on, how many index
    keys it looked at, how many fields it removed, and the slots it met that it was told neither live nor
    dead (a node in its grace, one the registry no longer lists, or one too new for the caller's view)."""

    cursor: int
    keys: int
    removed: int
    unknown: frozenset[int]


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


MIN_REDIS_VERSION = (7, 0)  # kvpool's scripts declare flags (`#!lua flags=...`), which Redis 7.0 brought


def redis_version_key(version: str) -> tuple[int, ...]:
    """``"7.0.15"`` -> ``(7, 0, 15)``; what is not a number counts as 0 (so "" is ``(0,)``)."""
    return tuple(int(part) if part.isdigit() else 0 for part in version.split("."))


@dataclasses.dataclass(frozen=True)
class RedisFacts:
    """What Redis says of itself that a pool depends on: its version and its clock."""

    version: str  # redis_version of INFO server, e.g. "7.2.4"
    time_s: float  # Redis's clock (TIME), seconds since the epoch

    @property
    def version_tuple(self) -> tuple[int, ...]:
        """``version`` as numbers ((0,) when Redis did not say)."""
        return redis_version_key(self.version)


@dataclasses.dataclass(frozen=True)
class LiveNamespaces:
    """The namespaces of one Redis that have live nodes, and how many; ``complete`` is False when the
    walk over Redis's keys stopped at its time budget before the end."""

    live: dict[str, int]
    complete: bool = True

    def describe(self) -> str:
        """``'default' (2 live), 'prod' (1 live)``, or ``none``."""
        shown = ", ".join(f"{name!r} ({count} live)" for name, count in sorted(self.live.items())) or "none"
        return shown if self.complete else f"{shown} (Redis holds more keys than were searched)"


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
    eviction: str = "lru"  # the node's eviction order (--eviction); an entry of an older build has none: lru
    # The node keeps an event ring that takes a put's token records (docs/fleet-events.md); an older build's entry
    # has none: clients send it no tokens, which it would refuse.
    event_tokens: bool = False
    draining: bool = False  # filled by NodeRegistry.nodes() from the draining set
    alive: bool = False  # filled by NodeRegistry.nodes(), never stored
    slot: int = 0  # the node's field in index entries (NodeSlots): filled by NodeRegistry.nodes(), 0 if none

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
    def takes_touches(self) -> bool:
        """Whether the node's eviction order uses what lookups found (every order but lru: the prefix orders
        count lookups as reads); a client with ``touch=auto`` tells only these nodes."""
        return self.eviction != "lru"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data.pop("alive")
        data.pop("slot")  # kept in the slots hash, which the id keeps across restarts
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
