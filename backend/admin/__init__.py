"""Admin operations behind the CLI: inspect, move and repair a pool.

Each function takes a :class:`PoolClient`; the CLI only parses arguments and
prints. The listings ``status``, ``nodes`` and ``stats`` return typed values
(:class:`PoolStatus`, :class:`NodeRow`, :class:`PoolStats`), built from the nodes'
typed STAT answers (``backend.protocol.NodeReport``); ``ls`` streams JSON-ready rows; the
operations that remove, move or repair (evict, drain, flush, check) return a report
dataclass. Each one's ``to_json()`` is what ``--json`` prints. Nothing here holds more than
one batch of chunk bytes at a time. A node that refuses this client's token fails the
verb (AuthError naming the node): figures or removals without it would mislead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backend.client import Chunk, PoolClient
from backend.client.index import glob_escape
from backend.errors import AuthError, CapacityError, ConfigError, KVPoolError, MetadataError
from backend.latency import Histogram, LatencyHistograms
from backend.metadata import LiveNamespaces, Location, NodeInfo, RedisMemory
from backend.protocol import InventoryRow, NodeReport, TierReport, Verified, tiers_from_json

__all__ = [
    "RedisMemory",
    "redis_memory",
    "pool_status",
    "node_rows",
    "iter_keys",
    "pool_stats",
    "evict",
    "drain",
    "undrain",
    "flush",
    "check",
    "DrainReport",
    "EvictReport",
    "FlushReport",
    "CheckReport",
    "CheckFixes",
    "Copy",
    "PoolStatus",
    "StatusNode",
    "RecentHits",
    "NodeRow",
    "PoolStats",
    "OpLatency",
]

DRAIN_BATCH_ITEMS = 64
DRAIN_BATCH_BYTES = 256 * 1024 * 1024  # memory a drain holds at once
SCAN_BATCH = 1000  # index keys per batch when evicting or flushing by pattern
CHECK_SAMPLE = 100  # chunks whose checksum `check` re-verifies without --deep

UNMARK_TIMEOUT_S = 5.0  # a drain that stops clears its mark within this, or leaves it for `kvpool undrain`

Progress = Callable[[int, int], None]  # (done, total)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainReport:
    """What ``drain`` did: chunks copied elsewhere, already safe elsewhere, or unreadable on the node."""

    node_id: str
    moved: int
    already_elsewhere: int
    unreadable: int
    draining: bool = True  # the node stays marked draining: placement sends it nothing new
    # `kvpool undrain` cleared the mark while this drain ran: it stopped after the batch it was on,
    # and what is left of the node's chunks stays there (the node takes writes again).
    stopped_by_undrain: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EvictReport:
    """What ``evict`` did: chunks removed everywhere, and those kept because their node refused the delete."""

    evicted: int  # chunks that existed and are gone: bytes deleted, index entries removed
    kept: int = 0  # chunks with a copy on a node that refused: that copy and its index entry stay
    refused: dict[str, str] = dataclasses.field(default_factory=dict)  # node id -> why it refused

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FlushReport:
    chunks_deleted: int
    index_entries_removed: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Copy:
    """One copy of a chunk that ``check`` reports: the key and where its bytes are (or were)."""

    key: str
    node_id: str
    epoch: int
    tier: str
    nbytes: int

    @classmethod
    def of(cls, key: str, loc: Location) -> Copy:
        return cls(key, loc.node_id, loc.epoch, loc.tier, loc.nbytes)


@dataclass(frozen=True)
class CheckFixes:
    """What ``check --fix`` repaired."""

    entries_removed: int
    bytes_reindexed: int
    dead_nodes_forgotten: int
    legacy_entries_removed: int = 0  # index keys of the release before this index schema, deleted


@dataclass(frozen=True)
class CheckReport:
    """What ``check`` found (and, with ``fix``, repaired)."""

    index_entries: int  # index entries walked
    verified: int  # copies whose checksum their node re-checked
    orphan_entries: list[Copy]  # index entries whose node does not hold the bytes
    orphan_bytes: list[Copy]  # bytes on a node that no index entry points at
    corrupt: list[Copy]  # copies whose checksum failed (their node dropped them)
    dead_node_entries: list[Copy]  # index entries of dead nodes, or of a node's ended run
    dead_nodes: list[str]  # registered nodes that are not alive
    fixed: CheckFixes | None = None
    # Index keys of the release before this index schema (kvp:NS:k:{key}): nothing reads them (an upgraded
    # node republishes what it holds), but they take Redis memory until --fix deletes them.
    legacy_entries: int = 0

    @property
    def problems(self) -> int:
        return len(self.corrupt) + self.repairable

    @property
    def repairable(self) -> int:
        """What ``--fix`` changes. Corrupt copies are not counted: their node took each out of
        use (and out of the index) the moment it found it, as it does on any read."""
        found = len(self.orphan_entries) + len(self.orphan_bytes) + len(self.dead_node_entries) + len(self.dead_nodes)
        return found + self.legacy_entries

    def to_json(self) -> dict[str, Any]:
        """The report as ``kvpool check --json`` prints it (``fixed`` is ``{}`` when nothing was repaired)."""
        out = dataclasses.asdict(self)
        out["fixed"] = out["fixed"] or {}
        out["problems"] = self.problems
        return out


def _match(model: str | None, prefix: str | None) -> str:
    if model and prefix:
        raise ConfigError("--prefix", "give --model or --prefix, not both")
    if model:
        return glob_escape(model) + "@*"
    if prefix:
        return glob_escape(prefix) + "*"
    return "*"


def _refused(node: NodeInfo, exc: AuthError) -> AuthError:
    """``exc`` naming the node that refused (the node's own answer does not)."""
    text = str(exc).removeprefix("node: ")
    named = f"node {node.node_id}"
    if named in text:
        return AuthError(text.replace(named, f"{named} ({node.address})", 1))
    return AuthError(f"{named} ({node.address}) refused the request: {text}")


async def _stats_of(client: PoolClient, nodes: Sequence[NodeInfo]) -> dict[str, NodeReport]:
    """Each live node's STAT answer. A node that refuses the token fails the call: figures
    without it would look like an empty pool. One that does not answer is left out."""
    out: dict[str, NodeReport] = {}
    for node in nodes:
        if node.alive:
            try:
                out[node.node_id] = await client.node_admin.stats(node)
            except AuthError as exc:
                raise _refused(node, exc) from None
            except KVPoolError:
                pass  # the registry's figures (up to a heartbeat old) stand
    return out


@dataclass(frozen=True)
class RecentHits:
    """Gets and hits over the nodes' recent windows (the longest of them is ``window_s``)."""

    window_s: float
    gets: int
    hits: int

    @property
    def hit_rate(self) -> float | None:
        return round(self.hits / self.gets, 4) if self.gets else None


@dataclass(frozen=True)
class StatusNode:
    """One registered node, as ``kvpool status`` lists it."""

    node_id: str
    address: str
    alive: bool
    draining: bool
    epoch: int
    capacity_bytes: int
    used_bytes: int
    objects: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PoolStatus:
    """What ``kvpool status`` shows: Redis, the nodes, capacity and tiers, objects, hit rates."""

    redis_url: str
    rtt_ms: float
    namespace: str
    alive: int  # nodes
    dead: int
    draining: int
    capacity_bytes: int  # of the live nodes, as are the figures below
    used_bytes: int
    free_bytes: int
    objects: int
    tiers: dict[str, TierReport]  # summed over the nodes that answered STAT
    gets: int
    hits: int
    recent: RecentHits
    node_list: tuple[StatusNode, ...]
    redis_memory: RedisMemory | None = None  # None: Redis did not say (INFO not allowed to this user)
    # With no live node here: the namespaces of this Redis that have some (a URL naming the wrong one?).
    elsewhere: LiveNamespaces | None = None

    @property
    def hit_rate(self) -> float | None:
        return round(self.hits / self.gets, 4) if self.gets else None

    def to_json(self) -> dict[str, Any]:
        redis: dict[str, Any] = {"url": self.redis_url, "reachable": True, "rtt_ms": self.rtt_ms}
        if self.redis_memory is not None:
            redis.update(
                full=self.redis_memory.full,
                used_memory_bytes=self.redis_memory.used_bytes,
                maxmemory_bytes=self.redis_memory.max_bytes,
                maxmemory_policy=self.redis_memory.policy,
            )
        return {
            "redis": redis,
            "namespace": self.namespace,
            "nodes": {"alive": self.alive, "dead": self.dead, "draining": self.draining},
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "objects": self.objects,
            "tiers": {
                name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "objects": t.objects}
                for name, t in self.tiers.items()
            },
            "gets": self.gets,
            "hits": self.hits,
            "hit_rate": self.hit_rate,
            "recent": {
                "window_s": self.recent.window_s,
                "gets": self.recent.gets,
                "hits": self.recent.hits,
                "hit_rate": self.recent.hit_rate,
            },
            "node_list": [n.to_json() for n in self.node_list],
            "namespaces_with_live_nodes": None if self.elsewhere is None else dict(self.elsewhere.live),
        }


