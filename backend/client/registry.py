"""The client's view of the node registry, and the index lookups that are read against it.

The view is refreshed in the background at most every ``REGISTRY_REFRESH_S``. A lookup
hands Redis the view's live node epochs and Redis answers which keys have a copy on one
(``backend.metadata.lookup``); a lookup that finds a copy on a node epoch the view does
not know re-reads the view if it is older than ``FRESH_VIEW_S`` (and then the keys, if
the view changed: a node's epoch, or its slot, which Redis gives anew after it lost them),
so a node that just (re)started is not taken for dead. A copy that looked stale is removed
only if, after a re-read, the live node holding its slot is not the epoch that wrote it.
Copies are read in order: nodes that just failed a read last, then the client's own
cluster, then the least loaded. A node marked down (``health``) is left out: its copies
are neither read nor counted by a lookup until its probe sees it answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

from backend.client.context import ClientContext
from backend.client.health import NodeHealth
from backend.counters import ClientCounter
from backend.errors import KVPoolError, MetadataError
from backend.metadata import IndexEntry, LiveCopies, Location, MetadataStore, NodeInfo

__all__ = ["RegistryView", "Locator", "REGISTRY_REFRESH_S", "SUSPECT_S"]

REGISTRY_REFRESH_S = 1.0
FRESH_VIEW_S = 0.1  # a registry view younger than this is trusted to call a node dead
# A node that failed a read (down, stalled, reset) is tried after its replicas for this long,
# or until it answers a read: about one heartbeat TTL, by when the registry has declared it dead.
SUSPECT_S = 5.0


class RegistryView:
    """Live nodes as last read from Redis, and which of a key's copies to read first."""

    def __init__(self, ctx: ClientContext, store: MetadataStore, health: NodeHealth) -> None:
        self.ctx = ctx
        self.store = store
        self.health = health
        self.on_change: list[Callable[[set[tuple[str, int]]], None]] = []  # told the live (id, epoch) set
        self._nodes: dict[str, NodeInfo] = {}
        self._epochs: dict[str, int] = {}  # node id -> epoch of every live node: what a lookup hands Redis
        self._by_slot: dict[int, NodeInfo] = {}  # each live node by its slot (its field in index entries)
        self._version = 0  # the registry version (and namespace marker) the view was read at
        self._marker = ""
        self._read_at = 0.0
        self._refreshing: asyncio.Task[None] | None = None
        self._suspect_until: dict[str, float] = {}  # node id -> monotonic time it is read from last until

    @property
    def age_s(self) -> float:
        return time.monotonic() - self._read_at

    async def nodes(self, refresh: bool = False) -> list[NodeInfo]:
        """Live nodes; ``refresh`` re-reads the whole registry now.

        Otherwise the view is brought up to date in the background at most every
        ``REGISTRY_REFRESH_S``, reading only the nodes that changed (one Redis command
        when none did).
        """
        if refresh or not self._read_at:
            await self.refresh(full=True)
        elif self.age_s > REGISTRY_REFRESH_S and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = self.ctx.spawn(self._refresh_quietly())
        return list(self._nodes.values())

    async def refresh(self, full: bool = False) -> None:
        """Bring the view up to date: the nodes changed since it was read, or (``full``) all of them."""
        version, marker, changed = await self.store.registry.registry_changes(
            0 if full else self._version, self._marker
        )
        if changed is None:
            nodes = {n.node_id: n for n in await self.store.registry.nodes() if n.alive}
        else:  # a node the view lacks and that expired anyway needs no read
            changed = [nid for nid in changed if nid in self._nodes or version != self._version]
            nodes = {nid: n for nid, n in self._nodes.items() if nid not in changed}
            nodes.update({n.node_id: n for n in await self.store.registry.nodes(only=changed) if n.alive})
        self._nodes, self._version, self._marker = nodes, version, marker
        self._epochs = {n.node_id: n.epoch for n in nodes.values()}
        self._by_slot = {n.slot: n for n in nodes.values() if n.slot}
        self._read_at = time.monotonic()
        live = {(n.node_id, n.epoch) for n in nodes.values()}
        for hook in self.on_change:
            hook(live)

    async def _refresh_quietly(self) -> None:
        with contextlib.suppress(KVPoolError):
            await self.refresh()

    def known(self) -> list[NodeInfo]:
        """The live nodes of the last read, without reading again."""
        return list(self._nodes.values())

    def node(self, node_id: str) -> NodeInfo | None:
        return self._nodes.get(node_id)

    def epochs(self) -> dict[str, int]:
        """Node id -> epoch of every live node in the view (not a copy: do not change it)."""
        return self._epochs

    def epochs_up(self) -> dict[str, int]:
        """:meth:`epochs` without the nodes marked down: what a lookup counts copies on."""
        if not self.health.any_down():
            return self._epochs
        return {nid: epoch for nid, epoch in self._epochs.items() if not self.health.is_down(nid, epoch)}

    def _node_of(self, loc: Location) -> NodeInfo | None:
        """The live node ``loc`` is on: by its id, or by its slot for a copy read before this view knew
        the slot's node (a node that joined since: ``Location.attributed`` is False)."""
        if loc.attributed:
            return self._nodes.get(loc.node_id)
        return self._by_slot.get(loc.slot)

    def alive(self, loc: Location) -> bool:
        node = self._node_of(loc)
        return node is not None and node.epoch == loc.epoch

    def slots(self) -> dict[str, int]:
        """Node id -> slot of every live node in the view: which index field is whose."""
        return {n.node_id: n.slot for n in self._nodes.values()}

    def written_by_live(self, loc: Location) -> bool:
        """Whether the live node that holds ``loc``'s slot now is the epoch that wrote it. A copy read from
        the index is judged by its field, not by the node id the reader's slots named when it read it:
        Redis gives slots anew after it lost them, so two nodes may have swapped theirs since."""
        node = self._by_slot.get(loc.slot) if loc.slot else self._nodes.get(loc.node_id)
        return node is not None and node.epoch == loc.epoch

    def down(self, loc: Location) -> bool:
        """A copy on a live node that is marked down: not read, not stale either."""
        return self.health.is_down(loc.node_id, loc.epoch) and self.alive(loc)

    def ordered(self, entry: Sequence[Location]) -> list[Location]:
        """Live copies not on a node marked down, each naming its node: nodes that just failed a read
        last, then same cluster first, then least loaded."""
        now = time.monotonic()
        cluster = self.ctx.config.cluster
        ranked: list[tuple[tuple[bool, int, float], Location]] = []
        for loc in entry:
            node = self._node_of(loc)
            if node is None or node.epoch != loc.epoch or self.health.is_down(node.node_id, loc.epoch):
                continue
            if not loc.attributed:  # read before the view knew its slot's node
                loc = dataclasses.replace(loc, node_id=node.node_id)
            suspect = self._suspect_until.get(node.node_id, 0.0) > now
            same = int(bool(cluster) and node.cluster == cluster)
            load = node.used_bytes / node.capacity_bytes if node.capacity_bytes else 1.0
            ranked.append(((suspect, -same, load), loc))
        ranked.sort(key=lambda pair: pair[0])
        return [loc for _, loc in ranked]

    def suspect(self, node_id: str) -> None:
        """``node_id`` failed a read: read its copies last for ``SUSPECT_S``."""
        self._suspect_until[node_id] = time.monotonic() + SUSPECT_S

    def trust(self, node_id: str) -> None:
        """``node_id`` answered a read: no longer read last."""
        self._suspect_until.pop(node_id, None)


