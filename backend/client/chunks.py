"""What a client stores and hands back: chunks, sinks, leases (``Lock``), and a read's typed outcome.

A get puts bytes into buffers that a *sink* hands out, so the LMCache connector
receives straight into LMCache's own memory. Every reader answers each key with one
:data:`Outcome`, never with ``None``, a sentinel or an exception object in a list.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, Protocol, TypeVar, Union

from backend.errors import KVPoolError, ProtocolError
from backend.protocol import ItemMeta
from backend.protocol.meta import ANY_FINGERPRINT, NO_FINGERPRINT, OtherLayout, check_item
from backend.protocol.tokens import ChunkTokens
from backend.transport import Buffer

__all__ = [
    "Chunk",
    "Fetched",
    "Lock",
    "Sink",
    "BytesSink",
    "Wanted",
    "Hit",
    "Miss",
    "OtherLayout",
    "Declined",
    "Fallback",
    "Failed",
    "Outcome",
    "MISS",
    "DECLINED",
    "allocate_view",
    "release_hits",
    "sink_fingerprint",
    "layout_differs",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One value to store: bytes plus the tensor layout they will be rebuilt with, and the layout fingerprint of
    the engine that wrote them (0: none; only a reader of the same fingerprint gets the bytes back)."""

    key: str
    data: Buffer
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    fmt: int = 0
    fingerprint: int = NO_FINGERPRINT
    # The chunk's token ids and parent hash, for the nodes' event rings (docs/fleet-events.md); None: none.
    tokens: ChunkTokens | None = None

    def layout(self) -> ItemMeta:
        """The chunk's meta without its checksum (0), after checking the key, size and layout
        against the protocol's limits: a value no node would take is refused before it is hashed."""
        nbytes = memoryview(self.data).nbytes
        item = ItemMeta(self.key, nbytes, 0, self.dtype, self.shape or (nbytes,), self.fmt, self.fingerprint)
        check_item(item)
        return item


@dataclasses.dataclass(frozen=True)
class Lock:
    """A lease on one key, taken on its node by :meth:`PoolClient.lock` until unlocked or its ttl ends.

    The public name says lock: a lock *is* a lease (the node's LEASE, ``lease_id``).
    """

    key: str
    node_id: str
    lease_id: int
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A chunk read back with :class:`BytesSink`."""

    meta: ItemMeta
    data: bytearray


class Sink(Protocol[T]):  # type: ignore[misc]
    """Where a get puts bytes: hands out a buffer per item, takes it back on failure.

    ``allocate`` runs on the client's event loop; None means no room this time. A sink may
    name the layout fingerprint its buffers are for (``fingerprint``, see :func:`sink_fingerprint`):
    only chunks stored with that fingerprint are read into them.
    """

    async def allocate(self, meta: ItemMeta) -> tuple[T, Buffer] | None: ...

    def release(self, handle: T) -> None: ...


def sink_fingerprint(sink: Sink[Any]) -> int:
    """The layout fingerprint a read into ``sink`` asks for: its ``fingerprint``; a sink that names none
    reads chunks stored without one (``NO_FINGERPRINT``)."""
    return int(getattr(sink, "fingerprint", NO_FINGERPRINT))


def layout_differs(wanted: int, item: ItemMeta) -> bool:
    """Whether a found ``item`` was stored with another layout fingerprint than the read asked for
    (``wanted``, its sink's: :func:`sink_fingerprint`, taken once per read): a node checks this itself;
    the client checks again, so that no path hands such bytes to a sink."""
    return wanted != ANY_FINGERPRINT and item.fingerprint != wanted


class BytesSink:
    """The default sink: a fresh bytearray per item. ``fingerprint``: the layout fingerprint it reads
    (``ANY_FINGERPRINT``: every chunk, whatever its fingerprint, as an admin copy does)."""

    def __init__(self, fingerprint: int = NO_FINGERPRINT) -> None:
        self.fingerprint = fingerprint

    async def allocate(self, meta: ItemMeta) -> tuple[Fetched, Buffer] | None:
        data = bytearray(meta.nbytes)
        return Fetched(meta, data), data

    def release(self, handle: Fetched) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Wanted:
    """A key to read from one node, with the size its index entry recorded."""

    key: str
    nbytes: int


# -- a read's outcome, per key ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hit(Generic[T]):
    """The chunk is in the sink's buffer ``handle``, verified against its ``checksum`` (0: not reported)."""

    handle: T
    checksum: int = 0


@dataclasses.dataclass(frozen=True)
class Miss:
    """The node does not hold the key: its index entry is stale."""


@dataclasses.dataclass(frozen=True)
class Declined:
    """The sink had no room: a miss for this call only; the copy itself is fine."""


@dataclasses.dataclass(frozen=True)
class Fallback:
    """This path cannot serve the key now; the node's next path (in the end TCP) should."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Failed:
    """The read failed: an ``IntegrityError`` means that copy is bad, anything else the node failed."""

    error: KVPoolError


MISS = Miss()
DECLINED = Declined()
# OtherLayout (backend.protocol): the node holds the key stored with another layout fingerprint than the
# reader's: a miss for this reader, the copy itself is fine (its index entry stays).
Outcome = Union[Hit[Any], Miss, OtherLayout, Declined, Fallback, Failed]


async def allocate_view(sink: Sink[T], item: ItemMeta) -> tuple[T, memoryview] | None:
    """A buffer of exactly ``item.nbytes`` from ``sink`` as a byte view; None when it has no room.

    ProtocolError (the buffer handed back) if the sink gave another size.
    """
    allocated = await sink.allocate(item)
    if allocated is None:
        return None
    handle, buffer = allocated
    view = memoryview(buffer).cast("B")
    if len(view) != item.nbytes:
        sink.release(handle)
        raise ProtocolError(f"sink gave {len(view)} bytes for a {item.nbytes}-byte item")
    return handle, view


def release_hits(sink: Sink[Any], outcomes: list[Outcome]) -> None:
    """Give back every buffer held by a hit (the read was abandoned or failed)."""
    for outcome in outcomes:
        if isinstance(outcome, Hit):
            sink.release(outcome.handle)
