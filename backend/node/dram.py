"""DRAM tier: a byte-bounded LRU of complete, verified chunks."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Container, Iterator

from backend.errors import CapacityError
from backend.node.bookkeeping import IN_DRAM, HeldKeys
from backend.node.buffers import ChunkBuffer
from backend.protocol import ItemMeta

__all__ = ["DramTier", "StoredChunk"]

TIER_NAME = "dram"


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """A chunk's bytes and the metadata it was stored with. Buffers are never mutated."""

    meta: ItemMeta
    buffer: ChunkBuffer


class DramTier:
    """An LRU map of chunks bounded by ``capacity_bytes``.

    Space is *reserved* before a chunk's bytes are received (so memory never exceeds
    the bound while a put is in flight), then the chunk is inserted or the
    reservation released. What leaves the tier when it is full (demotion to NVMe or
    eviction) is the tier manager's decision (``backend.node.tiers``).

    Each chunk a put brought (or found already here) is marked with that put's id, so a
    put never evicts its own chunks to make room for itself (``oldest(keep_put=...)``).
    """

    name = TIER_NAME

    def __init__(self, capacity_bytes: int, held: HeldKeys | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError("DRAM capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self._held = held if held is not None else HeldKeys()  # told of every key entering or leaving
        self._chunks: OrderedDict[str, StoredChunk] = OrderedDict()
        self._put_of: dict[str, int] = {}  # key -> id of the put that last stored or found it
        self._stored_bytes = 0
        self._reserved_bytes = 0

    @property
    def used_bytes(self) -> int:
        return self._stored_bytes + self._reserved_bytes

    @property
    def stored_bytes(self) -> int:
        return self._stored_bytes

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: str) -> bool:
        return key in self._chunks

    def keys(self) -> list[str]:
        return list(self._chunks)

    def items(self) -> Iterator[tuple[str, StoredChunk]]:
        return iter(list(self._chunks.items()))

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def reserve(self, nbytes: int) -> None:
        """Reserve ``nbytes`` for a chunk about to arrive; CapacityError if it does not fit now."""
        if not self.fits(nbytes):
            raise CapacityError(
                f"DRAM tier full: {nbytes} bytes do not fit ({self.used_bytes} of {self.capacity_bytes} used)"
            )
        self._reserved_bytes += nbytes

    def oldest(self, skip: Container[str] = (), keep_put: int = 0) -> StoredChunk | None:
        """The least recently used chunk whose key is not in ``skip`` nor marked by put ``keep_put``,
        without touching recency."""
        put_of = self._put_of
        return next(
            (c for k, c in self._chunks.items() if k not in skip and not (keep_put and put_of.get(k) == keep_put)), None
        )

    def put_of(self, key: str) -> int:
        """The id of the put that last stored or found ``key`` here (0: none)."""
        return self._put_of.get(key, 0)

    def claim(self, key: str, put_id: int) -> None:
        """Mark ``key`` (held here) as part of put ``put_id``: that put will not evict it."""
        if key in self._chunks:
            self._put_of[key] = put_id

    def peek(self, key: str) -> StoredChunk | None:
        """The chunk for ``key`` without touching its recency."""
        return self._chunks.get(key)

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose put did not complete."""
        self._reserved_bytes -= nbytes

    def insert(self, chunk: StoredChunk, put_id: int = 0) -> None:
        """Store a chunk whose space was reserved (by put ``put_id``, 0: none); replaces an older copy."""
        self._reserved_bytes -= chunk.meta.nbytes
        if put_id:
            self._put_of[chunk.meta.key] = put_id
        else:
            self._put_of.pop(chunk.meta.key, None)
        old = self._chunks.pop(chunk.meta.key, None)
        if old is not None:
            self._stored_bytes -= old.meta.nbytes
        else:
            self._held.add(chunk.meta.key, IN_DRAM)
        self._chunks[chunk.meta.key] = chunk
        self._stored_bytes += chunk.meta.nbytes

    def get(self, key: str) -> StoredChunk | None:
        """The chunk for ``key`` (marked most recently used), or None."""
        chunk = self._chunks.get(key)
        if chunk is not None:
            self._chunks.move_to_end(key)
        return chunk

    def delete(self, key: str) -> StoredChunk | None:
        chunk = self._chunks.pop(key, None)
        if chunk is not None:
            self._stored_bytes -= chunk.meta.nbytes
            self._put_of.pop(key, None)
            self._held.remove(key, IN_DRAM)
        return chunk
