"""``check``, fsck for the pool: the index against the bytes on the nodes, checksums, dead nodes; ``fix`` repairs."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from backend.admin.shared import Progress
from backend.client import PoolClient
from backend.metadata import Location, NodeInfo
from backend.protocol.inventory import Verified

CHECK_SAMPLE = 100  # chunks whose checksum `check` re-verifies without --deep


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
