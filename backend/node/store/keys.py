"""A node's keys: found by hash (:class:`KeyIndex`), walked in key order (:class:`SortedKeys`).

:class:`KeyIndex` maps a key to its slot (``bookkeeping.ChunkTable``) without a Python
object per key: a dict of str -> int would cost its entry and a 32-byte int per key on
top of the key. It is open addressing with linear probing over a table of 8-byte entries
(a slot number and the low 32 bits of its key's hash, which places the entry and skips
most key comparisons without touching the key), at most half full: 16 to 32 bytes a
key. The hash is Python's own for strings (cached in
the key, and keyed per process, so a client cannot choose keys that collide). A removal
shifts the entries after it back (no tombstones), so lookups stay short however many
keys come and go. Growing rebuilds the table with numpy (about 0.1 s at 10^6 keys, once
each time the key count doubles).

:class:`SortedKeys` keeps the same keys in order for INVENTORY paging: sorted buckets
of at most ``2 * BUCKET_KEYS`` keys, so a key costs O(log N + BUCKET_KEYS) to add or
remove and a page of L keys after a cursor O(log N + L): nothing sorts the whole set.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

import numpy as np

from backend.node.memory.columns import column

__all__ = ["BUCKET_KEYS", "KeyIndex", "NO_SLOT", "SortedKeys"]

BUCKET_KEYS = 512  # a bucket splits past twice this
NO_SLOT = -1
_HASH_MASK = 0xFFFFFFFF
_MIN_TABLE = 1024


class KeyIndex:
    """key -> slot, for the keys of a slot -> key list it shares with its owner. Event loop only."""

    def __init__(self, keys: list[str | None]) -> None:
        self._keys = keys  # slot -> key (the owner's list: read here, never written)
        # position -> the low 32 bits of its key's hash << 32 | its slot + 1 (0: empty): the hash places an
        # entry and skips most key comparisons without touching the key
        self._table = column("Q", _MIN_TABLE)
        self._mask = _MIN_TABLE - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def get(self, key: str) -> int:
        """``key``'s slot, or NO_SLOT."""
        h = hash(key) & _HASH_MASK
        table, keys, mask = self._table, self._keys, self._mask
        i = h & mask
        while True:
            entry = table[i]
            if not entry:
                return NO_SLOT
            if entry >> 32 == h:
                slot = (entry & _HASH_MASK) - 1
                if keys[slot] == key:
                    return slot
            i = (i + 1) & mask

    def add(self, key: str, slot: int) -> None:
        """Index ``key`` (not indexed yet; already at ``slot`` in the shared list) at ``slot``."""
        if 2 * (self._count + 1) > len(self._table):
            self._rebuild(2 * len(self._table))
        h = hash(key) & _HASH_MASK
        table, mask = self._table, self._mask
        i = h & mask
        while table[i]:
            i = (i + 1) & mask
        table[i] = h << 32 | (slot + 1)
        self._count += 1

    def remove(self, key: str) -> int:
        """Forget ``key`` (still at its slot in the shared list); its slot, or NO_SLOT if it was not indexed."""
        h = hash(key) & _HASH_MASK
        table, keys, mask = self._table, self._keys, self._mask
        i = h & mask
        while True:
            entry = table[i]
            if not entry:
                return NO_SLOT
            if entry >> 32 == h and keys[(entry & _HASH_MASK) - 1] == key:
                break
            i = (i + 1) & mask
        # Shift back each later entry of the run whose home is not between the hole and it.
        hole, j = i, i
        while True:
            j = (j + 1) & mask
            moved = table[j]
            if not moved:
                break
            home = (moved >> 32) & mask
            if (j - home) & mask >= (j - hole) & mask:
                table[hole] = moved
                hole = j
        table[hole] = 0
        self._count -= 1
        return (entry & _HASH_MASK) - 1

    def _rebuild(self, size: int) -> None:
        """A table of ``size`` entries holding every entry: by home position, each run laid out in one pass."""
        entries = np.frombuffer(self._table, dtype=np.uint64)
        entries = entries[entries != 0]
        homes = ((entries >> np.uint64(32)) & np.uint64(size - 1)).astype(np.int64)
        order = np.argsort(homes, kind="stable")
        entries, homes = entries[order], homes[order]
        steps = np.arange(len(entries), dtype=np.int64)
        places = np.maximum.accumulate(homes - steps) + steps if len(entries) else steps  # linear probing's places
        table = column("Q", size)
        fits = places < size
        np.frombuffer(table, dtype=np.uint64)[places[fits]] = entries[fits]
        self._table, self._mask = table, size - 1
        for entry in entries[~fits].tolist():  # runs past the end wrap to the start
            i = 0
            while table[i]:
                i += 1
            table[i] = entry


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
