"""The names an L2 adapter's loads missed: its next store of them goes to the pool even though the index lists them.

The store side skips a chunk the index already lists (re-sending it would waste the
bandwidth and count its bytes twice). That is wrong for a copy this adapter cannot read:
one stored with another layout fingerprint (another engine's layout under the same name, or
an older adapter's chunk stored with none; docs/design.md, "KV layout fingerprints"), or a
copy that failed its read. LMCache only loads keys its lookup found, so a load that then
misses is such a copy; the engine recomputes the chunk, and its store replaces that copy
with one of this adapter's layout (the node stores a put of another fingerprint: "Two
layouts, one key" there). Kept on the adapter's loop thread only, bounded, oldest forgotten
first: a forgotten name only keeps the old behaviour (the store is skipped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["Unreadable", "MAX_UNREADABLE_NAMES"]

MAX_UNREADABLE_NAMES = 65_536  # a few MiB of names at most, on the engine host, not on a node


class Unreadable:
    """Pool names whose load missed, until a store takes them; at most ``limit``, oldest forgotten first."""

    def __init__(self, limit: int = MAX_UNREADABLE_NAMES) -> None:
        self.limit = limit
        self._names: OrderedDict[str, None] = OrderedDict()

    def add(self, names: Iterable[str]) -> None:
        for name in names:
            self._names[name] = None
            self._names.move_to_end(name)
        while len(self._names) > self.limit:
            self._names.popitem(last=False)

    def take(self, name: str) -> bool:
        """Whether ``name`` was missed by a load since it was last taken (and forget it)."""
        if name not in self._names:
            return False
        del self._names[name]
        return True

    def __len__(self) -> int:
        return len(self._names)
