"""What a node knows about its own keys: which it holds, in key order, and what Redis has not heard yet.

``HeldKeys`` is told by each tier when a key enters or leaves it (a key may be in
DRAM and on NVMe at once: a promoted chunk keeps its file). It answers the number
of keys held in O(1) (the heartbeat asks every second) and pages through them in
key order from a cursor (INVENTORY: ``kvpool check`` and ``kvpool drain`` walk a
node this way). The order is kept incrementally in sorted buckets of at most
``2 * BUCKET_KEYS`` keys, so a key costs O(log N + BUCKET_KEYS) to add or remove and
a page of L keys after a cursor O(log N + L): nothing sorts the whole key set.

``IndexChanges`` collects what the tiers did that the index must hear about
(chunks gone, chunks that changed tier); the node's publisher sends them in batches.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

__all__ = ["HeldKeys", "IndexChanges", "DRAM", "NVME", "IN_DRAM", "ON_NVME"]

DRAM = "dram"  # tier names, as the index records them
NVME = "nvme"
IN_DRAM = 1
ON_NVME = 2
BUCKET_KEYS = 512  # a bucket splits past twice this


class SortedKeys:
    """A set of strings kept in order: sorted buckets, each bucket's largest key in ``_maxes``."""

    def __init__(self) -> None:
        self._buckets: list[list[str]] = []
        self._maxes: list[str] = []

    def add(self, key: str) -> None:
        """Insert ``key`` (the caller knows it is not present)."""
        if not self._buckets:
            self._buckets.append([key])
            self._maxes.append(key)
            return
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):  # past every key: the last bucket grows
            i -= 1
            self._buckets[i].append(key)
            self._maxes[i] = key
        else:
            insort(self._buckets[i], key)
        bucket = self._buckets[i]
        if len(bucket) > 2 * BUCKET_KEYS:
            half = bucket[BUCKET_KEYS:]
            del bucket[BUCKET_KEYS:]
            self._buckets.insert(i + 1, half)
            self._maxes[i] = bucket[-1]
            self._maxes.insert(i + 1, half[-1])

    def discard(self, key: str) -> None:
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):
            return
        bucket = self._buckets[i]
        j = bisect_left(bucket, key)
        if j == len(bucket) or bucket[j] != key:
            return
        del bucket[j]
        if bucket:
            self._maxes[i] = bucket[-1]
        else:
            del self._buckets[i]
            del self._maxes[i]

    def after(self, cursor: str, limit: int) -> list[str]:
        """Up to ``limit`` keys greater than ``cursor``, in order."""
        page: list[str] = []
        i = bisect_right(self._maxes, cursor)
        if i == len(self._maxes):
            return page
        j = bisect_right(self._buckets[i], cursor)
        while i < len(self._buckets) and len(page) < limit:
            bucket = self._buckets[i]
            page.extend(bucket[j : j + limit - len(page)])
            i, j = i + 1, 0
        return page


class HeldKeys:
    """Every key this node holds in any tier: counted in O(1), listed in key order."""

    def __init__(self) -> None:
        self._where: dict[str, int] = {}  # key -> IN_DRAM | ON_NVME bits
        self._sorted = SortedKeys()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def add(self, key: str, tier: int) -> None:
        where = self._where.get(key, 0)
        if not where:
            self._sorted.add(key)
        self._where[key] = where | tier

    def remove(self, key: str, tier: int) -> None:
        where = self._where.get(key, 0) & ~tier
        if where:
            self._where[key] = where
        elif self._where.pop(key, None) is not None:
            self._sorted.discard(key)

    def page(self, after: str, limit: int) -> tuple[list[str], bool]:
        """The first ``limit`` keys greater than ``after``, and whether more follow."""
        keys = self._sorted.after(after, limit + 1)
        return keys[:limit], len(keys) > limit

    def all(self) -> list[str]:
        return list(self._where)


class IndexChanges:
    """Keys this node stopped holding and keys that moved tier, not yet published to the index."""

    def __init__(self) -> None:
        self.removed: set[str] = set()
        self.moved: dict[str, str] = {}  # key -> the tier now serving it

    def take(self) -> tuple[set[str], dict[str, str]]:
        """Everything recorded so far; the record starts empty again."""
        removed, moved = self.removed, self.moved
        self.removed, self.moved = set(), {}
        return removed, moved

    def put_back(self, removed: set[str], moved: dict[str, str]) -> None:
        """Keep changes whose publishing failed for the next try."""
        self.removed |= removed
        for key, tier in moved.items():
            self.moved.setdefault(key, tier)  # a move recorded meanwhile is newer