async def redis_memory(client: PoolClient) -> RedisMemory | None:
    """Redis's memory (whether it is full), or None where Redis does not say (an ACL user without INFO)."""
    try:
        return await client.index.memory()
    except MetadataError:
        return None


async def pool_status(client: PoolClient) -> PoolStatus:
    """Redis, nodes, capacity, objects and hit rate: what ``kvpool status`` shows."""
    rtt_ms = await client.index.ping()
    memory = await redis_memory(client)
    nodes = await client.index.nodes()
    stats = await _stats_of(client, nodes)
    alive = [n for n in nodes if n.alive]
    for node in alive:
        if node.node_id in stats:
            node.used_bytes = sum(t.used_bytes for t in stats[node.node_id].tiers.values())
            node.object_count = stats[node.node_id].objects
    tiers: dict[str, TierReport] = {}
    for s in stats.values():
        for name, tier in s.tiers.items():
            total = tiers.get(name, TierReport(0, 0, 0))
            tiers[name] = TierReport(
                total.capacity_bytes + tier.capacity_bytes,
                total.used_bytes + tier.used_bytes,
                total.objects + tier.objects,
            )
    return PoolStatus(
        redis_url=client.config.redis_url,
        rtt_ms=round(rtt_ms, 3),
        namespace=client.config.namespace,
        alive=len(alive),
        dead=len(nodes) - len(alive),
        draining=sum(1 for n in nodes if n.draining),
        capacity_bytes=sum(n.capacity_bytes for n in alive),
        used_bytes=sum(n.used_bytes for n in alive),
        free_bytes=sum(n.free_bytes for n in alive),
        objects=sum(n.object_count for n in alive),
        tiers=tiers,
        gets=sum(s.counters.get("gets", 0) for s in stats.values()),
        hits=sum(s.counters.get("hits", 0) for s in stats.values()),
        recent=RecentHits(
            window_s=max((s.recent.window_s for s in stats.values()), default=0),
            gets=sum(s.recent.gets for s in stats.values()),
            hits=sum(s.recent.hits for s in stats.values()),
        ),
        node_list=tuple(
            StatusNode(
                node_id=n.node_id,
                address=n.address,
                alive=n.alive,
                draining=n.draining,
                epoch=n.epoch,
                capacity_bytes=n.capacity_bytes,
                used_bytes=n.used_bytes,
                objects=n.object_count,
            )
            for n in nodes
        ),
        redis_memory=memory,
        elsewhere=None if alive else await client.index.live_namespaces(),
    )


