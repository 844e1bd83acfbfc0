"""The same-host read path: chunks copied straight out of a node's shared-memory arena.

A node on this host publishes its DRAM tier as a file in ``/dev/shm`` (``backend.shm``).
Instead of the bytes the client asks for a LEASE with offsets, copies each chunk from
its read-only mapping into the sink's buffer, verifies the checksum, and releases the
lease in the background. The copies run on the bulk threads, two chunks at a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from backend.client.chunks import (
    DECLINED,
    MISS,
    Fallback,
    Hit,
    Outcome,
    Sink,
    Wanted,
    allocate_view,
    layout_differs,
    release_hits,
    sink_fingerprint,
)
from backend.client.connection import MAX_FRAME_ITEMS, Connections, NodeConnectionSet
from backend.client.context import ClientContext, logger
from backend.config.values import ms_to_s
from backend.counters import ClientCounter
from backend.errors import AuthError, CapacityError, KVPoolError, ProtocolError
from backend.metadata import NodeInfo
from backend.protocol import ItemMeta, Op
from backend.protocol.meta import OtherLayout
from backend.protocol.reads import LEASE_MAP, Lease, Release
from backend.shm import ArenaView
from backend.transport import BULK_BYTES

__all__ = ["ArenaReader", "SHM_LEASE_MS"]

# A same-host read holds its lease from the LEASE answer until the copy is done; the
# longest wait in between is the caller's allocator (the LMCache connector bounds it at 1 s).
SHM_LEASE_MS = 10_000
SHM_LEASE_TRUST = 0.5  # copy from the arena only within this share of the lease (clocks, queueing)

_Job = tuple[int, ItemMeta, memoryview, int]  # (index in the outcomes, item, sink buffer, arena offset)


class ArenaReader:
    """Reads from nodes whose arena this process can map (same host, same user); the rest is TCP's."""

    speculative = True  # a LEASE carries no payload: worth sending before the lookup answers
    name = "arena"

    def __init__(self, ctx: ClientContext, connections: Connections) -> None:
        self.ctx = ctx
        self.connections = connections
        self._views: dict[tuple[str, int], ArenaView | None] = {}  # None: not on this host

    def view(self, node: NodeInfo) -> ArenaView | None:
        """The node's arena if this process can map it; tried once per node epoch."""
        if not self.ctx.config.shm or not node.shm_path:
            return None
        ident = (node.node_id, node.epoch)
        if ident not in self._views:
            try:
                view = self._views[ident] = ArenaView(node.shm_path, node.shm_token)
                view.populate()
                logger.info("kvpool: node %s is on this host; reading through %s", node.node_id, node.shm_path)
            except (OSError, ValueError):
                self._views[ident] = None  # another host, another user, or a stale file: TCP
        return self._views[ident]

    def serves(self, node: NodeInfo) -> bool:
        # A node that bound this client to a tenant refuses mapped reads: its arena holds every tenant's bytes.
        return self.view(node) is not None and self.connections.to(node).tenant is None

    def prune(self, live: set[tuple[str, int]]) -> None:
        """Let go of the arenas of nodes that left or restarted (their files are removed)."""
        for ident in [i for i in self._views if i not in live]:
            view = self._views.pop(ident)
            if view is not None:
                view.close()

    def forget(self) -> None:
        """After a fork: the parent's threads are not in this process; map again when needed."""
        self._views = {}

    def close(self) -> None:
        self.prune(set())

    async def read(self, node: NodeInfo, wanted: Sequence[Wanted], sink: Sink[Any]) -> list[Outcome]:
        """LEASE the keys with offsets, copy each while the lease holds, release the lease.

        A key falls back to TCP when the node gives it no region (it could not
        promote it into the arena), when the node refuses the lease (its lease table
        is full), when the sink kept us waiting so long that the lease may be ending,
        or when the mapped copy fails its checksum: the TCP read then decides whether
        the chunk itself is bad, so a mapped read never drops a copy on its own.
        """
        arena = self.view(node)
        assert arena is not None
        conns = self.connections.to(node)
        outcomes: list[Outcome] = []
        try:
            for start in range(0, len(wanted), MAX_FRAME_ITEMS):
                outcomes += await self._read_leased(conns, arena, wanted[start : start + MAX_FRAME_ITEMS], sink)
        except BaseException:
            release_hits(sink, outcomes)
            raise
        return outcomes

    async def _read_leased(
        self, conns: NodeConnectionSet, arena: ArenaView, part: Sequence[Wanted], sink: Sink[Any]
    ) -> list[Outcome]:
        keys = [w.key for w in part]
        trust_until = time.monotonic() + ms_to_s(SHM_LEASE_MS) * SHM_LEASE_TRUST
        try:
            wanted = sink_fingerprint(sink)
            meta = Lease.encode_request(keys, SHM_LEASE_MS, LEASE_MAP, fingerprint=wanted)
            reply = await conns.request(Op.LEASE, meta)
        except CapacityError:
            return [Fallback("the node's lease table is full")] * len(keys)
        except AuthError:
            if conns.tenant is None:
                raise
            return [Fallback("a tenant's token reads over TCP")] * len(keys)  # the first read learns it
        lease_id, found = Lease.decode_answer(reply, keys, fingerprints=True)
        outcomes: list[Outcome] = []
        jobs: list[_Job] = []
        try:
            for entry in found:
                if entry is None:
                    outcomes.append(MISS)
                    continue
                if isinstance(entry, OtherLayout):
                    outcomes.append(entry)
                    continue
                item, offset = entry
                if layout_differs(wanted, item):
                    outcomes.append(OtherLayout(item.key))
                    continue
                if offset is None:
                    outcomes.append(Fallback("not in the arena"))
                    continue
                allocated = await allocate_view(sink, item)
                if allocated is None:
                    outcomes.append(DECLINED)
                    continue
                handle, view = allocated
                outcomes.append(Hit(handle, item.checksum))
                jobs.append((len(outcomes) - 1, item, view, offset))
            if jobs:
                arena.populate(max(offset + item.nbytes for _, item, _, offset in jobs))  # for the next reads
            digests = await self._copy(arena, jobs, trust_until)
        except BaseException:
            release_hits(sink, outcomes)
            raise
        finally:
            if lease_id:
                self.ctx.spawn(_release_quietly(conns, lease_id))
        for (index, item, _, _), digest in zip(jobs, digests):
            if digest == item.checksum and time.monotonic() < trust_until:
                self.ctx.counters[ClientCounter.SHM_GET_BYTES] += item.nbytes
                continue
            logger.debug("kvpool: mapped copy of %r not trusted; reading it over TCP", item.key)
            release_hits(sink, [outcomes[index]])
            outcomes[index] = Fallback("mapped copy not trusted")
        return outcomes

    async def _copy(self, arena: ArenaView, jobs: list[_Job], trust_until: float) -> list[int | None]:
        """Copy and checksum every job (None: not copied, the lease may be ending)."""
        if not jobs or time.monotonic() >= trust_until:
            return [None] * len(jobs)

        def copy(job: _Job) -> int:
            _, item, view, offset = job
            try:
                return arena.copy_checked(view, offset)
            except ValueError as exc:
                raise ProtocolError(f"node answered a bad arena offset for {item.key!r}: {exc}") from None

        if sum(job[1].nbytes for job in jobs) < BULK_BYTES:
            return [copy(job) for job in jobs]  # a thread hop would cost more than these copies
        return list(await self.ctx.map_in_threads(copy, jobs))


async def _release_quietly(conns: NodeConnectionSet, lease_id: int) -> None:
    try:
        await conns.request(Op.RELEASE, Release.encode_request(lease_id, ()))
    except KVPoolError as exc:  # the lease ends at its deadline instead
        logger.debug("kvpool: releasing lease on node %s failed: %s", conns.node.node_id, exc)
