"""The verbs that empty a node: ``drain`` (move its chunks elsewhere, bytes verified) and ``undrain``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from backend.admin.shared import Progress, refusal
from backend.client import Chunk, PoolClient
from backend.config.suggest import did_you_mean
from backend.errors import AuthError, CapacityError, ConfigError, KVPoolError, NodeUnavailable
from backend.metadata import Location, NodeInfo
from backend.protocol.inventory import InventoryRow

DRAIN_BATCH_ITEMS = 64  # chunks moved per step (`kvpool drain --batch`)
DRAIN_BATCH_BYTES = 256 * 1024 * 1024  # memory a drain holds at once

UNMARK_TIMEOUT_S = 5.0  # a drain that stops clears its mark within this, or leaves it for `kvpool undrain`

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
    source = await _live_node(client, node_id)
    await _check_targets(client, source, to)
    try:
        total = (await client.node_admin.stats(source)).objects
    except AuthError as exc:
        raise refusal(source, exc) from None
    marked = await client.index.set_draining(node_id, True)
    try:
        return await _move_all(client, source, to, batch, total, progress)
    except BaseException:
        if marked:
            await _unmark(client, node_id)
        raise


async def _live_node(client: PoolClient, node_id: str) -> NodeInfo:
    """The live node ``node_id``; NodeUnavailable listing the live node ids (and the close one) if it is not one."""
    live = await client.nodes(refresh=True)
    for node in live:
        if node.node_id == node_id:
            return node
    ids = sorted(node.node_id for node in live)
    hint = did_you_mean(node_id, ids)
    listed = f"live nodes: {', '.join(ids)}" if ids else "no node is alive there"
    raise NodeUnavailable(
        f"node {node_id!r} is not alive in namespace {client.config.namespace!r}{'; ' + hint if hint else ''}; "
        f"{listed} (`kvpool nodes` shows them)"
    )


async def _check_targets(client: PoolClient, source: NodeInfo, to: str | None) -> None:
    """Raise unless some live node other than ``source`` takes writes (``to``, when given)."""
    if to is not None:
        target = await _live_node(client, to)
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
                Chunk(f.meta.key, f.data, f.meta.dtype, f.meta.shape, f.meta.fmt, f.meta.fingerprint)
                for f in fetched
                if f is not None
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