@dataclass(frozen=True)
class NodeRow:
    """One registered node, as ``kvpool nodes`` shows it: from its STAT answer, or the registry without one."""

    node_id: str
    host: str  # the node machine's hostname, as it registered ("" from a node that did not say)
    address: str
    cluster: str
    epoch: int
    alive: bool
    draining: bool
    uptime_s: float
    tiers: dict[str, TierReport]
    requests_per_s: float | None  # None: the node did not answer STAT
    last_heartbeat_s: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "host": self.host,
            "address": self.address,
            "cluster": self.cluster,
            "epoch": self.epoch,
            "alive": self.alive,
            "draining": self.draining,
            "uptime_s": self.uptime_s,
            "tiers": {name: tier.to_json() for name, tier in self.tiers.items()},
            "requests_per_s": self.requests_per_s,
            "last_heartbeat_s": self.last_heartbeat_s,
        }


async def node_rows(client: PoolClient) -> list[NodeRow]:
    """One row per registered node: what ``kvpool nodes`` shows."""
    nodes = await client.index.nodes()
    stats = await _stats_of(client, nodes)
    now = time.time()
    rows = []
    for n in nodes:
        s = stats.get(n.node_id)
        rows.append(
            NodeRow(
                node_id=n.node_id,
                host=n.hostname,
                address=n.address,
                cluster=n.cluster,
                epoch=n.epoch,
                alive=n.alive,
                draining=n.draining,
                uptime_s=round(s.uptime_s if s else now - n.started_at, 1),
                tiers=s.tiers if s else tiers_from_json(n.tiers),
                requests_per_s=s.recent.requests_per_s if s else None,
                last_heartbeat_s=round(now - n.heartbeat_at, 1) if n.heartbeat_at else None,
            )
        )
    return rows


