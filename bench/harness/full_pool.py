"""A kvpool pool whose DRAM is kept full, so that every put the harness measures evicts.

A fresh pool takes its first puts into empty memory; a pool in service is full, and
each put first evicts the least recently used chunk. ``FullPool.fill`` puts filler
chunks of the size about to be measured until they alone have passed the DRAM
capacity: everything older is evicted, and less than one chunk of room is left.
From then on, each put of that size evicts at least one filler (or an older measured
chunk) and the most recent chunks stay, so the measured gets still hit.

``evictions`` reads the nodes' eviction counters (``STAT``), which the harness reads
around each measured cell to prove that its puts evicted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from kvpool import Chunk, PoolConfig, SyncPoolClient

__all__ = ["DramState", "FullPool", "FILLER_PREFIX"]

FILLER_PREFIX = "kvpool-bench-filler"
FILL_BATCH_BYTES = 256 << 20  # bytes per filler put call: large enough to pipeline
FILL_BATCH_SHARE = 4  # ... and at most a quarter of DRAM: a call's chunks are all in flight (reserved) at once
MULTI_NODE_EXTRA_PERCENT = 30  # fillers beyond the pool's capacity when it has several nodes
TOP_UPS = 8  # rounds of extra fillers after the first pass, for pools of several nodes
DRAM_TIER = "dram"  # the node's name for its DRAM tier in STAT


@dataclass(frozen=True)
class DramState:
    """The DRAM tiers of a pool's nodes, summed, and their eviction counter."""

    capacity_bytes: int
    used_bytes: int
    evictions: int
    nodes: int = 1

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


class FullPool:
    """Filler puts and node counters of one pool, through kvpool's public client."""

    def __init__(self, url: str) -> None:
        self.client = SyncPoolClient(PoolConfig.from_url(url))
        self._fill_no = itertools.count()

    def state(self) -> DramState:
        """Capacity, use and evictions of every live node's DRAM tier (``STAT``, not the registry's heartbeat)."""
        capacity = used = evictions = nodes = 0
        for node in self.client.nodes(refresh=True):
            nodes += 1
            stats = self.client.node_stats(node)
            dram = stats["tiers"][DRAM_TIER]
            capacity += int(dram["capacity_bytes"])
            used += int(dram["used_bytes"])
            evictions += int(stats["counters"].get("evictions", 0))
        if capacity == 0:
            raise RuntimeError("the pool has no live node with a DRAM tier")
        return DramState(capacity, used, evictions, nodes)

    def evictions(self) -> int:
        return self.state().evictions

    def fill(self, chunk_bytes: int) -> dict[str, Any]:
        """Put ``chunk_bytes`` fillers until they alone exceed DRAM; raises if room for a chunk is left."""
        before = self.state()
        count = before.capacity_bytes // chunk_bytes + 1
        if before.nodes > 1:  # placement spreads keys unevenly: every node must get more fillers than it holds
            count += count * MULTI_NODE_EXTRA_PERCENT // 100
        data = memoryview(bytearray(chunk_bytes))  # the bytes do not matter: the keys are fresh
        fill_no = next(self._fill_no)
        per_call = max(1, min(FILL_BATCH_BYTES, before.capacity_bytes // FILL_BATCH_SHARE) // chunk_bytes)
        for start in range(0, count, per_call):
            keys = (f"{FILLER_PREFIX}/{fill_no}/{chunk_bytes}/{i}" for i in range(start, min(count, start + per_call)))
            self.client.put([Chunk(key, data) for key in keys])
        after = self.state()
        # Should a node still have room (placement is uneven), top up until none has.
        for _ in range(TOP_UPS):
            if after.free_bytes < chunk_bytes:
                break
            top_up = 2 * (after.free_bytes // chunk_bytes) + 1  # half may land on nodes already full
            keys = (f"{FILLER_PREFIX}/{fill_no}/{chunk_bytes}/{i}" for i in range(count, count + top_up))
            self.client.put([Chunk(key, data) for key in keys])
            count += top_up
            after = self.state()
        if after.free_bytes >= chunk_bytes:
            raise RuntimeError(
                f"DRAM not full after {count} filler chunks of {chunk_bytes} bytes: "
                f"{after.used_bytes} of {after.capacity_bytes} bytes used"
            )
        return {
            "chunk_bytes": chunk_bytes,
            "filler_chunks": count,
            "dram_capacity_bytes": after.capacity_bytes,
            "dram_used_bytes": after.used_bytes,
            "evictions": after.evictions - before.evictions,
        }

    def close(self) -> None:
        self.client.close()
