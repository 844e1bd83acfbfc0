"""The TCP read path: GET_BATCH over the node's protocol, striped over its connections.

A batch is split into up to ``connections_per_node`` contiguous stripes of about
equal bytes, one per connection, so that the node sends and this client receives
(both on worker threads, ``backend.transport``) over several streams at once: one
stream is bound by one core's kernel copy on each side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeVar

from backend.client.chunks import Hit, Outcome, Sink, Wanted, release_hits, sink_fingerprint
from backend.client.connection import Connections, NodeConnectionSet, frames
from backend.client.context import ClientContext
from backend.counters import ClientCounter
from backend.metadata import NodeInfo
from backend.protocol import Op
from backend.protocol.reads import GetBatch
from backend.transport import BULK_BYTES

__all__ = ["TcpReader", "stripes"]

T = TypeVar("T")


class TcpReader:
    """Reads any node over its TCP protocol; the path of last resort, it never falls back."""

    speculative = False  # a GET brings the payload: only once the lookup said where
    name = "tcp"

    def __init__(self, ctx: ClientContext, connections: Connections) -> None:
        self.ctx = ctx
        self.connections = connections

    def serves(self, node: NodeInfo) -> bool:
        return True

    async def read(self, node: NodeInfo, wanted: Sequence[Wanted], sink: Sink[Any]) -> list[Outcome]:
        conns = self.connections.to(node)
        parts = stripes(wanted, self.ctx.config.connections_per_node)
        if len(parts) == 1:
            outcomes = await _read_stripe(conns, parts[0], sink)
        else:
            outcomes = await _read_stripes(conns, parts, sink)
        self.ctx.counters[ClientCounter.GET_BYTES_TCP] += sum(
            w.nbytes for w, o in zip(wanted, outcomes) if isinstance(o, Hit)
        )
        return outcomes


async def _read_stripes(conns: NodeConnectionSet, parts: Sequence[Sequence[Wanted]], sink: Sink[Any]) -> list[Outcome]:
    """Every stripe at once; if one fails (or this is cancelled), the others' buffers go back too."""
    tasks = [asyncio.ensure_future(_read_stripe(conns, part, sink)) for part in parts]
    try:
        await asyncio.wait(tasks)
        for task in tasks:
            error = task.exception()
            if error is not None:
                raise error
    except BaseException:
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                release_hits(sink, task.result())
            else:
                task.cancel()  # a stripe still running gives back its own buffers
        raise
    return [outcome for task in tasks for outcome in task.result()]


async def _read_stripe(conns: NodeConnectionSet, wanted: Sequence[Wanted], sink: Sink[Any]) -> list[Outcome]:
    """GET_BATCH in frames within the size limits; bytes arrive straight in the sink's buffers."""
    out: list[Outcome] = []
    fingerprint = sink_fingerprint(sink)
    try:
        for frame in frames(wanted):
            keys = [w.key for w in frame]
            expect = sum(w.nbytes for w in frame)
            meta = GetBatch.encode_request(keys, fingerprint)
            out.extend(await conns.request(Op.GET_BATCH, meta, keys=keys, sink=sink, expect_bytes=expect))
    except BaseException:
        release_hits(sink, out)  # an earlier frame's buffers are ours to give back
        raise
    return out


def stripes(wanted: Sequence[T], most: int) -> list[Sequence[T]]:
    """Split ``wanted`` (Wanted or ItemMeta) into at most ``most`` contiguous parts of about equal
    bytes, each worth a stream (at least ``BULK_BYTES``)."""
    total = sum(w.nbytes for w in wanted)  # type: ignore[attr-defined]
    count = max(1, min(most, len(wanted), total // BULK_BYTES))
    if count == 1:
        return [wanted]
    parts: list[Sequence[T]] = []
    start, filled = 0, 0
    for index, item in enumerate(wanted):
        filled += item.nbytes  # type: ignore[attr-defined]
        if filled >= total * (len(parts) + 1) / count and len(parts) < count - 1:
            parts.append(wanted[start : index + 1])
            start = index + 1
    parts.append(wanted[start:])
    return [p for p in parts if p]
