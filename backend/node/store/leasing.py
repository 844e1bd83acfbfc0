"""Leases on chunks, as clients and tools ask for them: LEASE (a lock, or a mapped read), RELEASE, a connection's end.

A lease pins its keys (``leases.py``): neither demoted nor evicted until it ends. A mapped
lease reads its keys as a GET does (``reads.py``) and holds their chunk objects, so the
arena regions a client copies from outlive a concurrent delete or eviction. Pins, which
outlive any connection, are ``pins.py``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from backend.node.store.leases import LeaseTable
from backend.node.store.reads import Leased, Reads

__all__ = ["Leasing"]


class Leasing:
    """The store's leases for the node's clients (``TierManager.leasing``)."""

    def __init__(self, reads: Reads, leases: LeaseTable) -> None:
        self._reads = reads
        self._leases = leases

    async def lease(
        self, keys: Sequence[str], fingerprint: int | None, ttl_ms: int, owner: Hashable, *, mapped: bool
    ) -> Leased:
        """Pin the keys held for ``owner``; ``mapped``: read them too, with their arena offsets (``Reads.lease``)."""
        return await self._reads.lease(keys, fingerprint, ttl_ms, owner, mapped=mapped)

    def lock(self, keys: Sequence[str], ttl_ms: int) -> int:
        """A lease of no connection over ``keys`` for ``ttl_ms`` (a tool's lock): its id."""
        return self._leases.grant(keys, [], ttl_ms)

    def release(self, lease_id: int, keys: Sequence[str] = (), *, owner: Hashable | None = None) -> int:
        """End lease ``lease_id`` (only ``keys`` of it, if named); with ``owner``, only if it is that owner's."""
        if owner is not None and self._leases.owner_of(lease_id) is not owner:
            return 0
        return self._leases.release(lease_id, keys)

    def end_all_of(self, owner: Hashable) -> None:
        """``owner`` (a connection) is gone: its leases end."""
        self._leases.release_owner(owner)