class Locator:
    """Which keys have live copies: one Redis round trip, read against the view in Redis; stale
    entries cleaned in the background."""

    def __init__(self, ctx: ClientContext, store: MetadataStore, registry: RegistryView) -> None:
        self.ctx = ctx
        self.store = store
        self.registry = registry

    async def lookup(self, keys: Sequence[str]) -> list[IndexEntry]:
        """The live copies of each key (what a get or a lock reads next)."""
        return (await self.find(keys, prefix=False, copies=True)).copies

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a copy on a live node epoch."""
        return (await self.find(keys, prefix=False, copies=False)).hits

    async def hit_prefix(self, keys: Sequence[str]) -> int:
        """How many keys from the start have a live copy; Redis stops reading at the first that has none."""
        return (await self.find(keys, prefix=True, copies=False)).prefix

    async def find(self, keys: Sequence[str], *, prefix: bool, copies: bool) -> LiveCopies:
        """Read ``keys`` against the live view (``LiveLookup.lookup_live``); copies outside it are cleaned later.

        A copy on a node epoch the view does not hold, found while the view is older than
        ``FRESH_VIEW_S``, may be a node that just (re)started: the view is re-read and, if
        it changed, the keys read again (a second round trip, only then).
        Redis unreachable (down, restarting, failing over) reads as every key missing:
        a lookup is a hint, and a miss costs a recompute, never a failed request.
        """
        registry = self.registry
        try:
            await registry.nodes()
            found = await self._lookup(keys, prefix, copies)
            if found.others and registry.age_s > FRESH_VIEW_S:
                seen = registry.epochs(), registry.slots()
                await registry.refresh()
                if (registry.epochs(), registry.slots()) != seen:  # a node (re)started, or slots given anew
                    found = await self._lookup(keys, prefix, copies)
        except MetadataError as exc:
            self.ctx.warn_once("redis", "kvpool: Redis lookup failed, reading as misses until it is back: %s", exc)
            self.ctx.counters[ClientCounter.LOOKUP_FAILURES] += 1
            return LiveCopies.missing(len(keys))
        self.ctx.recovered("redis")
        if found.others:
            self.clean_later([(keys[i], loc) for i, loc in found.others], confirmed=False)
        return found

    async def _lookup(self, keys: Sequence[str], prefix: bool, copies: bool) -> LiveCopies:
        """One lookup against the nodes that are up; a copy on a node marked down is neither a hit nor stale."""
        found = await self.store.lookup.lookup_live(keys, self.registry.epochs_up(), prefix=prefix, copies=copies)
        if found.others and self.registry.health.any_down():
            found = dataclasses.replace(found, others=[o for o in found.others if not self.registry.down(o[1])])
        return found

    def clean_later(self, stale: Sequence[tuple[str, Location]], *, confirmed: bool) -> None:
        """Drop stale locations in the background.

        ``confirmed``: the node itself said so (miss, bad checksum). Otherwise the
        location only looked dead from this client's view, which is re-read first so
        that a view older than a node's restart never deletes a live entry.
        """
        self.ctx.spawn(self._clean_quietly(list(stale), confirmed))

    async def _clean_quietly(self, stale: list[tuple[str, Location]], confirmed: bool) -> None:
        with contextlib.suppress(KVPoolError):
            if not confirmed:
                await self.registry.refresh()
                stale = [(key, loc) for key, loc in stale if not self.registry.written_by_live(loc)]
            self.ctx.counters[ClientCounter.STALE_ENTRIES] += len(stale)
            await self.store.index.remove_stale(stale)
