"""Keeps Redis in step with what a node holds: heartbeat, index flush, republish after Redis loss.

* Every ``heartbeat_interval_ms`` the node rewrites its registry entry (clients are
  told, by the registry version, only when what they keep of the node changed),
  publishes what its tiers did since the last beat (evictions, drops, tier moves),
  and lets the dead-node collector take a step.
* Redis loss: the namespace marker holds a random *generation*. The node remembers
  the generation it published under; when the marker is missing or different at a
  heartbeat, or its registry entry was gone (collected as dead while away), it
  recreates what is needed and republishes everything it holds.
* Redis unreachable: the node keeps serving what it holds and says so once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from backend.errors import MetadataError
from backend.metadata import Beat, Location
from backend.node.tiers import DRAM
from backend.protocol import ItemMeta

if TYPE_CHECKING:
    from backend.node.server import PoolNode

__all__ = ["IndexPublisher"]

logger = logging.getLogger(__name__)


class IndexPublisher:
    """The node's side of the registry and the index, beyond the put and delete paths."""

    def __init__(self, node: PoolNode) -> None:
        self.node = node
        self.redis_ok = True
        self._generation = ""  # the namespace marker this node last published under
        self._published_view: tuple[Any, ...] = ()  # what clients keep of this node, as last published

    async def join(self) -> None:
        """First publication: take an epoch, publish what recovery found, beat once."""
        node = self.node
        self._generation = await node.meta.ensure_marker()
        node.epoch = await node.meta.new_epoch()
        if node.recovery is not None and node.recovery.files:
            await self.publish_inventory()  # the old epoch's entries are overwritten
        await self.heartbeat()

    async def heartbeat_loop(self) -> None:
        node = self.node
        interval = node.config.heartbeat_interval_ms / 1000
        while not node.stopping:
            await asyncio.sleep(interval)
            node.tiers.leases.expire()
            node.statistics.tick()
            try:
                beat = await self.heartbeat()
                if beat.generation != self._generation:
                    await self._republish("the namespace was missing in Redis")
                elif beat.registered_anew:
                    await self._republish("this node's registry entry was gone (collected as dead while away)")
                await self.flush_index()
                if node.collector is not None:
                    await node.collector.step()
                if not self.redis_ok:
                    logger.warning("node %s: Redis reachable again", node.node_id)
                    self.redis_ok = True
            except MetadataError as exc:
                if self.redis_ok:
                    logger.warning("node %s: Redis unreachable, serving what is held: %s", node.node_id, exc)
                    self.redis_ok = False

    async def heartbeat(self) -> Beat:
        """One heartbeat; clients are told (registry version) when what they keep of this node changed."""
        node = self.node
        info = node.info()
        view = info.view()
        beat = await node.meta.heartbeat(info, node.config.heartbeat_ttl_ms, changed=view != self._published_view)
        self._published_view = view
        return beat

    async def _republish(self, why: str) -> None:
        """Redis lost what we published (restart, flush, or we were collected as dead): publish it again.

        Every node does this once per new marker generation, whichever node
        recreated the marker first.
        """
        node = self.node
        generation = await node.meta.ensure_marker()
        await node.meta.ensure_epoch_at_least(node.epoch)
        self._published_view = ()  # Redis lost the registry: clients re-read it all anyway
        await self.heartbeat()
        count = await self.publish_inventory()
        self._generation = generation
        logger.warning("node %s: %s; republished %d chunks", node.node_id, why, count)

    async def publish_inventory(self) -> int:
        held = [(meta.key, self.location(meta, tier)) for meta, tier in self.node.tiers.inventory()]
        await self.node.meta.commit(held)
        self.node.counters["republished"] += len(held)
        return len(held)

    async def flush_index(self) -> None:
        """Publish what the tiers did since the last flush: evictions, drops and tier moves."""
        tiers = self.node.tiers
        removed, moved = tiers.changes.take()
        gone = [key for key in removed if not tiers.contains(key)]
        moves = []
        for key in moved:
            meta, tier = tiers.meta_of(key), tiers.tier_of(key)
            if meta is not None and tier is not None:
                moves.append((key, self.location(meta, tier)))
        try:
            await self.node.meta.remove(self.node.node_id, self.node.epoch, gone)
            await self.node.meta.move(moves)
        except MetadataError:
            # Keep them for the next flush; an index entry that outlives its bytes reads as a miss.
            tiers.changes.put_back(set(gone), {key: loc.tier for key, loc in moves})
            raise

    def location(self, meta: ItemMeta, tier: str = DRAM) -> Location:
        return Location(self.node.node_id, self.node.epoch, tier, meta.nbytes, meta.checksum)
