"""Lookup touches: the prefixes lookups found, told to the nodes holding them, batched and off every lookup's path.

A lookup is answered by Redis alone, so a node never sees that a prefix it holds was
looked up, and a prefix an engine then serves from its own CPU tier goes cold in the
pool. The client keeps each lookup's found prefix (one chain, in prefix order) and,
every ``TOUCH_FLUSH_S`` or once ``TOUCH_BATCH_KEYS`` keys wait, reads where those keys
live (one Redis lookup for the whole batch) and sends each node one TOUCH of the
chains' keys it holds (``backend.protocol.reads.Touch``). Which nodes: the pool URL's
``touch`` (``PoolConfig.touch``): ``auto`` (the default) tells the nodes whose eviction
order uses lookups (``NodeInfo.takes_touches``: their registry entry names an order other
than lru), and keeps nothing while the view holds none, so a pool of lru nodes pays
nothing; ``on`` tells every node, ``off`` none. Nothing waits
for it: a lookup only appends to a list. Bounded: at most ``TOUCH_BACKLOG_KEYS`` keys
wait (more are dropped and counted), a node gets ``progress_timeout_s`` to answer, on a
connection of its own (``send``: an older node closes the connection of an op it does
not know, so the reads' connections are never at risk), and a node epoch that refuses
the op (``ProtocolError``: an older build) is not touched again, logged once and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from backend.client.context import ClientContext
from backend.counters import ClientCounter
from backend.errors import KVPoolError, ProtocolError
from backend.metadata import IndexEntry, NodeInfo
from backend.protocol.reads import Touch

__all__ = ["LookupTouches", "TOUCH_FLUSH_S", "TOUCH_BATCH_KEYS", "TOUCH_BACKLOG_KEYS"]

logger = logging.getLogger("backend.client")

TOUCH_FLUSH_S = 0.05  # how long a found prefix waits for others to share its TOUCH
TOUCH_BATCH_KEYS = 1024  # keys that flush at once (a TOUCH is within the protocol's max_items)
TOUCH_BACKLOG_KEYS = 8 * TOUCH_BATCH_KEYS  # waiting keys beyond this are dropped: a slow pool never grows the client

Locate = Callable[[Sequence[str]], Awaitable[list[IndexEntry]]]  # each key's live copies (one Redis lookup)
NodeOf = Callable[[str], "NodeInfo | None"]  # a live node by id
Send = Callable[[NodeInfo, bytes], Awaitable[Any]]  # one TOUCH to a node, on a connection of its own


class LookupTouches:
    """Found prefixes waiting to be told to their nodes, and the task that tells them. Event loop only."""

    def __init__(self, ctx: ClientContext, locate: Locate, node_of: NodeOf, send: Send) -> None:
        self.ctx = ctx
        self._locate, self._node_of, self._send = locate, node_of, send
        self._mode = ctx.config.touch
        self.wanted = self._mode == "on"  # whether a lookup's found prefix is kept (a node of the view takes it)
        self._chains: list[list[str]] = []
        self._keys = 0
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._refused: set[tuple[str, int]] = set()  # node epochs that do not know TOUCH

    def takes(self, node: NodeInfo) -> bool:
        """Whether ``node`` is told what lookups found, under this client's ``touch``."""
        return self._mode == "on" or (self._mode == "auto" and node.takes_touches)

    def nodes_changed(self, live: set[tuple[str, int]]) -> None:
        """The registry view changed (``RegistryView.on_change``): keep found prefixes while a node takes them."""
        nodes = (self._node_of(node_id) for node_id, _ in live)
        self.wanted = any(node is not None and self.takes(node) for node in nodes)

    def found(self, keys: Sequence[str]) -> None:
        """A lookup found ``keys`` (a prefix, in order): they will be touched on their nodes, soon."""
        if not keys or not self.wanted:
            return
        chain = list(keys[:TOUCH_BATCH_KEYS])  # a chain's head is what matters most
        if self._keys + len(chain) > TOUCH_BACKLOG_KEYS:
            self.ctx.counters[ClientCounter.TOUCHES_DROPPED] += len(chain)
            return
        self._chains.append(chain)
        self._keys += len(chain)
        if self._keys >= TOUCH_BATCH_KEYS:
            self._full.set()
        if self._task is None:
            self._task = self.ctx.spawn(self._run())

    async def _run(self) -> None:
        """Send what waits, every TOUCH_FLUSH_S (at once when a batch is full), until nothing does."""
        try:
            while self._chains:
                if self._keys < TOUCH_BATCH_KEYS:
                    self._full.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._full.wait(), TOUCH_FLUSH_S)
                await self.flush(self._take())
        finally:
            self._task = None

    def _take(self) -> list[list[str]]:
        """The oldest chains, up to TOUCH_BATCH_KEYS keys."""
        taken, keys = 0, 0
        while taken < len(self._chains) and keys + len(self._chains[taken]) <= TOUCH_BATCH_KEYS:
            keys += len(self._chains[taken])
            taken += 1
        chains, self._chains = self._chains[:taken], self._chains[taken:]
        self._keys -= keys
        return chains

    async def flush(self, chains: list[list[str]]) -> None:
        """Tell each node holding keys of ``chains`` the part of each chain it holds, in one TOUCH."""
        if not chains:
            return
        entries = await self._locate([key for chain in chains for key in chain])
        by_node: defaultdict[str, list[list[str]]] = defaultdict(list)
        at = 0
        for chain in chains:
            parts: defaultdict[str, list[str]] = defaultdict(list)
            for key, copies in zip(chain, entries[at : at + len(chain)]):
                for copy in copies:
                    parts[copy.node_id].append(key)
            at += len(chain)
            for node_id, part in parts.items():
                by_node[node_id].append(part)
        await asyncio.gather(*(self._touch(node_id, node_chains) for node_id, node_chains in by_node.items()))

    async def _touch(self, node_id: str, chains: list[list[str]]) -> None:
        counters = self.ctx.counters
        keys = sum(len(chain) for chain in chains)
        node = self._node_of(node_id)
        if node is not None and not self.takes(node):
            return  # its order has no use for lookups (lru, under touch=auto): not a drop
        if node is None or (node.node_id, node.epoch) in self._refused:
            counters[ClientCounter.TOUCHES_DROPPED] += keys
            return
        try:
            async with asyncio.timeout(self.ctx.deadlines.touch_s):
                await self._send(node, Touch.encode_request(chains))
        except ProtocolError as exc:
            self._refused.add((node.node_id, node.epoch))
            counters[ClientCounter.TOUCH_REFUSALS] += 1
            counters[ClientCounter.TOUCHES_DROPPED] += keys
            logger.warning("kvpool: node %s does not take lookup touches (%s): no longer touched", node_id, exc)
        except (KVPoolError, TimeoutError, OSError):
            counters[ClientCounter.TOUCHES_DROPPED] += keys  # a hint: never retried, never waited for
        else:
            counters[ClientCounter.TOUCHES_SENT] += 1
