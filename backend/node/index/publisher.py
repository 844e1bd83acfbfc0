"""Keeps Redis in step with what a node holds: heartbeat, index flush, republish after Redis loss.

* Every ``heartbeat_interval_s`` the node rewrites its registry entry (clients are
  told, by the registry version, only when what they keep of the node changed),
  publishes what its tiers did since the last beat (evictions, drops, tier moves),
  and lets the dead-node reaper take a step.
* Redis loss: the namespace marker holds a random *generation*. The node remembers
  the generation it published under; when the marker is missing or different at a
  heartbeat, or its registry entry was gone (collected as dead while away), it
  recreates what is needed, beats, and has everything it holds republished in bounded
  batches beside the heartbeat (``republish.py``): the heartbeat never waits for it.
* Redis unreachable, slow or full: the node keeps serving what it holds and says which,
  once per change: "Redis unreachable" (refused or reset), "Redis slow" (no answer within
  ``redis_timeout_s``: paused, stopped, overloaded or cut off; then calls fail at once
  while a PING probes it, ``backend.metadata.breaker``, so a put is refused fast), or
  "Redis is full" (at ``maxmemory`` under ``noeviction``: it refuses index writes, so
  puts are refused, but every write of a heartbeat is in one script allowed to run on a
  full Redis, so the node stays alive to the pool). The first heartbeat after an outage
  moves the registry version, so that clients which dropped this node while its heartbeat
  had lapsed see it again, and if it had lapsed the node republishes what it holds (a
  reader may have cleaned its entries as a dead node's).
* Its id taken: a beat that finds another run's epoch on this node's id (``claim.py``)
  writes nothing; the node logs an ERROR and stops (``lost_claim``), rather than fight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from typing import Any

from backend.config.values import s_to_ms
from backend.errors import MetadataError
from backend.metadata import Beat, ClaimHolder, NodeInfo, RedisFullError, RedisSlowError
from backend.node.context import NodeContext
from backend.node.index.claim import ClaimLost
from backend.node.index.quota_sync import QuotaSync
from backend.node.index.reaper import DeadNodeReaper
from backend.node.index.republish import Republisher
from backend.node.stats import NodeStats

__all__ = ["ANSWER_FLUSH_S", "Advert", "IndexPublisher"]

logger = logging.getLogger(__name__)

SLOW_PUT_LOG_S = 60.0  # a put's commit that Redis did not answer in time is logged at most this often

# How long a request that owes a client its answer (a delete, a verify) waits for the index before it
# answers anyway, leaving the rest to the heartbeat's flush: a quarter of the clients' default
# progress_timeout_s, so that a paused Redis never makes a healthy node look dead.
ANSWER_FLUSH_S = 0.5


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
        self.redis_ok = True  # the last heartbeat landed
        self.redis_trouble = ""  # what the last Redis failure was: "full", "slow", "unreachable"; "" while none
        self.lost_claim: ClaimLost | None = None  # set when another process took this node's id
        self._slow_said_at = -SLOW_PUT_LOG_S  # when a put last said Redis was slow
        self.started_at = time.time()
        self._advert: Advert | None = None  # set by join
        self._generation = ""  # the namespace marker this node last published under
        self._published_view: tuple[Any, ...] = ()  # what clients keep of this node, as last published
        self._beat_ok_at = time.monotonic()  # the last heartbeat Redis took
        self.republisher = Republisher(ctx, stats)
        self.quota_sync = QuotaSync(ctx.index, ctx.tiers.upkeep, s_to_ms(ctx.config.heartbeat_ttl_s))

    async def join(self, advert: Advert) -> None:
        """First publication, under the id and epoch the node claimed (``claim.py``): beat once. What the
        NVMe tier held is published as recovery adopts it (``recovery.py``)."""
        self._advert = advert
        self._generation = await self.ctx.index.ensure_marker()
        await self.heartbeat()

    async def heartbeat_loop(self, reaper: DeadNodeReaper | None = None) -> None:
        """Beat every ``heartbeat_interval_s`` until the node stops; ``reaper`` takes a step after each."""
        ctx = self.ctx
        interval = ctx.config.heartbeat_interval_s
        while not ctx.stopping:
            await asyncio.sleep(interval)
            ctx.tiers.upkeep.expire_leases()
            self.stats.tick()
            lapsed = time.monotonic() - self._beat_ok_at > ctx.config.heartbeat_ttl_s
            if not self.redis_ok:
                # Clients whose view dropped this node (its beat lapsed) re-read it only when the
                # registry version moves: the first beat after an outage always moves it.
                self._published_view = ()
            try:
                beat = await self.heartbeat()
            except ClaimLost as exc:
                self._give_up_id(exc)
                return
            except MetadataError as exc:
                self.redis_ok = False
                await self._trouble(exc)
                continue
            self.redis_ok = True
            try:
                if beat.generation != self._generation:
                    await self._lost("the namespace was missing in Redis")
                elif beat.registered_anew:
                    await self._lost("this node's registry entry was gone (collected as dead while away)")
                elif lapsed:
                    # Dead to readers meanwhile: one may have cleaned this node's entries as stale.
                    await self._lost("its heartbeat had lapsed while Redis did not answer")
                await self.flush_index()
                if reaper is not None:
                    await reaper.step()
            except ClaimLost as exc:
                self._give_up_id(exc)
                return
            except MetadataError as exc:
                await self._trouble(exc)
                continue
            if self.redis_trouble:
                await self._trouble_over()

    async def _trouble_over(self) -> None:
        """A beat and its flush landed: Redis answers again (while it was full: once it has room again; where
        INFO is not allowed to this node's Redis user, once a put's commit lands: :meth:`took_writes`)."""
        if self.redis_trouble == "full":
            try:
                memory = await self.ctx.index.memory()
            except MetadataError:
                return
            if memory.full:
                return
        self._trouble_is_over()

    def took_writes(self) -> None:
        """A put's index commit landed: whatever Redis's trouble was, it takes writes that need memory now."""
        if self.redis_trouble:
            self._trouble_is_over()

    def _trouble_is_over(self) -> None:
        logger.warning("node %s: Redis answers and takes writes again", self.ctx.node_id)
        self.redis_trouble = ""

    def refused(self, exc: MetadataError) -> None:
        """A put's commit failed. A full Redis is said at once: puts notice it first, since a beat is allowed
        to write on it. A slow one is said at most once a minute: a put's commit waits less than a beat
        (``puts.commit_wait_s``), so beats may land meanwhile."""
        if isinstance(exc, RedisFullError) and self.redis_trouble != "full":
            self.ctx.spawn(self._trouble(exc))
        elif isinstance(exc, RedisSlowError) and time.monotonic() - self._slow_said_at > SLOW_PUT_LOG_S:
            self._slow_said_at = time.monotonic()
            logger.warning(
                "node %s: Redis slow: %s; the put was refused (its client told why, in time), puts go on being "
                "refused while Redis does not answer",
                self.ctx.node_id,
                exc,
            )

    @staticmethod
    def _kind(exc: MetadataError) -> str:
        return (
            "full" if isinstance(exc, RedisFullError) else "slow" if isinstance(exc, RedisSlowError) else "unreachable"
        )

    async def _trouble(self, exc: MetadataError) -> None:
        """Say once what is wrong with Redis (full, slow or unreachable), and again when that changes."""
        kind = self._kind(exc)
        if kind == self.redis_trouble:
            return
        self.redis_trouble = kind
        node_id = self.ctx.node_id
        if kind == "full":
            detail = "it refuses writes that need memory"
            with contextlib.suppress(MetadataError):  # INFO is answered on a full Redis
                detail = (await self.ctx.index.memory()).describe()
            logger.error(
                "node %s: Redis is full: %s. Heartbeats still land and what is held is served; puts are refused "
                "(nothing is acknowledged unindexed) until Redis has room",
                node_id,
                detail,
            )
        elif kind == "slow":
            logger.warning("node %s: Redis slow, serving what is held: %s", node_id, exc)
        else:
            logger.warning("node %s: Redis unreachable, serving what is held: %s", node_id, exc)

    def _give_up_id(self, exc: ClaimLost) -> None:
        """Another process holds this node's id: stop serving under it rather than fight over it."""
        logger.error("node %s: %s; this node stops serving under the id", self.ctx.node_id, exc)
        self.lost_claim = exc
        self.ctx.request_stop()

    async def heartbeat(self) -> Beat:
        """One heartbeat; clients are told (registry version) when what they keep of this node changed.
        ClaimLost if another process holds this node's id now (the beat wrote nothing)."""
        info = self.info()
        view = info.view()
        changed = view != self._published_view
        holder = ClaimHolder(info.epoch, info.host, info.port, info.pid, info.hostname)
        beat = await self.ctx.index.heartbeat(
            info, s_to_ms(self.ctx.config.heartbeat_ttl_s), changed=changed, holder=holder
        )
        if beat.lost_to is not None:
            raise ClaimLost(
                f"node id {info.node_id!r} is held by {beat.lost_to.describe()}: this node's heartbeat lapsed "
                "for a whole TTL (frozen, or cut off from Redis) and another process claimed the id"
            )
        self._published_view = view
        self._beat_ok_at = time.monotonic()
        try:  # the tenants' quotas ride on the beat: kvpool quota set applies from the next one
            await self.quota_sync.beat(info.node_id)
        except MetadataError as exc:
            logger.debug("quotas not read at this heartbeat (the last ones stay): %s", exc)
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
            eviction=ctx.config.eviction,
            event_tokens=ctx.events is not None,  # a ring keeps put tokens: clients send them
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

    async def _lost(self, why: str) -> None:
        """Redis lost what we published (restart, flush, or we were collected as dead): recreate the marker
        and the epoch floor, beat, and have everything republished beside the heartbeat (``republish.py``).

        Every node does this once per new marker generation, whichever node recreated the marker
        first. The generation is the walk's from now on: a further loss begins it again.
        """
        ctx = self.ctx
        generation = await ctx.index.ensure_marker()
        await ctx.index.ensure_epoch_at_least(ctx.epoch)
        self._published_view = ()  # Redis lost the registry: clients re-read it all anyway
        await self.heartbeat()
        self._generation = generation
        self.republisher.restart(why)

    async def flush_index_within(self, timeout_s: float) -> None:
        """:meth:`flush_index`, for a request that owes a client its answer: waits for Redis at most
        ``timeout_s``; what did not land is kept for the heartbeat's flush (an index entry that outlives its
        bytes reads as a miss meanwhile), so a paused Redis never makes the answer late."""
        with contextlib.suppress(MetadataError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.flush_index()

    async def flush_index(self) -> None:
        """Publish what the tiers did since the last flush: evictions, drops and tier moves."""
        ctx, tiers = self.ctx, self.ctx.tiers
        removed, moved = tiers.upkeep.take_changes()
        gone = [key for key in removed if not tiers.contains(key)]
        moves = []
        for key in moved:
            meta, tier = tiers.meta_of(key), tiers.tier_of(key)
            if meta is not None and tier is not None:
                moves.append((key, ctx.location(meta, tier)))
        try:
            await ctx.index.remove(ctx.node_id, ctx.epoch, gone)
            if ctx.events is not None:
                ctx.events.removed(gone)  # withdrawn: no reader finds them any more
            await ctx.index.move(moves)
        except BaseException:  # MetadataError, or cancelled (a put's commit could wait no longer)
            # Keep them for the next flush; an index entry that outlives its bytes reads as a miss.
            tiers.upkeep.keep_changes(set(gone), {key: loc.tier for key, loc in moves})
            raise
