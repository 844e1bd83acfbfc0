"""Republish: what a node holds, written to the index again after Redis lost it, in bounded batches.

Redis can lose what a node published (a FLUSHALL, a restart without persistence, a
cluster shard that came back empty), or a reader can clean it (the node's heartbeat
lapsed and it was collected as dead). The publisher notices at a heartbeat
(``publisher.py``) and calls :meth:`Republisher.restart`; the walk runs as a task of
its own beside the heartbeat, never in its place, so the heartbeat keeps its interval
however much the node holds, and the node serves what it holds meanwhile: a key not
yet republished reads as a miss, never as an error or as other bytes.

* The walk goes through the held keys in key order (``TierManager.page``), a batch of
  ``REPUBLISH_BATCH_KEYS`` at a time, each batch one pipelined commit.
* A batch Redis does not take (unreachable, slow, full) is tried again from the same
  key until it lands: an outage shorter than the heartbeat TTL costs only its own time,
  and nothing published before it is published twice.
* A loss during a walk (a second FLUSHALL): what was published before it is gone too,
  so every key must be published again, but none twice. The walk *resumes*: it goes on
  from the key where it stands, wraps round past the last key, and ends at that key,
  one pass over the ring of keys. Nothing is redone that the loss did not undo, and a
  batch in flight when the loss was seen is published again (it may have landed before).
* What changes on the node while a batch is in flight (a newer put of a key, its
  delete, a move between tiers) is corrected once the batch landed (:func:`publish_held`),
  so a walk never leaves an entry the node does not hold, nor an older one.
* Progress: the ``republish_pending`` and ``republish_running`` gauges, the
  ``republished`` counter, STAT's ``republish``; a log line at the start, at every
  tenth of the walk, and at the end ("republished N chunks in S s").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from backend.counters import NodeCounter
from backend.errors import MetadataError
from backend.metadata import Location
from backend.node.context import NodeContext
from backend.node.stats import NodeStats
from backend.protocol import ItemMeta
from backend.protocol.reports import RepublishReport

__all__ = ["REPUBLISH_BATCH_KEYS", "Republisher", "publish_held"]

logger = logging.getLogger(__name__)

REPUBLISH_BATCH_KEYS = 1000  # keys per commit of a walk: one pipelined round trip, a few ms of Redis time
PROGRESS_STEPS = 10  # a progress line at every tenth of a walk
CORRECTION_ROUNDS = 3  # re-checks of a batch after it landed; later changes are published by their own paths


async def publish_held(ctx: NodeContext, held: Sequence[tuple[ItemMeta, str]]) -> None:
    """Write the index entries of ``held`` (chunks and the tier serving each), then make the index say what
    the node holds now: a key deleted, stored anew or moved while the write was in flight has its entry
    removed (only the one written here) or written again. MetadataError when Redis does not take a write;
    what landed was this node's at the time, and the caller tries again."""
    tiers = ctx.tiers
    pending = list(held)
    for _ in range(CORRECTION_ROUNDS):
        if not pending:
            return
        written: list[tuple[str, Location]] = [(meta.key, ctx.location(meta, tier)) for meta, tier in pending]
        await ctx.index.commit(written)
        stale: list[tuple[str, Location]] = []
        pending = []
        for key, location in written:
            meta, tier = tiers.meta_of(key), tiers.tier_of(key)
            if meta is None or tier is None:
                stale.append((key, location))
            elif meta.checksum != location.checksum or tier != location.tier:
                pending.append((meta, tier))
        if stale:
            await ctx.index.remove_stale(stale)


@dataclasses.dataclass
class _Walk:
    """One pass over the ring of held keys, begun (or begun again) by a loss."""

    why: str
    began: float  # time.monotonic()
    expected: int  # keys held when it began: what ``pending`` counts down from
    until: str  # after wrapping round past the last key, the walk ends at this one ("": at the last key)
    wrapped: bool = False
    published: int = 0
    said: int = 0  # tenths of the walk said in the log


