"""Put: place each chunk on ``replicas`` nodes, falling back to the next-ranked node when one refuses.

Placement is weighted rendezvous hashing over the live nodes (``backend.placement``).
A call returns only when the nodes acknowledged (bytes complete, verified and indexed)
or failed, so the caller may reuse its buffers as soon as it returns; a large payload
is sent from a worker thread (``backend.transport``).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from backend.client.chunks import Chunk
from backend.client.connection import Connections, frames
from backend.client.context import ClientContext
from backend.client.registry import RegistryView
from backend.errors import CapacityError, KVPoolError
from backend.metadata import NodeInfo
from backend.placement import choose_nodes, next_fallback, rank_nodes
from backend.protocol import PUT_INTEGRITY, PUT_STORED, ItemMeta, Op, decode_flags, encode_items
from backend.transport import Buffer

__all__ = ["PutPlanner"]

PUT_ATTEMPTS = 3  # first choice, then the next-ranked nodes
# Why a put failed when every node answered but none stored the chunk (PUT_NO_CAPACITY or PUT_INTEGRITY).
NO_ROOM = ": no node took them (no room: larger than a node's DRAM tier or DRAM full of puts in flight; or corrupt on arrival)"


class PutPlanner:
    """Chooses nodes for each chunk, sends one batch per node, retries refused chunks elsewhere."""

    def __init__(self, ctx: ClientContext, registry: RegistryView, connections: Connections) -> None:
        self.ctx = ctx
        self.registry = registry
        self.connections = connections

    async def put(self, chunks: Sequence[Chunk], only: Sequence[str] | None = None) -> None:
        """Store every chunk on ``replicas`` nodes; raises if any chunk could not be stored.

        ``only`` restricts placement to these node ids (``kvpool drain --to``).
        """
        if not chunks:
            return
        # A chunk that breaks a limit refuses the whole call before anything is sent.
        items = [c.checked_item_meta() for c in chunks]
        data = {c.key: c.data for c in chunks}
        nodes = await self.registry.nodes()
        if only is not None:
            nodes = [n for n in nodes if n.node_id in set(only)]
        if not nodes:
            raise CapacityError(f"no live node in namespace {self.ctx.config.namespace!r} can take writes")
        replicas = self.ctx.config.replicas
        plans = {item.key: rank_nodes(item.key, nodes) for item in items}  # every node that may take it, best first
        targets = {item.key: choose_nodes(item.key, nodes, replicas) for item in items}
        stored: dict[str, set[str]] = defaultdict(set)  # key -> distinct nodes holding it
        tried: dict[str, set[str]] = defaultdict(set)
        failed_on: dict[str, set[str]] = defaultdict(set)  # key -> nodes its copy failed on
        last_error: KVPoolError | None = None
        by_key = {item.key: item for item in items}
        for _ in range(PUT_ATTEMPTS):
            groups: dict[str, list[ItemMeta]] = defaultdict(list)
            node_of: dict[str, NodeInfo] = {}
            for key, node_list in targets.items():
                for node in node_list:
                    groups[node.node_id].append(by_key[key])
                    node_of[node.node_id] = node
                    tried[key].add(node.node_id)
            if not groups:
                break
            outcomes = await asyncio.gather(
                *(self._put_on_node(node_of[nid], group, data) for nid, group in groups.items()),
                return_exceptions=True,
            )
            targets = {}
            for (nid, group), outcome in zip(groups.items(), outcomes):
                for item, ok in zip(group, _put_flags(outcome, len(group))):
                    if ok:
                        stored[item.key].add(nid)
                        continue
                    failed_on[item.key].add(nid)
                    fallback = next_fallback(plans[item.key], tried[item.key], failed_on[item.key])  # another host
                    if fallback is not None:
                        targets.setdefault(item.key, []).append(fallback)
                        tried[item.key].add(fallback.node_id)  # never the same fallback twice
                if isinstance(outcome, KVPoolError):
                    last_error = outcome
                    self.ctx.warn_once(f"put:{nid}", "kvpool: put to node %s failed: %s", nid, outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome
        eligible = sum(1 for n in nodes if not n.draining)
        failed = {item.key for item in items if len(stored[item.key]) < min(replicas, max(eligible, 1))}
        self.ctx.counters["put_chunks"] += len(items) - len(failed)
        self.ctx.counters["put_bytes"] += sum(i.nbytes for i in items if i.key not in failed)
        if failed:
            self.ctx.counters["put_failures"] += len(failed)
            cause = f": {last_error}" if last_error else NO_ROOM
            error_type = type(last_error) if last_error is not None else CapacityError
            raise error_type(f"{len(failed)} of {len(items)} chunks were not stored{cause}")

    async def _put_on_node(self, node: NodeInfo, group: list[ItemMeta], data: dict[str, Buffer]) -> list[int]:
        pool = self.connections.pool(node)
        flags: list[int] = []
        for frame in frames(group):
            reply = await pool.request(Op.PUT_BATCH, encode_items(frame), data=[data[i.key] for i in frame])
            flags.extend(decode_flags(reply, len(frame)))
        self.ctx.counters["integrity_failures"] += flags.count(PUT_INTEGRITY)
        return flags


def _put_flags(outcome: Any, n: int) -> list[bool]:
    if isinstance(outcome, BaseException):
        return [False] * n
    return [flag == PUT_STORED for flag in outcome]
