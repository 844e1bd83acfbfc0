"""Leases: a client's promise from the node that some chunks stay put for a while.

A lease *pins* its keys (the tier manager neither demotes nor evicts a pinned chunk:
it is out of the eviction orders while pinned, see ``backend.node.tiers``) and, for a same-host read, holds the chunk objects
themselves, so the shared-memory regions a client is copying from cannot be freed
and reused even if the key is deleted or replaced meanwhile. Every lease ends: by
RELEASE from the client, when the connection that took it closes (its client
crashed, or gave up on it: nobody is left to release it), or at its deadline. A
client killed while holding leases therefore pins nothing once the node sees its
connection close, however long its ttl was. The table is bounded; a node refuses
new leases past ``max_leases`` rather than grow without limit.
"""

from __future__ import annotations

import dataclasses
import heapq
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence

from backend.config.values import ms_to_s
from backend.counters import NodeCounter
from backend.errors import CapacityError
from backend.node.dram import StoredChunk

__all__ = ["Lease", "LeaseTable", "MAX_LEASE_TTL_MS", "MAX_LEASES"]

MAX_LEASE_TTL_MS = 600_000
MAX_LEASES = 65_536


@dataclasses.dataclass
class Lease:
    lease_id: int
    keys: set[str]
    chunks: dict[str, StoredChunk]  # held for same-host reads: their regions stay allocated
    expires_at: float
    owner: Hashable | None = None  # the connection that took it; its closing ends the lease


class LeaseTable:
    """The node's live leases and the pin count of every key under one."""

    def __init__(
        self,
        on_pin: Callable[[str], None] | None = None,
        on_unpinned: Callable[[], None] | None = None,
        max_leases: int = MAX_LEASES,
    ) -> None:
        self.max_leases = max_leases
        self.pinned: Counter[str] = Counter()  # key -> leases holding it (keys under none are absent)
        self._on_pin = on_pin  # told of each key that becomes pinned, or unpinned
        self.counters: Counter[NodeCounter] = Counter()
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._owned: defaultdict[Hashable, set[int]] = defaultdict(set)  # owner -> its lease ids
        self._on_unpinned = on_unpinned

    def __len__(self) -> int:
        return len(self._leases)

    def grant(
        self, keys: Iterable[str], chunks: Sequence[StoredChunk], ttl_ms: int, owner: Hashable | None = None
    ) -> int:
        """A new lease over ``keys`` (and ``chunks``' buffers) for ``ttl_ms``; returns its id.

        ``owner`` (the connection asking) ends the lease early by :meth:`release_owner`.
        """
        if not 0 < ttl_ms <= MAX_LEASE_TTL_MS:
            raise ValueError(f"lease ttl_ms {ttl_ms} is outside 1..{MAX_LEASE_TTL_MS}")
        self.expire()
        if len(self._leases) >= self.max_leases:
            self.counters[NodeCounter.LEASES_REFUSED] += 1
            raise CapacityError(f"node holds {len(self._leases)} leases, the limit; release some first")
        lease_id = secrets.randbits(63) or 1  # not guessable: one client cannot end another's lease
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        lease = Lease(lease_id, set(keys), {c.meta.key: c for c in chunks}, time.monotonic() + ms_to_s(ttl_ms), owner)
        self._leases[lease.lease_id] = lease
        if owner is not None:
            self._owned[owner].add(lease_id)
        for key in lease.keys:
            self._pin(key)
        heapq.heappush(self._deadlines, (lease.expires_at, lease.lease_id))
        self.counters[NodeCounter.LEASES_GRANTED] += 1
        return lease.lease_id

    def release(self, lease_id: int, keys: Sequence[str] = ()) -> int:
        """End a lease (or only its hold on ``keys``); returns how many keys it let go. Idempotent."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0
        let_go = lease.keys & set(keys) if keys else set(lease.keys)
        self._unpin(lease, let_go)
        if not lease.keys:
            del self._leases[lease_id]
            self._disown(lease)
            self.counters[NodeCounter.LEASES_RELEASED] += 1
        return len(let_go)

    def release_owner(self, owner: Hashable) -> int:
        """End every lease ``owner`` took (its connection closed); returns how many ended."""
        ended = 0
        for lease_id in self._owned.pop(owner, set()):
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._unpin(lease, set(lease.keys))
                ended += 1
        self.counters[NodeCounter.LEASES_DISCONNECTED] += ended
        return ended

    def expire(self, now: float | None = None) -> int:
        """End every lease past its deadline; returns how many ended."""
        now = time.monotonic() if now is None else now
        ended = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._disown(lease)
                self._unpin(lease, set(lease.keys))
                ended += 1
        self.counters[NodeCounter.LEASES_EXPIRED] += ended
        return ended

    def _disown(self, lease: Lease) -> None:
        owned = self._owned.get(lease.owner) if lease.owner is not None else None
        if owned is not None:
            owned.discard(lease.lease_id)
            if not owned:
                del self._owned[lease.owner]

    def _pin(self, key: str) -> None:
        held = self.pinned[key]
        self.pinned[key] = held + 1
        if not held and self._on_pin is not None:
            self._on_pin(key)

    def _unpin(self, lease: Lease, keys: set[str]) -> None:
        for key in keys:
            lease.keys.discard(key)
            lease.chunks.pop(key, None)
            self.pinned[key] -= 1
            if self.pinned[key] <= 0:
                del self.pinned[key]
                if self._on_pin is not None:
                    self._on_pin(key)
        if keys and self._on_unpinned is not None:
            self._on_unpinned()  # pinned chunks may have held up a demotion
