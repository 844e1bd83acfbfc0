"""The channel read path: same-cluster hits over an NCCL (or CPU) channel, TCP for the rest.

``PoolClient`` builds the channel from its config (:func:`open_channel`): with
``nccl=on``, a ``cluster`` and a transport that can run here (libnccl and a GPU, or the
CPU transport, ``channel_transport=cpu``), so every client has it alike: the LMCache
connector, the multiprocess-mode L2 adapter, ``SyncPoolClient``. The channel itself
lives in ``nccl_channel`` (it needs torch), imported only then. The client asks it for
the nodes it is ``engaged`` with (served, and paired: a node not paired yet is read over
TCP while the channel pairs in the background, so no read waits on an NCCL init) and
falls back to the node's next path for anything it does not bring.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from backend.client.chunks import Fallback, Hit, Outcome, Sink, Wanted, sink_fingerprint
from backend.client.connection import Connections
from backend.client.context import ClientContext
from backend.client.index import PoolIndex
from backend.config import PoolConfig
from backend.config.deadlines import Deadlines
from backend.counters import ClientCounter
from backend.errors import KVPoolError, NcclError
from backend.metadata import NodeInfo
from nccl_channel.outcome import ChannelResult, NotBrought

__all__ = ["ChannelReader", "Channel", "open_channel"]

logger = logging.getLogger("backend.client")

T = TypeVar("T")


class Channel(Protocol):
    """What the client asks of its channel (``nccl_channel.client.NcclChannel``)."""

    @property
    def kind(self) -> str:
        """The transport: "nccl" or "cpu"."""

    def engaged(self, node: NodeInfo) -> bool:
        """Whether to read ``node`` over the channel now (served and paired); starts pairing if not yet."""

    async def get(
        self, node: NodeInfo, keys: Sequence[str], sink: Sink[T], fingerprint: int = 0
    ) -> list[ChannelResult[T]]:
        """Per key: landed in a sink buffer and verified (stored with the layout ``fingerprint``), or not brought
        and why; raises KVPoolError."""

    async def close(self) -> None:
        """Abort every pair; bounded."""


def open_channel(
    config: PoolConfig,
    deadlines: Deadlines,
    index: PoolIndex,
    request: Callable[[NodeInfo, bytes], Awaitable[bytes]],
) -> Channel | None:
    """The channel ``config`` asks for, or None (said once, at WARNING) when it cannot run here.

    ``index`` carries the rendezvous; ``request`` sends one CHANNEL_GET over a node's TCP
    protocol (``PoolClient.channel_request``).
    """
    if not config.nccl or not config.cluster:  # nccl=on without a cluster: PoolConfig warned when it was built
        return None
    try:
        from nccl_channel.channel import NcclChannel, make_transport
        from nccl_channel.rendezvous import Rendezvous
    except ImportError as exc:  # the core install has no torch
        logger.warning("kvpool: nccl=on, but the channel cannot load (%s); chunks move over TCP", exc)
        return None
    try:
        transport = make_transport(config.channel_transport)
    except NcclError as exc:
        logger.warning("kvpool: nccl=on, but %s; chunks move over TCP", exc)
        return None
    endpoint = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    channel = NcclChannel[NodeInfo](
        transport,
        Rendezvous(index),
        endpoint,
        config.cluster,
        request,
        deadlines.channel_transfer_s,
        pair_timeout_s=deadlines.pair_s,
    )
    logger.info("kvpool: channel endpoint %s (%s, cluster %s)", endpoint, transport.kind, config.cluster)
    return channel


class ChannelReader:
    """Reads over the channel; anything it fails to bring falls back to the node's next path."""

    speculative = False
    name = "channel"

    def __init__(self, ctx: ClientContext, channel: Channel, connections: Connections) -> None:
        self.ctx = ctx
        self.channel = channel
        self.connections = connections

    def serves(self, node: NodeInfo) -> bool:
        if self.connections.to(node).tenant is not None:
            return False  # the node refuses CHANNEL_GET to a tenant's token: it reads past the connection
        return self.channel.engaged(node)  # starts pairing in the background when there is no pair yet

    async def read(self, node: NodeInfo, wanted: Sequence[Wanted], sink: Sink[T]) -> list[Outcome]:
        try:
            got = await self.channel.get(node, [w.key for w in wanted], sink, sink_fingerprint(sink))
        except KVPoolError as exc:  # NcclError (a CUDA error among them), the node's control path: TCP still works
            self.ctx.counters[ClientCounter.CHANNEL_FALLBACKS] += len(wanted)
            self.ctx.warn_once("channel", "kvpool: channel to node %s failed, reading over TCP: %s", node.node_id, exc)
            return [Fallback(f"channel failed: {exc}")] * len(wanted)
        outcomes: list[Outcome] = []
        for item, result in zip(wanted, got, strict=True):
            if isinstance(result, NotBrought):
                outcomes.append(Fallback(f"not brought by the channel: {result.why.value}"))  # TCP decides
                continue
            outcomes.append(Hit(result.handle))
            self.ctx.counters[ClientCounter.GET_BYTES_CHANNEL] += item.nbytes
        if any(isinstance(o, Hit) for o in outcomes):
            self.ctx.recovered("channel")
        return outcomes