async def iter_keys(
    client: PoolClient, *, model: str | None = None, prefix: str | None = None, limit: int | None = None
) -> AsyncIterator[dict[str, Any]]:
    """Stream index entries (SCAN, never KEYS): key, node, its host, tier, size, and the node epoch that
    wrote it. The CLI holds one SCAN batch (1,000 keys) at a time, however large the index."""
    hosts = {n.node_id: n.hostname for n in await client.index.nodes()}
    count = 0
    async for batch in client.index.scan_entries(_match(model, prefix)):
        for key, entry in batch:
            for loc in entry:
                yield {
                    "key": key,
                    "node_id": loc.node_id,
                    "host": hosts.get(loc.node_id, ""),
                    "tier": loc.tier,
                    "nbytes": loc.nbytes,
                    "epoch": loc.epoch,
                }
            count += 1
            if limit is not None and count >= limit:
                return


@dataclass(frozen=True)
class OpLatency:
    """One op's requests served and estimated p50/p99 service time, over the nodes."""

    count: int
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class PoolStats:
    """What ``kvpool stats`` shows: counters summed over the nodes, and service time per op."""

    nodes: int  # that answered STAT
    counters: dict[str, int]  # by name
    latency: dict[str, OpLatency]  # by op, ops never served left out

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "counters": dict(self.counters),
            "latency": {op: dataclasses.asdict(v) for op, v in self.latency.items()},
        }


async def pool_stats(client: PoolClient) -> PoolStats:
    """Counters summed over live nodes, and per op the requests served and p50/p99 service time.

    The quantiles are estimated from the nodes' latency histograms added together
    (``backend.latency``), so they cover every request since each node started.
    """
    nodes = await client.index.nodes()
    stats = await _stats_of(client, nodes)
    totals: dict[str, int] = defaultdict(int)
    summed: dict[str, Histogram] = {}
    for s in stats.values():
        for name, value in s.counters.items():
            totals[name] += value
        if s.latency is None:
            continue  # a node of a version before the histograms
        for op, histogram in LatencyHistograms.from_json(s.latency).ops.items():
            if op not in summed:
                summed[op] = Histogram(histogram.bounds)
            if histogram.bounds == summed[op].bounds:  # nodes of one version share their buckets
                summed[op].add(histogram)
    latency = {
        op: OpLatency(h.count, round(h.quantile(0.5) * 1000, 3), round(h.quantile(0.99) * 1000, 3))
        for op, h in sorted(summed.items())
        if h.count
    }
    return PoolStats(len(stats), dict(sorted(totals.items())), latency)


