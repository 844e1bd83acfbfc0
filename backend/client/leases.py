"""Leases: keys pinned on the node that serves them (LMCache's multiprocess lookup-and-lock).

The public names say lock (``PoolClient.lock``/``unlock``, :class:`Lock`): a lock *is* a lease.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence

from backend.client.chunks import Lock
from backend.client.connection import MAX_FRAME_ITEMS, Connections
from backend.client.context import ClientContext
from backend.client.registry import Locator, RegistryView
from backend.errors import ConfigError, KVPoolError
from backend.metadata import NodeInfo
from backend.protocol import Op
from backend.protocol.reads import Lease, Release

__all__ = ["Leases", "MAX_LEASE_TTL_MS"]

MAX_LEASE_TTL_MS = 600_000  # the node's bound (backend.node.store.leases.MAX_LEASE_TTL_MS)


class Leases:
    """Takes and ends node leases that keep keys from being demoted or evicted."""

    def __init__(self, ctx: ClientContext, registry: RegistryView, locator: Locator, connections: Connections) -> None:
        self.ctx = ctx
        self.registry = registry
        self.locator = locator
        self.connections = connections

    async def take(self, keys: Sequence[str], ttl_ms: int) -> list[Lock | None]:
        """Pin each key on the node that serves it for ``ttl_ms``; None where the pool lacks it.

        One Redis round trip for the locations, then one LEASE per node. A node that
        fails costs only its keys (None), like a miss.
        """
        if not 0 < ttl_ms <= MAX_LEASE_TTL_MS:
            raise ConfigError("ttl_ms", f"{ttl_ms} is outside 1..{MAX_LEASE_TTL_MS}")
        results: list[Lock | None] = [None] * len(keys)
        if not keys:
            return results
        groups: dict[str, list[int]] = defaultdict(list)
        for index, entry in enumerate(await self.locator.lookup(keys)):
            ordered = self.registry.ordered(entry)
            if ordered:
                groups[ordered[0].node_id].append(index)

        async def on_node(node: NodeInfo, indexes: list[int]) -> None:
            for start in range(0, len(indexes), MAX_FRAME_ITEMS):
                part = indexes[start : start + MAX_FRAME_ITEMS]
                names = [keys[i] for i in part]
                reply = await self.connections.to(node).request(Op.LEASE, Lease.encode_request(names, ttl_ms, 0))
                lease_id, found = Lease.decode_answer(reply, names)
                for index, entry in zip(part, found):
                    if entry is not None:
                        results[index] = Lock(keys[index], node.node_id, lease_id, node.epoch)

        nodes = {nid: self.registry.node(nid) for nid in groups}
        outcomes = await asyncio.gather(
            *(on_node(node, groups[nid]) for nid, node in nodes.items() if node is not None), return_exceptions=True
        )
        for nid, outcome in zip([nid for nid, node in nodes.items() if node is not None], outcomes):
            if isinstance(outcome, KVPoolError):
                self.ctx.warn_once(
                    f"lease:{nid}", "kvpool: lease on node %s failed, reading as misses: %s", nid, outcome
                )
            elif isinstance(outcome, BaseException):
                raise outcome
        return results

    async def release(self, leases: Sequence[Lock | None]) -> None:
        """End leases taken by :meth:`take`; idempotent, so a failed call may simply be repeated.

        Leases on nodes gone from the registry or restarted are ignored (they
        died with them). Every node is tried; then the first failure (a node that did
        not answer) is raised, and its leases end at their ttl unless a retry succeeds.
        """
        by_lease: dict[tuple[str, int, int], list[str]] = defaultdict(list)
        for held in leases:
            if held is not None:
                by_lease[(held.node_id, held.epoch, held.lease_id)].append(held.key)
        if not by_lease:
            return
        await self.registry.nodes()
        releases = []
        for (nid, epoch, lease_id), names in by_lease.items():
            node = self.registry.node(nid)
            if node is None or node.epoch != epoch:
                continue  # the node restarted: its leases died with it
            conns = self.connections.to(node)
            releases += [
                conns.request(Op.RELEASE, Release.encode_request(lease_id, names[i : i + MAX_FRAME_ITEMS]))
                for i in range(0, len(names), MAX_FRAME_ITEMS)
            ]
        outcomes = await asyncio.gather(*releases, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, KVPoolError):
                raise outcome
        failed = [outcome for outcome in outcomes if isinstance(outcome, KVPoolError)]
        if failed:
            raise failed[0]