class Republisher:
    """Publishes everything a node holds again, batch by batch, beside its heartbeat."""

    def __init__(self, ctx: NodeContext, stats: NodeStats, batch_keys: int = REPUBLISH_BATCH_KEYS) -> None:
        self.ctx = ctx
        self.stats = stats
        self.batch_keys = batch_keys
        self._walk: _Walk | None = None
        self._cursor = ""  # the last key the walk published
        self._task: asyncio.Task[None] | None = None
        self._retry_said = False  # a batch Redis refused was said once in this walk

    @property
    def running(self) -> bool:
        return self._walk is not None

    def restart(self, why: str) -> None:
        """Redis lost what this node published (``why``): publish everything it holds again, from where the
        walk stands (a walk under way resumes: see the module's docstring)."""
        ctx, walk = self.ctx, self._walk
        held = len(ctx.tiers)
        if walk is None:
            self._cursor = ""
            logger.warning(
                "node %s: %s; republishing the %d chunks it holds, %d per batch, beside its heartbeat "
                "(a chunk not yet republished reads as a miss)",
                ctx.node_id,
                why,
                held,
                self.batch_keys,
            )
        else:
            logger.warning(
                "node %s: %s, with a republish under way (%d of ~%d chunks published); every chunk it holds is "
                "published again, going on from where the walk stands and round to it",
                ctx.node_id,
                why,
                walk.published,
                walk.expected,
            )
        self._walk = _Walk(why, time.monotonic(), held, until=self._cursor)
        self._retry_said = False
        self._report()
        if self._task is None or self._task.done():
            self._task = ctx.spawn(self._run())

    async def _run(self) -> None:
        retry_s = self.ctx.config.heartbeat_interval_s
        while self._walk is not None:
            try:
                await self._step()
                await asyncio.sleep(0)  # the node's other tasks run between batches, whatever the index is
            except MetadataError as exc:
                if not self._retry_said:
                    self._retry_said = True
                    logger.warning(
                        "node %s: republish: Redis did not take a batch (%s); trying it again every %.1f s",
                        self.ctx.node_id,
                        exc,
                        retry_s,
                    )
                await asyncio.sleep(retry_s)

    async def _step(self) -> None:
        """Publish the next batch of the walk, and advance past it."""
        walk = self._walk
        assert walk is not None
        held, more = self.ctx.tiers.page(self._cursor, self.batch_keys)
        if walk.wrapped:
            within = [(meta, tier) for meta, tier in held if meta.key <= walk.until]
            end = len(within) < len(held) or not more
            held = within
        else:
            end = not more or not held
        await publish_held(self.ctx, held)
        if self._walk is not walk:
            return  # a loss while the batch was in flight: it may have landed before it, so it goes again
        if held:
            self._cursor = held[-1][0].key
        walk.published += len(held)
        self.ctx.counters[NodeCounter.REPUBLISHED] += len(held)
        if end and not walk.wrapped and walk.until:
            walk.wrapped, self._cursor = True, ""  # round past the last key, to where the walk began
        elif end:
            self._finish(walk)
            return
        self._say_progress(walk)
        self._report()

    def _say_progress(self, walk: _Walk) -> None:
        tenths = min(PROGRESS_STEPS - 1, walk.published * PROGRESS_STEPS // max(walk.expected, 1))
        if tenths > walk.said:
            walk.said = tenths
            logger.info(
                "node %s: republish: %d of ~%d chunks published (%d %%) in %.1f s",
                self.ctx.node_id,
                walk.published,
                walk.expected,
                100 * walk.published // max(walk.expected, 1),
                time.monotonic() - walk.began,
            )

    def _finish(self, walk: _Walk) -> None:
        seconds = time.monotonic() - walk.began
        self._walk, self._cursor = None, ""
        self.stats.republish = RepublishReport(False, 0, walk.published, round(seconds, 3))
        logger.warning(
            "node %s: republished %d chunks in %.1f s (%s)", self.ctx.node_id, walk.published, seconds, walk.why
        )

    def _report(self) -> None:
        walk = self._walk
        if walk is not None:
            pending = max(walk.expected - walk.published, 0)
            seconds = round(time.monotonic() - walk.began, 3)
            self.stats.republish = RepublishReport(True, pending, walk.published, seconds)