async def evict(
    client: PoolClient, keys: Sequence[str] = (), *, model: str | None = None, prefix: str | None = None
) -> EvictReport:
    """Remove chunks everywhere: each node deletes its copies (and withdraws their index entries),
    then the entries left (dead nodes', copies a node no longer held) go.

    A copy whose node refuses the delete (a wrong token) keeps its bytes and its index
    entry, so the index never loses track of bytes that still take room; the report
    names the node and why.
    """
    if keys:
        return await _evict_batch(client, list(keys))
    if not model and not prefix:
        raise ConfigError("evict", "name keys, or --model / --prefix")
    total = EvictReport(0)
    async for batch in client.index.scan_key_batches(_match(model, prefix), SCAN_BATCH):
        done = await _evict_batch(client, batch)
        total = EvictReport(total.evicted + done.evicted, total.kept + done.kept, {**total.refused, **done.refused})
    return total


async def _evict_batch(client: PoolClient, keys: list[str]) -> EvictReport:
    entries = await client.index.lookup(keys)
    holders: dict[str, list[str]] = defaultdict(list)
    for key, entry in zip(keys, entries):
        for loc in entry:
            holders[loc.node_id].append(key)
    live = {n.node_id: n for n in await client.nodes(refresh=True)}
    refused: dict[str, str] = {}
    for node_id, node_keys in holders.items():
        node = live.get(node_id)
        if node is None:
            continue  # a dead node's copies: nobody can read them; their entries go below
        try:
            await client.node_admin.delete_on(node, node_keys)
        except AuthError as exc:
            refused[node_id] = str(_refused(node, exc))
        except KVPoolError as exc:
            refused[node_id] = f"node {node_id} ({node.address}): {exc}"
    kept = {key for node_id in refused for key in holders[node_id]}
    stale = [(key, loc) for key, entry in zip(keys, entries) for loc in entry if loc.node_id not in refused]
    await client.index.remove_stale(stale)
    existed = sum(1 for key, entry in zip(keys, entries) if entry and key not in kept)
    return EvictReport(existed, len(kept), refused)


async def drain(
    client: PoolClient,
    node_id: str,
    *,
    to: str | None = None,
    batch: int = DRAIN_BATCH_ITEMS,
    progress: Progress | None = None,
) -> DrainReport:
    """Move every chunk off ``node_id`` (bytes verified on the way), leaving it draining.

    Checked before anything is marked: the node answers with this client's token, and
    another live node that is not draining (``to``, when given) can take its chunks.
    Then the node is marked draining, so placement sends no new writes there. Each
    batch is read from the node, written elsewhere, and only then deleted from the
    node: interrupting at any point loses nothing, and running again resumes.

    The mark belongs to this run: a drain that stops before the end (an error, Ctrl-C)
    clears the mark it set, so the node takes writes again. A finished drain leaves it
    until the node stops (deregistering clears it) or ``undrain``. A drain whose mark
    ``undrain`` clears while it runs sees it before its next batch and stops there, every
    batch it took either moved whole or not started (``stopped_by_undrain``).
    """
    source = await client.node(node_id)
    await _check_targets(client, source, to)
    try:
        total = (await client.node_admin.stats(source)).objects
    except AuthError as exc:
        raise _refused(source, exc) from None
    marked = await client.index.set_draining(node_id, True)
    try:
        return await _move_all(client, source, to, batch, total, progress)
    except BaseException:
        if marked:
            await _unmark(client, node_id)
        raise


async def _check_targets(client: PoolClient, source: NodeInfo, to: str | None) -> None:
    """Raise unless some live node other than ``source`` takes writes (``to``, when given)."""
    if to is not None:
        target = await client.node(to)
        if target.node_id == source.node_id:
            raise ConfigError("--to", "the target is the node being drained")
        if target.draining:
            raise ConfigError(
                "--to", f"node {to!r} is draining itself: it takes no writes (`kvpool undrain {to}` ends its drain)"
            )
        return
    others = [n for n in await client.nodes(refresh=True) if n.node_id != source.node_id and not n.draining]
    if not others:
        raise CapacityError(
            f"nowhere to move the chunks of node {source.node_id!r}: no other live node in namespace "
            f"{client.config.namespace!r} takes writes; start one first (nothing was marked)"
        )


