"""Nodes that stopped answering: skipped by reads and puts, probed in the background until they answer.

A request to a node that fails as a whole (``NodeUnavailable``: connection refused or
reset, or a connection that moved no byte for ``progress_timeout_s``) marks that node epoch
*down*. While it is down, a get reads its keys from their other copies (or as misses),
a lookup does not count its copies, and a put places its chunks on the next nodes, so
only the first call pays the silence; every later call costs nothing for it. A probe
(connect within ``connect_timeout_s``, then HELLO and PING on a fresh connection, each within
``progress_timeout_s``) asks the node
every ``PROBE_INTERVAL_S``; the first answer, or any request that succeeds, restores it.
A node that leaves the registry (or restarts under a new epoch) is forgotten.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from backend.client.context import ClientContext, logger
from backend.counters import ClientCounter
from backend.errors import KVPoolError, NodeUnavailable
from backend.metadata import NodeInfo

__all__ = ["NodeHealth", "PROBE_INTERVAL_S"]

PROBE_INTERVAL_S = 0.5  # how often a down node is asked whether it answers again

_Ident = tuple[str, int]  # (node id, epoch)


class NodeHealth:
    """Which node epochs are down, and the probes that bring them back."""

    def __init__(
        self, ctx: ClientContext, probe: Callable[[NodeInfo], Awaitable[None]], on_down: Callable[[NodeInfo], None]
    ) -> None:
        self.ctx = ctx
        self._probe = probe  # raises KVPoolError unless the node answered
        self._on_down = on_down  # told once per outage (closes the node's connections)
        self._down: dict[_Ident, float] = {}  # -> monotonic time it went down
        self._probes: dict[_Ident, asyncio.Task[None]] = {}

    def is_down(self, node_id: str, epoch: int) -> bool:
        return bool(self._down) and (node_id, epoch) in self._down

    def any_down(self) -> bool:
        return bool(self._down)

    def failed(self, node: NodeInfo, error: BaseException) -> None:
        """A request to ``node`` failed; a ``NodeUnavailable`` marks it down and starts its probe."""
        ident = (node.node_id, node.epoch)
        if not isinstance(error, NodeUnavailable) or ident in self._down or self.ctx.closed:
            return
        self._down[ident] = time.monotonic()
        self.ctx.counters[ClientCounter.NODES_MARKED_DOWN] += 1
        logger.warning(
            "kvpool: node %s marked down (%s); reads go to replicas or miss, puts to other nodes, probing every %.1f s",
            node.node_id,
            error,
            PROBE_INTERVAL_S,
        )
        self._on_down(node)
        self._probes[ident] = self.ctx.spawn(self._probe_until_up(node))

    def answered(self, node: NodeInfo) -> None:
        """A request to ``node`` succeeded: it is up."""
        if self._down:
            self._restore((node.node_id, node.epoch))

    def prune(self, live: set[tuple[str, int]]) -> None:
        """Forget node epochs that left the registry."""
        for ident in [i for i in self._down if i not in live]:
            self._restore(ident, log=False)

    def _restore(self, ident: _Ident, log: bool = True) -> None:
        since = self._down.pop(ident, None)
        if since is None:
            return
        probe = self._probes.pop(ident, None)
        if probe is not None and probe is not asyncio.current_task():
            probe.cancel()
        if log:
            logger.warning("kvpool: node %s answers again after %.1f s", ident[0], time.monotonic() - since)

    async def _probe_until_up(self, node: NodeInfo) -> None:
        ident = (node.node_id, node.epoch)
        while ident in self._down:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                await self._probe(node)
            except KVPoolError:
                continue
            self.ctx.counters[ClientCounter.NODES_RESTORED] += 1
            self._restore(ident)
