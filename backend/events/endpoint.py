"""The ``kvpool events`` endpoint: the pool's stores and removals for KV-aware routers, in vLLM's format.

Every ``poll_interval_s`` it reads the registry's live nodes and each node's ring (EVENTS, from
its cursor), turns what changed into vLLM events (``view.py``), and publishes them as one
``KVEventBatch`` on a ZMQ PUB socket: frames (topic, 8-byte big-endian sequence number, msgpack
payload), topic ``kv@IDENTITY@MODEL``. The last ``replay_batches`` batches are kept for a ROUTER
replay socket, as vLLM's ``ZmqEventPublisher`` keeps them: a client sends a start sequence and
gets every kept batch from it, then the sequence -1. A client asking from before what is kept
(a late subscriber) gets one batch instead, numbered with the last sequence published: the
pool's contents as of that sequence (``AllBlocksCleared``, then every block held), so with the
PUB stream from the next sequence it has everything.

A node the endpoint meets (or meets again under a new epoch, or whose ring moved past its
cursor) is read whole: its ring's cursor first, then its INVENTORY, then its ring from that
cursor, so nothing that happened during the walk is lost. A node the registry no longer lists
alive has its blocks removed. The endpoint holds no lock and takes no part in a put.

Both sockets use CURVE with keys derived from the pool token (``auth.py``); the endpoint refuses
to start without a token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from backend.client import PoolClient
from backend.config import PoolConfig
from backend.errors import ConfigError, KVPoolError
from backend.events.auth import curve_keys
from backend.events.view import BlockShape, PoolView
from backend.events.wire import END_SEQ, KVEventBatch, Wire, seq_bytes
from backend.metadata import NodeInfo
from backend.protocol import EVENT_STORED, MAX_EVENTS_KEYS

__all__ = ["EndpointConfig", "EventsEndpoint"]

logger = logging.getLogger(__name__)

DEFAULT_REPLAY_BATCHES = 10_000  # vLLM's buffer_steps
DEFAULT_MEDIUM = "CPU"
FAR_AHEAD = 1 << 62  # a cursor no ring has reached: EVENTS answers with its next sequence only


@dataclass(frozen=True)
class EndpointConfig:
    """What ``kvpool events`` was asked for; checked once."""

    model: str
    publish: str = "tcp://*:5557"
    replay: str | None = None
    identity: str = ""  # default: "kvpool-" + the namespace
    block_size: int = 256  # LMCache's chunk_size: one chunk is one block (docs/fleet.md)
    medium: str = DEFAULT_MEDIUM
    form: Literal["map", "array"] = "map"
    replay_batches: int = DEFAULT_REPLAY_BATCHES
    poll_interval_s: float = 0.2
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if not self.model or "@" in self.model:
            raise ConfigError("--model", f"{self.model!r} is not a model name (non-empty, no '@')")
        if self.block_size <= 0:
            raise ConfigError("--block-size", f"{self.block_size} is not a positive number of tokens")
        if self.replay_batches <= 0:
            raise ConfigError("--replay-batches", f"{self.replay_batches} is not a positive number")
        if not 0 < self.poll_interval_s <= 60:
            raise ConfigError("--poll-interval-s", f"{self.poll_interval_s} is outside (0, 60]")
        if self.form not in ("map", "array"):
            raise ConfigError("--form", f"{self.form!r} is not map or array")

    def topic(self, namespace: str) -> str:
        return f"kv@{self.identity or 'kvpool-' + namespace}@{self.model}"


@dataclass
class _Cursor:
    epoch: int
    next_seq: int


class EventsEndpoint:
    """One endpoint over one pool and one model; :meth:`run` until cancelled, then :meth:`close`."""

    def __init__(self, pool: PoolConfig, config: EndpointConfig) -> None:
        if not pool.token:
            raise ConfigError("token", "the events endpoint needs the pool token: events say what the pool holds")
        self.pool = pool
        self.config = config
        self.topic = config.topic(pool.namespace).encode()
        self.view = PoolView(config.model, BlockShape(config.block_size, config.medium))
        self.wire = Wire(config.form)
        self._cursors: dict[str, _Cursor] = {}
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.replay_batches)
        self._last_seq = -1
        self._keys = curve_keys(pool.token, pool.namespace)
        self._ctx = zmq.asyncio.Context()
        self._auth = AsyncioAuthenticator(self._ctx)
        self._pub = self._ctx.socket(zmq.PUB)
        self._router: zmq.asyncio.Socket | None = None
        self.publish_address = ""
        self.replay_address = ""

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch published (-1: none yet)."""
        return self._last_seq

    def _secure(self, sock: zmq.asyncio.Socket) -> None:
        sock.curve_secretkey = self._keys.server_secret
        sock.curve_publickey = self._keys.server_public
        sock.curve_server = True

    def bind(self) -> None:
        """Start the authenticator (it admits the one client key the token derives) and bind the sockets."""
        self._auth.start()
        allowed = self._keys.client_public

        class _OneKey:
            def callback(self, domain: str, key: bytes) -> bool:
                return key == allowed

        self._auth.configure_curve_callback(domain="*", credentials_provider=_OneKey())
        self._secure(self._pub)
        self._pub.bind(self.config.publish)
        self.publish_address = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.config.replay is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._secure(self._router)
            self._router.bind(self.config.replay)
            self.replay_address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)

    async def run(self) -> None:
        """Poll the nodes and serve replays until cancelled."""
        async with PoolClient(self.pool) as client:
            self._publish([*self.view.snapshot()[:1]])  # AllBlocksCleared: a subscriber forgets an earlier run
            tasks = [asyncio.create_task(self._poll_loop(client))]
            if self._router is not None:
                tasks.append(asyncio.create_task(self._replay_loop(self._router)))
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()

    async def _poll_loop(self, client: PoolClient) -> None:
        while True:
            try:
                await self.poll(client)
            except KVPoolError as exc:
                logger.warning("events: the pool did not answer (%s); trying again", exc)
            await asyncio.sleep(self.config.poll_interval_s)

    async def poll(self, client: PoolClient) -> None:
        """One round: every live node's ring, the dead nodes' blocks; one batch if anything changed."""
        live = {node.node_id: node for node in await client.nodes(refresh=True)}
        events: list[object] = []
        for node_id in list(self._cursors):
            known = self._cursors[node_id]
            node = live.get(node_id)
            if node is None or node.epoch != known.epoch:
                events += self.view.node_gone(node_id)  # died, stopped, or restarted without its DRAM
                del self._cursors[node_id]
        for node in live.values():
            try:
                events += await self._read_node(client, node)
            except KVPoolError as exc:  # unreachable now: its blocks stay until the registry drops it
                logger.info("events: node %s did not answer EVENTS (%s)", node.node_id, exc)
        if events:
            self._publish(events)

    async def _read_node(self, client: PoolClient, node: NodeInfo) -> list[object]:
        cursor = self._cursors.get(node.node_id)
        events: list[object] = []
        if cursor is None:
            events += await self._resync(client, node)
            cursor = self._cursors[node.node_id]
        while True:
            page = await client.node_admin.events(node, cursor.next_seq, MAX_EVENTS_KEYS)
            if page.gap:
                return events + await self._resync(client, node)
            for entry in page.entries:
                if entry.kind == EVENT_STORED:
                    events += self.view.stored(node.node_id, entry.keys)
                else:
                    events += self.view.removed(node.node_id, entry.keys)
            cursor.next_seq = page.next_seq
            if not page.entries:
                return events

    async def _resync(self, client: PoolClient, node: NodeInfo) -> list[object]:
        """Read ``node`` whole: the ring's cursor, then INVENTORY; the caller reads the ring from the cursor."""
        start = (await client.node_admin.events(node, FAR_AHEAD, 1)).next_seq
        keys: list[str] = []
        async for page in client.node_admin.inventory_pages(node):
            keys += [row.key for row in page]
        self._cursors[node.node_id] = _Cursor(node.epoch, start)
        return list(self.view.replace(node.node_id, keys))

    def _publish(self, events: list[object]) -> None:
        self._last_seq += 1
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.config.data_parallel_rank)  # type: ignore[arg-type]
        payload = self.wire.encode(batch)
        self._kept.append((self._last_seq, payload))
        # NOBLOCK: a PUB socket drops for a slow subscriber at its high-water mark, never blocks.
        self._pub.send_multipart((self.topic, seq_bytes(self._last_seq), payload), flags=zmq.NOBLOCK)

    async def _replay_loop(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                logger.warning("events: a replay request of %d frames (want identity, empty, sequence)", len(frames))
                continue
            client_id, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            oldest = self._kept[0][0] if self._kept else self._last_seq + 1
            if start < oldest:
                # Before what is kept: the pool's contents as of the last sequence, then the end.
                snapshot = KVEventBatch(
                    ts=time.time(),
                    events=self.view.snapshot(),  # type: ignore[arg-type]
                    data_parallel_rank=self.config.data_parallel_rank,
                )
                await router.send_multipart(
                    (client_id, b"", seq_bytes(max(self._last_seq, 0)), self.wire.encode(snapshot))
                )
            else:
                for seq, payload in list(self._kept):
                    if seq >= start:
                        await router.send_multipart((client_id, b"", seq_bytes(seq), payload))
            await router.send_multipart((client_id, b"", END_SEQ, b""))

    def close(self) -> None:
        self._auth.stop()
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._ctx.term()
