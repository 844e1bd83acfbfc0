"""Keeps Redis in step with what a node holds: heartbeat, index flush, republish after Redis loss.

* Every ``heartbeat_interval_ms`` the node rewrites its registry entry (clients are
  told, by the registry version, only when what they keep of the node changed),
  publishes what its tiers did since the last beat (evictions, drops, tier moves),
  and lets the dead-node reaper take a step.
* Redis loss: the namespace marker holds a random *generation*. The node remembers
  the generation it published under; when the marker is missing or different at a
  heartbeat, or its registry entry was gone (collected as dead while away), it
  recreates what is needed and republishes everything it holds.
* Redis unreachable: the node keeps serving what it holds and says so once. A Redis
  that stops answering costs one ``redis_timeout_ms``; then calls fail at once while a
  PING probes it (``backend.metadata.breaker``), so a put is refused fast. The first
  heartbeat after the outage moves the registry version, so that clients which dropped
  this node while its heartbeat had lapsed see it again, and if it had lapsed the node
  republishes what it holds (a reader may have cleaned its entries as a dead node's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from typing import Any

from backend.errors import MetadataError
from backend.metadata import Beat, NodeInfo
from backend.node.context import NodeContext
from backend.node.reaper import DeadNodeReaper
from backend.node.stats import NodeStats

__all__ = ["Advert", "IndexPublisher"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Advert:
    """How clients reach this node, fixed once it listens: what its registry entry says besides its holdings."""

    host: str
    port: int
    tls: bool = False
    channel: str = ""  # the channel's kind; "" when it serves none

    @property
    def address(self) -> str:
        """``host:port``, as clients read it from the registry (``NodeInfo.address``)."""
        return f"{self.host}:{self.port}"


class IndexPublisher:
    """The node's side of the registry and the index, beyond the put and delete paths."""

    def __init__(self, ctx: NodeContext, stats: NodeStats) -> None:
        self.ctx = ctx
        self.stats = stats
        self.redis_ok = True
        self.started_at = time.time()
        self._advert: Advert | None = None  # set by join
        self._generation = ""  # the namespace marker this node last published under
        self._published_view: tuple[Any, ...] = ()  # what clients keep of this node, as last published
        self._beat_ok_at = time.monotonic()  # the last heartbeat Redis took

    async def join(self, node_id: str, advert: Advert, *, recovered: bool = False) -> None:
        """First publication: take an epoch (this node's identity from now on), publish what recovery found
        (``recovered``), beat once."""
        self._advert = advert
        self._generation = await self.ctx.index.ensure_marker()
        self.ctx.joined(node_id, await self.ctx.index.new_epoch(), advert.address)
        if recovered:
            await self.publish_inventory()  # the old epoch's entries are overwritten
        await self.heartbeat()

    async def heartbeat_loop(self, reaper: DeadNodeReaper | None = None) -> None:
        """Beat every ``heartbeat_interval_ms`` until the node stops; ``reaper`` takes a step after each."""
        ctx = self.ctx
        interval = ctx.config.heartbeat_interval_ms / 1000
        while not ctx.stopping:
            await asyncio.sleep(interval)
            ctx.tiers.leases.expire()
            self.stats.tick()
            lapsed = time.monotonic() - self._beat_ok_at > ctx.config.heartbeat_ttl_ms / 1000
            if not self.redis_ok:
                # Clients whose view dropped this node (its beat lapsed) re-read it only when the
                # registry version moves: the first beat after an outage always moves it.
                self._published_view = ()
            try:
                beat = await self.heartbeat()
                if beat.generation != self._generation:
                    await self._republish("the namespace was missing in Redis")
                elif beat.registered_anew:
                    await self._republish("this node's registry entry was gone (collected as dead while away)")
                elif lapsed:
                    # Dead to readers meanwhile: one may have cleaned this node's entries as stale.
                    await self._republish("its heartbeat had lapsed while Redis did not answer")
                await self.flush_index()
                if reaper is not None:
                    await reaper.step()
                if not self.redis_ok:
                    logger.warning("node %s: Redis reachable again", ctx.node_id)
                    self.redis_ok = True
            except MetadataError as exc:
                if self.redis_ok:
                    logger.warning("node %s: Redis unreachable, serving what is held: %s", ctx.node_id, exc)
                    self.redis_ok = False

    async def heartbeat(self) -> Beat:
        """One heartbeat; clients are told (registry version) when what they keep of this node changed."""
        info = self.info()
        view = info.view()
        changed = view != self._published_view
        beat = await self.ctx.index.heartbeat(info, self.ctx.config.heartbeat_ttl_ms, changed=changed)
        self._published_view = view
        self._beat_ok_at = time.monotonic()
        return beat

    def info(self) -> NodeInfo:
        """This node's registry entry, as of now."""
        ctx, tiers, advert = self.ctx, self.ctx.tiers, self._advert
        if advert is None:
            raise RuntimeError("the node has not joined the pool yet")
        return NodeInfo(
            node_id=ctx.node_id,
            host=advert.host,
            port=advert.port,
            epoch=ctx.epoch,
            cluster=ctx.config.cluster,
            channel=advert.channel,
            tls=advert.tls,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            capacity_bytes=tiers.capacity_bytes,
            used_bytes=tiers.used_bytes,
            object_count=len(tiers),
            tiers={name: tier.to_json() for name, tier in tiers.tier_reports().items()},
            heartbeat_at=time.time(),
            shm_path=str(tiers.shm_arena.path) if tiers.shm_arena is not None else "",
            shm_token=tiers.shm_arena.token if tiers.shm_arena is not None else "",
        )

    async def _republish(self, why: str) -> None:
        """Redis lost what we published (restart, flush, or we were collected as dead): publish it again.

        Every node does this once per new marker generation, whichever node
        recreated the marker first.
        """
        ctx = self.ctx
        generation = await ctx.index.ensure_marker()
        await ctx.index.ensure_epoch_at_least(ctx.epoch)
        self._published_view = ()  # Redis lost the registry: clients re-read it all anyway
        await self.heartbeat()
        count = await self.publish_inventory()
        self._generation = generation
        logger.warning("node %s: %s; republished %d chunks", ctx.node_id, why, count)

    async def publish_inventory(self) -> int:
        held = [(meta.key, self.ctx.location(meta, tier)) for meta, tier in self.ctx.tiers.inventory()]
        await self.ctx.index.commit(held)
        self.ctx.counters["republished"] += len(held)
        return len(held)

    async def flush_index(self) -> None:
        """Publish what the tiers did since the last flush: evictions, drops and tier moves."""
        ctx, tiers = self.ctx, self.ctx.tiers
        removed, moved = tiers.changes.take()
        gone = [key for key in removed if not tiers.contains(key)]
        moves = []
        for key in moved:
            meta, tier = tiers.meta_of(key), tiers.tier_of(key)
            if meta is not None and tier is not None:
                moves.append((key, ctx.location(meta, tier)))
        try:
            await ctx.index.remove(ctx.node_id, ctx.epoch, gone)
            await ctx.index.move(moves)
        except MetadataError:
            # Keep them for the next flush; an index entry that outlives its bytes reads as a miss.
            tiers.changes.put_back(set(gone), {key: loc.tier for key, loc in moves})
            raise