async def _unmark(client: PoolClient, node_id: str) -> None:
    """Clear the draining mark of a drain that did not finish (bounded: a Redis down leaves it, logged)."""
    try:
        async with asyncio.timeout(UNMARK_TIMEOUT_S):
            await client.index.set_draining(node_id, False)
    except (KVPoolError, TimeoutError) as exc:
        logger.warning(
            "kvpool: node %s stays marked draining (%s); `kvpool undrain %s` clears it", node_id, exc, node_id
        )


async def _move_all(
    client: PoolClient, source: NodeInfo, to: str | None, batch: int, total: int, progress: Progress | None
) -> DrainReport:
    """Copy every chunk of ``source`` elsewhere (unless a live node confirms another copy), then delete it there."""
    node_id = source.node_id
    await client.nodes(refresh=True)
    moved = already = lost = 0
    async for page in client.node_admin.inventory_pages(source):
        for group in _groups(page, batch):
            live = {n.node_id: n for n in await client.nodes(refresh=True)}
            if node_id in live and not live[node_id].draining:  # `kvpool undrain` ended this drain
                logger.info("kvpool: drain of %s stopped: its draining mark was cleared (kvpool undrain)", node_id)
                return DrainReport(node_id, moved, already, lost, draining=False, stopped_by_undrain=True)
            entries = await client.index.lookup([row.key for row in group])
            claimed: dict[str, list[str]] = defaultdict(list)  # node id -> keys the index says it holds
            for row, entry in zip(group, entries):
                for loc in entry:
                    if _safe_copy(loc, row, node_id, live):
                        claimed[loc.node_id].append(row.key)
            elsewhere = await _confirmed(client, live, claimed)
            copy = [(row.key, row.nbytes) for row in group if row.key not in elsewhere]
            fetched = await client.fetch_from(source, copy) if copy else []
            chunks = [
                Chunk(f.meta.key, f.data, f.meta.dtype, f.meta.shape, f.meta.fmt) for f in fetched if f is not None
            ]
            lost += sum(1 for f in fetched if f is None)
            if chunks:
                await client.put(chunks, only=[to] if to else None)
            done = [c.key for c in chunks] + sorted(elsewhere)
            if done:
                await client.node_admin.delete_on(source, done)
            moved += len(chunks)
            already += len(elsewhere)
            if progress is not None:
                progress(moved + already + lost, max(total, moved + already + lost))
    return DrainReport(node_id, moved, already, lost)


async def undrain(client: PoolClient, node_id: str) -> bool:
    """End a drain: placement sends ``node_id`` writes again, and a drain still running on it
    stops after the batch it is on. Whether it was marked draining."""
    return await client.index.set_draining(node_id, False)


def _safe_copy(loc: Location, row: InventoryRow, draining: str, live: dict[str, NodeInfo]) -> bool:
    """Whether ``loc`` is another good copy of inventory ``row``: live node, same epoch, same bytes."""
    node = live.get(loc.node_id)
    return loc.node_id != draining and node is not None and node.epoch == loc.epoch and loc.checksum == row.checksum


async def _confirmed(client: PoolClient, live: dict[str, NodeInfo], claimed: dict[str, list[str]]) -> set[str]:
    """The keys whose other copy its node confirms holding (EXISTS), one request per node.

    The registry lists a node that died until its heartbeat expires; deleting the
    drained copy on the strength of a dead node's entry would lose the key. A node
    that does not answer confirms nothing, so its keys are copied.
    """
    held: set[str] = set()
    for nid, keys in claimed.items():
        try:
            present = await client.node_admin.exists(live[nid], keys)
        except KVPoolError:
            continue
        held.update(key for key, here in zip(keys, present) if here)
    return held


