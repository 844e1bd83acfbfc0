"""Chunks of puts in flight, and the puts that wait for DRAM room while those hold it.

A put inserts each verified chunk into DRAM at once, but readers find it only after
the put's index commit. Until then the chunk *lands*: it is never moved (demoted or
evicted: it is out of the eviction orders, as a leased chunk is), since its put would then acknowledge a chunk it lost, unless its own put
waits for room itself (then it lets its chunks go: see ``TierManager.reserve``). A
put that finds DRAM full of landing chunks and reservations waits here until one of
them settles, lands, is given back, or a chunk leaves DRAM, bounded by its deadline.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from backend.node.memory.arena import room_of
from backend.node.store.dram import StoredChunk

__all__ = ["Landing"]


class Landing:
    """The chunks inserted by puts not committed yet, and the waiters for room. Event loop only."""

    def __init__(self, on_pin: Callable[[str], None] | None = None) -> None:
        self._chunks: dict[int, StoredChunk] = {}  # by id(chunk)
        self.keys: Counter[str] = Counter()  # what the demoter must not move
        self._on_pin = on_pin  # told of each key that starts or stops landing
        self.nbytes = 0  # the DRAM room they occupy
        self._room = asyncio.Event()  # set when DRAM may have room for a waiting put

    def add(self, chunk: StoredChunk) -> None:
        """``chunk`` was inserted by a put that has not committed: it stays until ``settle``."""
        self._chunks[id(chunk)] = chunk
        key = chunk.meta.key
        self.keys[key] += 1
        self.nbytes += room_of(chunk.meta.nbytes)
        if self.keys[key] == 1 and self._on_pin is not None:
            self._on_pin(key)

    def settle(self, chunks: list[StoredChunk]) -> None:
        """The puts that inserted ``chunks`` committed, gave up, or wait: the chunks may move now."""
        for chunk in chunks:
            if self._chunks.pop(id(chunk), None) is not None:
                key = chunk.meta.key
                self.keys[key] -= 1
                if not self.keys[key]:
                    del self.keys[key]
                    if self._on_pin is not None:
                        self._on_pin(key)
                self.nbytes -= room_of(chunk.meta.nbytes)
        self.wake()

    def wake(self) -> None:
        """Room may have come: a reservation landed or was given back, or a chunk left or was unpinned."""
        self._room.set()

    async def wait_for_room(self, until: float) -> bool:
        """Wait until room may have come; False once the loop time ``until`` passed."""
        self._room.clear()
        remaining = until - asyncio.get_running_loop().time()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(self._room.wait(), remaining)
        except TimeoutError:
            return False
        return True
