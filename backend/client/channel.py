"""The channel read path: same-cluster hits over an NCCL (or CPU) channel, TCP for the rest.

The channel itself lives in ``nccl_channel`` and is built by the LMCache connector
(it needs a GPU and the rendezvous); the client only asks it for the nodes it is
``engaged`` with (served, and paired: a node not paired yet is read over TCP while the
channel pairs in the background, so no read waits on an NCCL init) and falls back to
the node's next path for anything it does not bring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from backend.client.chunks import Fallback, Hit, Outcome, Sink, Wanted
from backend.client.context import ClientContext
from backend.metadata import NodeInfo

__all__ = ["ChannelReader", "Channel"]


class Channel(Protocol):
    """What ``nccl_channel.channel.NcclChannel`` offers the client."""

    def serves(self, node: Any) -> bool: ...

    def engaged(self, node: Any) -> bool: ...

    async def get(self, node: Any, keys: Sequence[str], sink: Sink[Any]) -> list[Any]: ...

    async def close(self) -> None: ...


class ChannelReader:
    """Reads over the channel; anything it fails to bring falls back to the node's next path."""

    speculative = False
    name = "channel"

    def __init__(self, ctx: ClientContext, channel: Channel) -> None:
        self.ctx = ctx
        self.channel = channel

    def serves(self, node: NodeInfo) -> bool:
        return self.channel.engaged(node)  # starts pairing in the background when there is no pair yet

    async def read(self, node: NodeInfo, wanted: Sequence[Wanted], sink: Sink[Any]) -> list[Outcome]:
        try:
            got = await self.channel.get(node, [w.key for w in wanted], sink)
        except Exception as exc:  # NcclError, the node's control path, a CUDA error: TCP still works
            self.ctx.counters["channel_fallbacks"] += len(wanted)
            self.ctx.warn_once("channel", "kvpool: channel to node %s failed, reading over TCP: %s", node.node_id, exc)
            return [Fallback(f"channel failed: {exc}")] * len(wanted)
        outcomes: list[Outcome] = []
        for item, handle in zip(wanted, got):
            if handle is None or isinstance(handle, BaseException):
                outcomes.append(Fallback("not brought by the channel"))  # a miss or a bad copy there: TCP decides
                continue
            outcomes.append(Hit(handle))
            self.ctx.counters["get_bytes_channel"] += item.nbytes
        if any(isinstance(o, Hit) for o in outcomes):
            self.ctx.recovered("channel")
        return outcomes