def _groups(page: list[InventoryRow], batch: int) -> list[list[InventoryRow]]:
    """Split inventory rows into groups of at most ``batch`` chunks and ``DRAIN_BATCH_BYTES``."""
    groups: list[list[InventoryRow]] = [[]]
    size = 0
    for row in page:
        if groups[-1] and (len(groups[-1]) >= batch or size + row.nbytes > DRAIN_BATCH_BYTES):
            groups.append([])
            size = 0
        groups[-1].append(row)
        size += row.nbytes
    return [g for g in groups if g]


async def flush(client: PoolClient, progress: Progress | None = None) -> FlushReport:
    """Wipe the namespace's data: every node's chunks and every index entry (nodes stay)."""
    deleted = 0
    nodes = await client.nodes(refresh=True)
    total = sum([(await client.node_admin.stats(n)).objects for n in nodes])
    for node in nodes:
        async for page in client.node_admin.inventory_pages(node):
            deleted += sum(await client.node_admin.delete_on(node, [row.key for row in page]))
            if progress is not None:
                progress(deleted, max(total, deleted))
    removed = 0
    async for batch in client.index.scan_key_batches(batch=SCAN_BATCH):
        removed += await client.index.delete(batch)
    removed += await client.index.legacy_entries(remove=True)
    return FlushReport(deleted, removed)


async def check(
    client: PoolClient, *, fix: bool = False, deep: bool = False, progress: Progress | None = None
) -> CheckReport:
    """fsck for the pool: index vs bytes on nodes, checksums, dead nodes; ``fix`` repairs.

    Finds index entries whose bytes are gone, bytes no entry points at, copies whose
    checksum fails (a sample, or all with ``deep``), and entries of dead nodes. The steps:
    scan the index (verifying held copies as it goes), scan the nodes' inventories,
    then, with ``fix``, repair.
    """
    nodes = await client.index.nodes()
    alive = {n.node_id: n for n in nodes if n.alive}
    found = _Findings(dead_nodes=[n.node_id for n in nodes if not n.alive])
    await _scan_index(client, alive, found, deep=deep, progress=progress)
    await _scan_inventories(client, alive, found)
    found.legacy = await client.index.legacy_entries()
    report = found.report()
    if fix and report.problems:
        report = dataclasses.replace(report, fixed=await _repair(client, found))
    return report


_Found = tuple[str, Location]  # a key and one copy of it


@dataclass
class _Findings:
    """What ``check`` found so far; each step adds to it."""

    dead_nodes: list[str]
    scanned: int = 0  # index entries walked
    verified: int = 0
    orphan_entries: list[_Found] = dataclasses.field(default_factory=list)
    orphan_bytes: list[_Found] = dataclasses.field(default_factory=list)
    corrupt: list[_Found] = dataclasses.field(default_factory=list)
    dead_entries: list[_Found] = dataclasses.field(default_factory=list)
    legacy: int = 0  # index keys of the release before this schema

    def report(self) -> CheckReport:
        return CheckReport(
            index_entries=self.scanned,
            verified=self.verified,
            orphan_entries=[Copy.of(k, loc) for k, loc in self.orphan_entries],
            orphan_bytes=[Copy.of(k, loc) for k, loc in self.orphan_bytes],
            corrupt=[Copy.of(k, loc) for k, loc in self.corrupt],
            dead_node_entries=[Copy.of(k, loc) for k, loc in self.dead_entries],
            dead_nodes=list(self.dead_nodes),
            legacy_entries=self.legacy,
        )


async def _scan_index(
    client: PoolClient, alive: dict[str, NodeInfo], found: _Findings, *, deep: bool, progress: Progress | None
) -> None:
    """Scan step: each indexed copy is a dead node's, missing from its node, or held (then verified)."""
    async for batch in client.index.scan_entries():
        by_node: dict[str, list[_Found]] = defaultdict(list)
        for key, entry in batch:
            for loc in entry:
                node = alive.get(loc.node_id)
                if node is None or node.epoch != loc.epoch:
                    found.dead_entries.append((key, loc))
                else:
                    by_node[loc.node_id].append((key, loc))
        for nid, pairs in by_node.items():
            present = await client.node_admin.exists(alive[nid], [k for k, _ in pairs])
            held = [pair for pair, here in zip(pairs, present) if here]
            found.orphan_entries += [pair for pair, here in zip(pairs, present) if not here]
            await _verify(client, alive[nid], held, found, deep=deep)
        found.scanned += len(batch)
        if progress is not None:
            progress(found.scanned, found.scanned)


