"""Get with failover: each key from its best copy, through the best path to that copy's node.

Per node, the readers that serve it are tried in order (channel, same-host arena,
TCP); a key one reader hands on (:class:`Fallback`) goes to the next. Per key, a copy
that is missing, corrupt or on a failing node hands the key to its next copy in the
same call; a node that failed is read last for a while (``RegistryView.suspect``).

The index lookup and the read overlap when a node is on this host: the batch is
asked of that node (a LEASE with offsets, then the copies) while the Redis lookup is
in flight, and each chunk read that way is kept only if the index, once it answers,
lists a live copy with the same checksum. A chunk the index does not vouch for is
handed back and read as usual, so a deleted or replaced key is never returned.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from backend.client.chunks import (
    Declined,
    Failed,
    Fallback,
    Hit,
    Miss,
    OtherLayout,
    Outcome,
    Sink,
    Wanted,
    release_hits,
)
from backend.client.context import ClientContext, logger
from backend.client.registry import Locator, RegistryView
from backend.counters import ClientCounter
from backend.errors import IntegrityError, KVPoolError, NodeUnavailable
from backend.metadata import Location, NodeInfo

__all__ = ["Reader", "Getter"]

T = TypeVar("T")
_Early = tuple[str, int, "asyncio.Task[list[Outcome]]"]  # (node id, index of its reader, the read)


class Reader(Protocol):
    """One read path. ``read`` answers one outcome per key, in order; it raises only when the
    node failed as a whole, and then holds no buffer of the sink's."""

    name: str
    speculative: bool  # cheap to ask before the lookup: its request carries no payload

    def serves(self, node: NodeInfo) -> bool: ...

    async def read(self, node: NodeInfo, wanted: Sequence[Wanted], sink: Sink[Any]) -> list[Outcome]: ...


