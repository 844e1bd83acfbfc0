"""Leases: a client's promise from the node that some chunks stay put for a while.

A lease *pins* its keys (the tier manager neither demotes nor evicts a pinned chunk:
it is out of the eviction orders while pinned, see ``backend.node.store.tiers``) and, for a same-host read, holds the chunk objects
themselves, so the shared-memory regions a client is copying from cannot be freed
and reused even if the key is deleted or replaced meanwhile. Every lease ends: by
RELEASE from the client, when the connection that took it closes (its client
crashed, or gave up on it: nobody is left to release it), or at its deadline. A
client killed while holding leases therefore pins nothing once the node sees its
connection close, however long its ttl was. The table is bounded; a node refuses
new leases past ``max_leases`` rather than grow without limit.

A *pin* (``pins.py``) is a lease of this table with no connection: its owner is a name
an operator gave (a :class:`~backend.node.store.pins.PinOwner`, never a connection, so no close ends
it), it holds no chunk objects, and its deadline may be far off or none (``math.inf``: only
an unpin ends it). A key under two leases or pins is held twice: :attr:`LeaseTable.pinned`
is the reference count, and the chunk moves again only when it drops to zero.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence

from backend.config.values import ms_to_s
from backend.counters import NodeCounter
from backend.errors import CapacityError
from backend.node.store.dram import StoredChunk

__all__ = ["Lease", "LeaseTable", "MAX_LEASE_TTL_MS", "MAX_LEASES"]

MAX_LEASE_TTL_MS = 600_000
MAX_LEASES = 65_536


@dataclasses.dataclass
class Lease:
    lease_id: int
    keys: set[str]
    chunks: dict[str, StoredChunk]  # held for same-host reads: their regions stay allocated
    expires_at: float  # time.monotonic(); math.inf: no deadline (a pin without a ttl)
    owner: Hashable | None = None  # the connection that took it (its closing ends the lease), or a pin's owner


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
        # owner -> its lease ids, oldest first (a dict as an ordered set: an unpin lets go of the newest pin)
        self._owned: defaultdict[Hashable, dict[int, None]] = defaultdict(dict)
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
        return self._hold(keys, chunks, time.monotonic() + ms_to_s(ttl_ms), owner)

    def hold(self, keys: Iterable[str], owner: Hashable, expires_at: float) -> int:
        """A lease of no connection over ``keys`` until ``expires_at`` (``time.monotonic()``; ``math.inf``:
        none): a pin (``pins.py``). It ends by :meth:`release_one`, :meth:`release` or its deadline."""
        return self._hold(keys, (), expires_at, owner)

    def _hold(
        self, keys: Iterable[str], chunks: Sequence[StoredChunk], expires_at: float, owner: Hashable | None
    ) -> int:
        self.expire()
        if len(self._leases) >= self.max_leases:
            self.counters[NodeCounter.LEASES_REFUSED] += 1
            raise CapacityError(f"node holds {len(self._leases)} leases, the limit; release some first")
        lease_id = secrets.randbits(63) or 1  # not guessable: one client cannot end another's lease
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        lease = Lease(lease_id, set(keys), {c.meta.key: c for c in chunks}, expires_at, owner)
        self._leases[lease.lease_id] = lease
        if owner is not None:
            self._owned[owner][lease_id] = None
        for key in lease.keys:
            self._pin(key)
        if expires_at != math.inf:
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

    def owner_of(self, lease_id: int) -> Hashable | None:
        """Who took the lease ``lease_id`` (None: no such lease, or one of no owner)."""
        lease = self._leases.get(lease_id)
        return lease.owner if lease is not None else None

    def release_owner(self, owner: Hashable) -> int:
        """End every lease ``owner`` took (its connection closed); returns how many ended."""
        ended = 0
        for lease_id in self._owned.pop(owner, {}):
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._unpin(lease, set(lease.keys))
                ended += 1
        self.counters[NodeCounter.LEASES_DISCONNECTED] += ended
        return ended

    def release_one(self, owner: Hashable, key: str) -> bool:
        """Let go of one hold of ``key`` by ``owner``: its newest lease (or pin) holding it; whether it had one.

        O(leases of ``owner``): an owner's pins are few (each PIN request is one)."""
        for lease_id in reversed(self._owned.get(owner, {})):
            if key in self._leases[lease_id].keys:
                self.release(lease_id, (key,))
                return True
        return False

    def owned_by(self, owner: Hashable) -> list[Lease]:
        """The live leases (or pins) of ``owner``, oldest first."""
        self.expire()
        return [self._leases[lease_id] for lease_id in self._owned.get(owner, {})]

    def owners(self) -> list[Hashable]:
        """Every owner holding a lease or pin now."""
        self.expire()
        return list(self._owned)

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
            owned.pop(lease.lease_id, None)
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
