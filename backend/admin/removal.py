"""The verbs that remove chunks: ``evict`` (by key or pattern, everywhere) and ``flush`` (a whole namespace)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backend.admin.shared import SCAN_BATCH, Progress, key_pattern, refusal
from backend.client import PoolClient
from backend.errors import AuthError, ConfigError, KVPoolError


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
    async for batch in client.index.scan_key_batches(key_pattern(model, prefix), SCAN_BATCH):
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
            refused[node_id] = str(refusal(node, exc))
        except KVPoolError as exc:
            refused[node_id] = f"node {node_id} ({node.address}): {exc}"
    kept = {key for node_id in refused for key in holders[node_id]}
    stale = [(key, loc) for key, entry in zip(keys, entries) for loc in entry if loc.node_id not in refused]
    await client.index.remove_stale(stale)
    existed = sum(1 for key, entry in zip(keys, entries) if entry and key not in kept)
    return EvictReport(existed, len(kept), refused)


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