class Getter:
    """Reads keys into a sink's buffers from their best live copies, failing over between copies."""

    def __init__(self, ctx: ClientContext, registry: RegistryView, locator: Locator, readers: list[Reader]) -> None:
        self.ctx = ctx
        self.registry = registry
        self.locator = locator
        self.readers = readers  # best first; the last one (TCP) serves every node and never falls back

    async def get(self, keys: Sequence[str], sink: Sink[T]) -> list[T | None]:
        """Fetch ``keys``; misses are None. Every chunk returned was verified against its checksum."""
        results: list[Any] = [None] * len(keys)
        if not keys:
            return results
        early = self._read_early(keys, sink)
        tasks: list[asyncio.Task[list[Outcome]]] = [early[2]] if early is not None else []
        # (node id, first reader to try) per key that the early read handed on: never asked twice
        resume: dict[int, tuple[str, int]] = {}
        try:
            entries = await self.locator.lookup(keys)
            candidates = [self.registry.ordered(entry) for entry in entries]
            if early is not None:
                await asyncio.wait(tasks)
                resume = self._keep_vouched(early, candidates, results, sink)
                tasks = []
            stale: list[tuple[str, Location]] = []  # copies a node said it lacks or corrupted
            todo = [i for i, copies in enumerate(candidates) if copies and results[i] is None]
            while todo:
                groups: dict[tuple[str, int], list[int]] = defaultdict(list)
                for i in todo:
                    nid = candidates[i][0].node_id
                    groups[(nid, resume[i][1] if resume.get(i, ("", 0))[0] == nid else 0)].append(i)
                tasks = [
                    asyncio.ensure_future(
                        self._read_copies(nid, [Wanted(keys[i], candidates[i][0].nbytes) for i in idx], sink, first)
                    )
                    for (nid, first), idx in groups.items()
                ]
                await asyncio.wait(tasks)
                todo = []
                for ((nid, _), idx), task in zip(groups.items(), tasks):
                    for i, outcome in zip(idx, self._node_outcomes(nid, task, len(idx))):
                        loc = candidates[i].pop(0)
                        if isinstance(outcome, Hit):
                            results[i] = outcome.handle
                        elif not isinstance(outcome, Declined):
                            self._copy_failed(keys[i], loc, outcome, stale)
                            if candidates[i]:
                                todo.append(i)
                                self.ctx.counters[ClientCounter.GET_FAILOVERS] += isinstance(outcome, Failed)
                tasks = []
        except BaseException:
            # Cancelled (LMCache gave up) or failed: hand back every buffer taken so far.
            for task in tasks:
                if task.done():
                    _release_task(task, sink)
                else:
                    task.cancel()
                    task.add_done_callback(lambda t: _release_task(t, sink))
            for handle in results:
                if handle is not None:
                    sink.release(handle)
            raise
        if stale:
            self.locator.clean_later(stale, confirmed=True)
        hits = sum(1 for r in results if r is not None)
        self.ctx.counters[ClientCounter.GET_HITS] += hits
        self.ctx.counters[ClientCounter.GET_MISSES] += len(keys) - hits
        return results

    def _read_early(self, keys: Sequence[str], sink: Sink[Any]) -> _Early | None:
        """Start reading every key from the one node on this host, if there is exactly one."""
        local = [
            (node, index)
            for node in self.registry.known()
            if not self.registry.health.is_down(node.node_id, node.epoch)
            for index, reader in enumerate(self.readers)
            if reader.speculative and reader.serves(node)
        ]
        if len(local) != 1:
            return None
        node, index = local[0]
        self.ctx.counters[ClientCounter.EARLY_READS] += 1
        read = self.readers[index].read(node, [Wanted(key, 0) for key in keys], sink)
        return node.node_id, index, asyncio.ensure_future(read)

    def _keep_vouched(
        self, early: _Early, candidates: list[list[Location]], results: list[Any], sink: Sink[Any]
    ) -> dict[int, tuple[str, int]]:
        """Keep each early hit whose checksum a live copy in the index has; hand back the rest.

        Returns the keys that reader handed on, with the next reader to try on that node.
        """
        nid, index, task = early
        if task.cancelled() or task.exception() is not None:
            return {}  # the usual read finds out what is wrong with that node
        resume = {}
        for i, outcome in enumerate(task.result()):
            if isinstance(outcome, Fallback):
                resume[i] = (nid, index + 1)
            elif not isinstance(outcome, Hit):
                continue
            elif any(loc.checksum == outcome.checksum for loc in candidates[i]):
                results[i] = outcome.handle
            else:
                sink.release(outcome.handle)
        return resume

    def _node_outcomes(self, nid: str, task: asyncio.Task[list[Outcome]], count: int) -> list[Outcome]:
        """A node's outcomes; a node that failed as a whole fails each of its keys (and is read last a while)."""
        error = task.exception()
        if error is None:
            self.ctx.recovered(f"get:{nid}")
            self.registry.trust(nid)
            return task.result()
        if not isinstance(error, KVPoolError):
            raise error
        self.ctx.warn_once(
            f"get:{nid}", "kvpool: get from node %s failed; its keys go to replicas, else miss: %s", nid, error
        )
        self.registry.suspect(nid)
        return [Failed(error)] * count

    def _copy_failed(self, key: str, loc: Location, outcome: Outcome, stale: list[tuple[str, Location]]) -> None:
        """A copy did not deliver: a missing or corrupt copy leaves the index (a failed node keeps its entries;
        a copy of another layout is fine, for the engines of its layout)."""
        if isinstance(outcome, OtherLayout):
            self.ctx.counters[ClientCounter.LAYOUT_MISSES] += 1
            self.ctx.warn_once(
                "layout",
                "kvpool: %r is held (node %s) from an engine of another KV layout (model, dtype, shape, chunk size, "
                "TP or KV-cache groups differ): read as a miss, no bytes (counted as layout_misses; docs/design.md, "
                "'layout fingerprint')",
                key,
                loc.node_id,
            )
        elif isinstance(outcome, Miss):
            stale.append((key, loc))
        elif isinstance(outcome, Failed) and isinstance(outcome.error, IntegrityError):
            self.ctx.counters[ClientCounter.INTEGRITY_FAILURES] += 1
            logger.warning("kvpool: %s on node %s; dropping that copy", outcome.error, loc.node_id)
            stale.append((key, loc))

    async def _read_copies(self, nid: str, wanted: list[Wanted], sink: Sink[Any], first: int) -> list[Outcome]:
        node = self.registry.node(nid)
        if node is None:  # left the view since the lookup
            raise NodeUnavailable(f"node {nid} is no longer alive")
        return await self.read_node(node, wanted, sink, first)

    async def read_node(
        self, node: NodeInfo, wanted: Sequence[Wanted], sink: Sink[Any], first: int = 0
    ) -> list[Outcome]:
        """Read from one node, each key through the first of this node's paths (from ``first``) that delivers it."""
        outcomes: list[Outcome | None] = [None] * len(wanted)
        pending = list(range(len(wanted)))
        try:
            for reader in self.readers[first:]:
                if not pending:
                    break
                if not reader.serves(node):
                    continue
                handed_on = []
                for i, outcome in zip(pending, await reader.read(node, [wanted[i] for i in pending], sink)):
                    if isinstance(outcome, Fallback):
                        handed_on.append(i)
                    else:
                        outcomes[i] = outcome
                pending = handed_on
        except BaseException:
            release_hits(sink, [o for o in outcomes if o is not None])
            raise
        for i in pending:  # only when no reader serves the node: the readers end with TCP
            outcomes[i] = Failed(NodeUnavailable(f"no read path to node {node.node_id}"))
        return [o for o in outcomes if o is not None]


def _release_task(task: asyncio.Task[list[Outcome]], sink: Sink[Any]) -> None:
    if not task.cancelled() and task.exception() is None:
        release_hits(sink, task.result())