async def _verify(client: PoolClient, node: NodeInfo, held: list[_Found], found: _Findings, *, deep: bool) -> None:
    """Verify step: the node re-checks the checksums of its held copies (all with ``deep``,
    else until ``CHECK_SAMPLE`` copies are verified); one that fails is corrupt, and its
    node has dropped it."""
    to_verify = held if deep else held[: max(0, CHECK_SAMPLE - found.verified)]
    if not to_verify:
        return
    status = await client.node_admin.verify(node, [k for k, _ in to_verify])
    found.corrupt += [pair for pair, st in zip(to_verify, status) if st != Verified.OK]
    found.verified += len(to_verify)


async def _scan_inventories(client: PoolClient, alive: dict[str, NodeInfo], found: _Findings) -> None:
    """Scan step: bytes on a live node that no index entry points at."""
    for node in alive.values():
        async for page in client.node_admin.inventory_pages(node):
            entries = await client.index.lookup([row.key for row in page])
            for row, entry in zip(page, entries):
                if not any(loc.node_id == node.node_id and loc.epoch == node.epoch for loc in entry):
                    found.orphan_bytes.append(
                        (row.key, Location(node.node_id, node.epoch, row.tier, row.nbytes, row.checksum))
                    )


async def _repair(client: PoolClient, found: _Findings) -> CheckFixes:
    """Repair step (``check --fix``), against a fresh view: a node may have come back or restarted meanwhile."""
    fresh = {n.node_id: n for n in await client.index.nodes() if n.alive}

    def still_dead(loc: Location) -> bool:
        node = fresh.get(loc.node_id)
        return node is None or node.epoch != loc.epoch

    dead_entries = [(k, loc) for k, loc in found.dead_entries if still_dead(loc)]
    dead = [node_id for node_id in found.dead_nodes if node_id not in fresh]
    reindex = await _still_orphaned(client, found.orphan_bytes, fresh)
    # Corrupt copies were already dropped by their node on VERIFY; remove their entries now.
    await client.index.remove_stale(found.orphan_entries + dead_entries + found.corrupt)
    await client.index.commit(reindex)  # valid bytes nobody could find: index them
    for node_id in dead:
        await client.index.forget_node(node_id)
    legacy = await client.index.legacy_entries(remove=True) if found.legacy else 0
    removed = len(found.orphan_entries) + len(dead_entries) + len(found.corrupt)
    return CheckFixes(removed, len(reindex), len(dead), legacy)


async def _still_orphaned(
    client: PoolClient, orphans: list[tuple[str, Location]], fresh: dict[str, NodeInfo]
) -> list[tuple[str, Location]]:
    """Orphan copies that are still unindexed, still held, and conflict with no indexed copy."""
    if not orphans:
        return []
    entries = await client.index.lookup([k for k, _ in orphans])
    keep: list[tuple[str, Location]] = []
    for (key, loc), entry in zip(orphans, entries):
        node = fresh.get(loc.node_id)
        if node is None or node.epoch != loc.epoch:
            continue
        if any(other.node_id == loc.node_id or other.checksum != loc.checksum for other in entry):
            continue  # indexed meanwhile, or another version is indexed: leave it
        keep.append((key, loc))
    by_node: dict[str, list[tuple[str, Location]]] = defaultdict(list)
    for key, loc in keep:
        by_node[loc.node_id].append((key, loc))
    held: list[tuple[str, Location]] = []
    for node_id, pairs in by_node.items():
        keys = [k for k, _ in pairs]
        status = await client.node_admin.verify(fresh[node_id], keys)
        held += [pair for pair, st in zip(pairs, status) if st == Verified.OK]
    return held
