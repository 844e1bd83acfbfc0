"""Put: place each chunk on ``replicas`` nodes, falling back to the next-ranked node when one refuses.

Placement is weighted rendezvous hashing over the live nodes (``backend.placement``).
A call returns only when the nodes acknowledged (bytes complete, verified and indexed)
or failed, so the caller may reuse its buffers as soon as it returns; a large payload
is sent from a worker thread (``backend.transport``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections import Counter, defaultdict
from collections.abc import Sequence
from types import MappingProxyType

from backend.client.chunks import Chunk
from backend.client.connection import Connections, frames
from backend.client.context import ClientContext
from backend.client.registry import RegistryView
from backend.client.stage import StagedWriter
from backend.client.tcp import stripes
from backend.config.values import ms_to_s
from backend.counters import ClientCounter
from backend.errors import BusyError, CapacityError, KVPoolError, NodeUnavailable, PutOutcome, refused_outcome
from backend.metadata import NodeInfo
from backend.placement import choose_nodes, next_fallback, rank_nodes
from backend.protocol import ItemMeta, Op, checksum
from backend.protocol.puts import PutBatch, PutOptions, put_outcome
from backend.protocol.tokens import encode_record
from backend.transport import BULK_BYTES, Buffer

__all__ = ["PutPlanner", "put_error"]

PUT_ATTEMPTS = 3  # first choice, then the next-ranked nodes
NodeOutcomes = tuple[list[PutOutcome], KVPoolError | None]  # per chunk of a node's group, and a request's error


class PutPlanner:
    """Chooses nodes for each chunk, sends one batch per node, retries refused chunks elsewhere."""

    def __init__(
        self, ctx: ClientContext, registry: RegistryView, connections: Connections, staged: StagedWriter
    ) -> None:
        self.ctx = ctx
        self.registry = registry
        self.connections = connections
        self.staged = staged

    async def put(self, chunks: Sequence[Chunk], only: Sequence[str] | None = None) -> None:
        """Store every chunk on ``replicas`` nodes; raises if any chunk could not be stored.

        ``only`` restricts placement to these node ids (``kvpool drain --to``).
        """
        if not chunks:
            return
        # A chunk that breaks a limit refuses the whole call before anything is hashed or sent.
        items = [c.layout() for c in chunks]  # checksums: 0 until computed, on the way to a node
        data = {c.key: c.data for c in chunks}
        sums: dict[str, int] = {}
        nodes = await self.registry.nodes()
        if only is not None:
            nodes = [n for n in nodes if n.node_id in set(only)]
        if not nodes:
            raise CapacityError(f"no live node in namespace {self.ctx.config.namespace!r} can take writes")
        if all(n.draining for n in nodes):
            raise CapacityError(
                f"no live node in namespace {self.ctx.config.namespace!r} takes writes: every one is "
                f"draining ({', '.join(sorted(n.node_id for n in nodes))}); `kvpool undrain NODE` "
                "ends a drain"
            )
        replicas = self.ctx.config.replicas
        plans = {item.key: rank_nodes(item.key, nodes) for item in items}  # every node that may take it, best first
        targets = {item.key: choose_nodes(item.key, nodes, replicas) for item in items}
        stored: dict[str, set[str]] = defaultdict(set)  # key -> distinct nodes holding it
        refused: dict[str, PutOutcome] = {}  # key -> why its last copy that was not stored was not
        # One id for the whole call: its stripes on a node never evict each other's chunks.
        records = token_records(chunks)  # for the nodes that keep event rings
        options = PutOptions(secrets.randbits(64) or 1, self.ctx.deadlines.room_wait_ms, records or None)
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
                *(self._put_on_node(node_of[nid], group, data, sums, options) for nid, group in groups.items())
            )
            targets = {}
            for (nid, group), (results, error) in zip(groups.items(), outcomes):
                for item, outcome in zip(group, results):
                    if outcome is PutOutcome.STORED:
                        stored[item.key].add(nid)
                        continue
                    refused[item.key] = outcome
                    failed_on[item.key].add(nid)
                    fallback = next_fallback(plans[item.key], tried[item.key], failed_on[item.key])  # another host
                    if fallback is not None:
                        targets.setdefault(item.key, []).append(fallback)
                        tried[item.key].add(fallback.node_id)  # never the same fallback twice
                if error is not None:
                    last_error = error
                    self.ctx.warn_once(f"put:{nid}", "kvpool: put to node %s failed: %s", nid, error)
        eligible = sum(1 for n in nodes if not n.draining)
        failed = {item.key for item in items if len(stored[item.key]) < min(replicas, max(eligible, 1))}
        self.ctx.counters[ClientCounter.PUT_CHUNKS] += len(items) - len(failed)
        self.ctx.counters[ClientCounter.PUT_BYTES] += sum(i.nbytes for i in items if i.key not in failed)
        if failed:
            self.ctx.counters[ClientCounter.PUT_FAILURES] += len(failed)
            # A key never answered for (no node left to try) counts as failed.
            raise put_error(
                {i.key: refused.get(i.key, PutOutcome.FAILED) if i.key in failed else PutOutcome.STORED for i in items},
                last_error,
            )

    async def _checksummed(self, layouts: list[ItemMeta], data: dict[str, Buffer], sums: dict[str, int]) -> None:
        """Put each chunk's checksum in ``sums``, hashed on the bulk threads (off the caller's loop)."""
        todo = [item for item in layouts if item.key not in sums]

        def hashed(item: ItemMeta) -> int:
            return checksum(memoryview(data[item.key]).cast("B"))

        if sum(item.nbytes for item in todo) < BULK_BYTES:
            digests = [hashed(item) for item in todo]
        else:
            digests = await self.ctx.map_in_threads(hashed, todo)
        sums.update({item.key: digest for item, digest in zip(todo, digests)})

    async def _put_on_node(
        self, node: NodeInfo, group: list[ItemMeta], data: dict[str, Buffer], sums: dict[str, int], options: PutOptions
    ) -> NodeOutcomes:
        """One node's chunks: through the stage for a node on this host, else striped over its
        connections (the node receives each stripe on its own thread). Returns each chunk's
        outcome (``FAILED`` where its stripe failed) and the node's error, if a stripe failed.
        A node marked down is not asked: its chunks fail at once and go to the next nodes."""
        if self.registry.health.is_down(node.node_id, node.epoch):
            return [PutOutcome.FAILED] * len(group), NodeUnavailable(
                f"node {node.node_id} ({node.address}) is marked down: it stopped answering, and is probed until it "
                "answers again"
            )
        if options.tokens is not None and not node.event_tokens:
            # Only a node that says it keeps them is sent token records (an older one would refuse the put).
            options = dataclasses.replace(options, tokens=None)
        if self.staged.serves(node):
            staged = await self.staged.put(node, group, data, sums, options)
            if staged is not None:
                self.ctx.counters[ClientCounter.INTEGRITY_FAILURES] += staged[0].count(PutOutcome.CORRUPT)
                return staged
        await self._checksummed(group, data, sums)
        group = [dataclasses.replace(item, checksum=sums[item.key]) for item in group]
        conns = self.connections.to(node)

        async def stripe(part: Sequence[ItemMeta]) -> list[PutOutcome]:
            results: list[PutOutcome] = []
            for frame in frames(part):
                meta = PutBatch.encode_request(frame, options)
                reply = await conns.request(
                    Op.PUT_BATCH, meta, data=[data[i.key] for i in frame], hold_s=ms_to_s(options.wait_ms)
                )
                results.extend(put_outcome(flag) for flag in PutBatch.decode_answer(reply, len(frame)))
            return results

        parts = stripes(group, self.ctx.config.connections_per_node)
        answers = await asyncio.gather(*(stripe(part) for part in parts), return_exceptions=True)
        results: list[PutOutcome] = []
        error: KVPoolError | None = None
        for part, answer in zip(parts, answers):
            if isinstance(answer, KVPoolError):
                error = answer
                answer = [refused_outcome(answer)] * len(part)
            elif isinstance(answer, BaseException):
                raise answer
            results.extend(answer)
        self.ctx.counters[ClientCounter.INTEGRITY_FAILURES] += results.count(PutOutcome.CORRUPT)
        return results, error


def token_records(chunks: Sequence[Chunk]) -> dict[str, bytes]:
    """Each chunk's token record, by key; a chunk whose tokens make no record (no ids, too many, an id over
    32 bits) goes without one: a put never fails for its tokens."""
    records: dict[str, bytes] = {}
    for chunk in chunks:
        if chunk.tokens is not None:
            with contextlib.suppress(ValueError):
                records[chunk.key] = encode_record(chunk.tokens)
    return records


def put_error(outcomes: dict[str, PutOutcome], last_error: KVPoolError | None) -> KVPoolError:
    """The error of a put that did not store every chunk: exact counts by outcome, ``outcomes`` attached.

    Its type: the failed request's error if a chunk failed; BusyError if every chunk not
    stored met only busy nodes (the pool was saturated, nothing went wrong); else CapacityError
    (with the node's reason when a node refused a request whole: larger than it can ever hold).
    """
    missing = Counter(o for o in outcomes.values() if o is not PutOutcome.STORED)
    counts = ", ".join(f"{n} {outcome.value}" for outcome, n in sorted(missing.items(), key=lambda x: -x[1]))
    message = f"{sum(missing.values())} of {len(outcomes)} chunks were not stored: {counts}"
    error_type: type[KVPoolError] = CapacityError
    if missing.get(PutOutcome.FAILED):
        error_type = type(last_error) if last_error is not None else KVPoolError
        message += f" ({last_error})" if last_error is not None else ""
    elif set(missing) == {PutOutcome.BUSY}:
        error_type = BusyError
    elif isinstance(last_error, CapacityError):
        message += f" ({last_error})"
    error = error_type(message)
    error.outcomes = MappingProxyType(outcomes)
    return error
