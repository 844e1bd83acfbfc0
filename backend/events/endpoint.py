"""The ``kvpool events`` endpoint: the pool's stores and removals for KV-aware routers, in vLLM's format.

Every ``poll_interval_s`` it reads the registry's live nodes and each node's ring (EVENTS, from
its cursor), turns what changed into vLLM events (``view.py``), and publishes them as one
``KVEventBatch`` on a ZMQ PUB socket: frames (topic, 8-byte big-endian sequence number, msgpack
payload), topic ``kv@IDENTITY@MODEL``. The last ``replay_batches`` batches are kept for a ROUTER
replay socket, as vLLM's ``ZmqEventPublisher`` keeps them: a client sends a start sequence and
gets every kept batch from it, then the sequence -1 (the frames of ``--form``'s releases: wire.py).
A client asking from before what is kept (a late subscriber) gets one batch instead, the
snapshot: the pool's contents (``AllBlocksCleared``, then every block held), published as the
stream's next batch with a sequence of its own (a number is never reused for another payload),
so with the PUB stream after it the client has everything. Only the newest snapshot is kept.

Chunks put with their token ids (``event_tokens=on``) are announced with them and their parent;
a batch announces parents before children, and a chunk whose parent is not announced yet waits
one poll for it (a put's chunks reach the endpoint node by node).

A node the endpoint meets (or meets again under a new epoch, or whose ring moved past its
cursor) is read whole: its ring's cursor first, then its INVENTORY, then its ring from that
cursor, so nothing that happened during the walk is lost. A node the registry no longer lists
alive has its blocks removed. The endpoint holds no lock and takes no part in a put.

Both sockets use CURVE with keys derived from the pool token (``auth.py``); the endpoint refuses
to start without a token (it reads the nodes with it). Plain mode (``plain``, for stock vLLM
subscribers) drops CURVE, on loopback addresses only unless ``plain_on_network`` says otherwise,
and logs so at start. An endpoint of one tenant (``tenant``) publishes only that tenant's
blocks (its keys ``~t/NAME/KEY``, as the tenant's engines name them: ``KEY``), and derives its
CURVE keys from that tenant's token instead: a subscriber holding tenant A's token is admitted
by A's endpoint only, and no endpoint publishes another tenant's blocks to it. The endpoint still
reads the nodes with the pool token (a tenant's token may not read their rings). An endpoint of
no tenant publishes the keys of no tenant. During a rotation of the subscribers' token (the pool's,
or a tenant endpoint's tenant's) the next token's holders subscribe on their own sockets
(``publish_next``, ``replay_next``: a CURVE server has one key pair), which carry the same batches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from backend.client import PoolClient
from backend.config import PoolConfig
from backend.errors import ConfigError, KVPoolError
from backend.events.auth import CurveKeys, curve_keys, is_loopback
from backend.events.view import BlockShape, PoolView, parents_first
from backend.events.wire import DEFAULT_FORM, BlockStored, KVEventBatch, Wire, seq_bytes, wire_form
from backend.metadata import NodeInfo
from backend.protocol.events import EVENT_STORED, MAX_EVENTS_KEYS
from backend.protocol.tokens import ChunkTokens
from backend.tenants import check_tenant, scoped, tenant_of

__all__ = ["DEFAULT_CHUNK_TOKENS", "EndpointConfig", "EventsEndpoint"]

logger = logging.getLogger(__name__)

DEFAULT_REPLAY_BATCHES = 10_000  # vLLM's buffer_steps
DEFAULT_CHUNK_TOKENS = 256  # LMCache's default chunk_size
DEFAULT_MEDIUM = "CPU"
MAIN_DOMAIN, NEXT_DOMAIN = "", "next"  # ZAP domains: which token's client key a socket admits
FAR_AHEAD = 1 << 62  # a cursor no ring has reached: EVENTS answers with its next sequence only


@dataclass(frozen=True)
class EndpointConfig:
    """What ``kvpool events`` was asked for; checked once."""

    model: str
    publish: str = "tcp://*:5557"
    replay: str | None = None
    identity: str = ""  # default: "kvpool-" + the namespace
    block_size: int = DEFAULT_CHUNK_TOKENS  # tokens per block announced (docs/fleet-events.md)
    chunk_size: int = 0  # LMCache's chunk_size; 0: the block size (one chunk, one block)
    medium: str = DEFAULT_MEDIUM
    form: str = DEFAULT_FORM  # the vLLM releases whose wire is written (wire.py)
    replay_batches: int = DEFAULT_REPLAY_BATCHES
    poll_interval_s: float = 0.2
    data_parallel_rank: int = 0
    tenant: str = ""  # publish only this tenant's blocks, to holders of its token ("": keys of no tenant)
    # During a rotation: the same batches on these addresses, to holders of the next token.
    publish_next: str | None = None
    replay_next: str | None = None
    plain: bool = False  # no CURVE: any subscriber that reaches the sockets (a stock vLLM subscriber)
    plain_on_network: bool = False  # plain on an address other machines reach, too

    def __post_init__(self) -> None:
        if self.tenant:
            check_tenant(self.tenant, "--tenant")
        if not self.model or "@" in self.model:
            raise ConfigError("--model", f"{self.model!r} is not a model name (non-empty, no '@')")
        if self.block_size <= 0:
            raise ConfigError("--block-size", f"{self.block_size} is not a positive number of tokens")
        if self.chunk_size < 0:
            raise ConfigError("--chunk-size", f"{self.chunk_size} is not a positive number of tokens")
        if self.chunk_size % self.block_size:
            raise ConfigError(
                "--block-size",
                f"{self.block_size} does not divide the chunk size {self.chunk_size} (--chunk-size): a chunk "
                "would not be a whole number of blocks",
            )
        if self.replay_batches <= 0:
            raise ConfigError("--replay-batches", f"{self.replay_batches} is not a positive number")
        if not 0 < self.poll_interval_s <= 60:
            raise ConfigError("--poll-interval-s", f"{self.poll_interval_s} is outside (0, 60]")
        try:
            wire_form(self.form)
        except ValueError as exc:
            raise ConfigError("--form", str(exc)) from None
        if self.replay_next is not None and self.replay is None:
            raise ConfigError("--replay-next", "a replay address for the next token needs --replay too")
        self._check_plain()

    def _check_plain(self) -> None:
        if self.plain_on_network and not self.plain:
            raise ConfigError("--plain-on-network", "it lets --plain bind beyond loopback, and --plain is not given")
        if not self.plain:
            return
        if self.publish_next is not None:
            raise ConfigError(
                "--publish-next", "a plain endpoint (--plain) admits every subscriber: no next token needs sockets"
            )
        for flag, address in (("--publish", self.publish), ("--replay", self.replay)):
            if address is not None and not self.plain_on_network and not is_loopback(address):
                raise ConfigError(
                    "--plain",
                    f"{flag} {address} is not a loopback address: without CURVE, anyone who reaches it reads what the "
                    "pool holds. Bind 127.0.0.1, ::1 or ipc://, or add --plain-on-network if the network is yours",
                )

    def topic(self, namespace: str) -> str:
        pod = f"kvpool-{namespace}-{self.tenant}" if self.tenant else f"kvpool-{namespace}"
        return f"kv@{self.identity or pod}@{self.model}"


class _OneKey:
    """A ZAP credentials provider that admits one client key (Z85, as the authenticator passes it)."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.allowed


@dataclass
class _Cursor:
    epoch: int
    next_seq: int


class EventsEndpoint:
    """One endpoint over one pool and one model; :meth:`run` until cancelled, then :meth:`close`."""

    def __init__(self, pool: PoolConfig, config: EndpointConfig, tenant_token: str = "", next_token: str = "") -> None:
        """``tenant_token``: with ``config.tenant``, that tenant's token (its subscribers' CURVE keys).
        ``next_token``: during a rotation of the subscribers' token (the pool's, or with ``config.tenant`` the
        tenant's), the next one, whose holders subscribe on ``config.publish_next``."""
        if not pool.token:
            raise ConfigError(
                "token",
                "the events endpoint needs the pool token: events say what the pool holds. Add token_file=PATH to "
                "the URL (or set KVPOOL_TOKEN), with nodes started with --token-file PATH and --event-ring-keys N; "
                "`kvpool up --events` makes such a pool and prints its URL",
            )
        if bool(config.tenant) != bool(tenant_token):
            raise ConfigError(
                "--tenant-token-file",
                "a tenant's endpoint (--tenant NAME) needs that tenant's token (--tenant-token-file), and only it",
            )
        if tenant_token == pool.token:
            raise ConfigError("--tenant-token-file", "the tenant's token is the pool token: give the tenant's own")
        self.pool = pool
        self.config = config
        self.topic = config.topic(pool.namespace).encode()
        self.view = PoolView(config.model, BlockShape(config.block_size, config.medium, chunk_size=config.chunk_size))
        self.wire = Wire(config.form)
        self._cursors: dict[str, _Cursor] = {}
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.replay_batches)
        self._last_seq = -1
        self._snapshot: tuple[int, bytes] | None = None  # the newest snapshot batch kept (only it is kept)
        self._told_unsplit = False
        self._held: list[object] = []  # stores waiting one poll for their parent's (see _ready)
        if bool(next_token) != (config.publish_next is not None):
            raise ConfigError(
                "--publish-next", "a second token's subscribers need their own address: give both or neither"
            )
        next_flag = "--tenant-token-file-next" if config.tenant else "--token-file-next"
        if next_token and next_token == (tenant_token or pool.token):
            raise ConfigError(next_flag, "the next token is the current one")
        if next_token and config.tenant and next_token == pool.token:
            raise ConfigError(next_flag, "the tenant's next token is the pool token: give the tenant's own")
        self._keys = curve_keys(tenant_token or pool.token, pool.namespace)
        # A CURVE server has one key pair, derived from one token: the next token's holders get their own sockets.
        self._next_keys = curve_keys(next_token, pool.namespace) if next_token else None
        self._prefix = scoped(config.tenant, "") if config.tenant else ""
        self._ctx = zmq.asyncio.Context()
        self._auth = AsyncioAuthenticator(self._ctx)
        self._pub = self._ctx.socket(zmq.PUB)
        self._router: zmq.asyncio.Socket | None = None
        self._next_pub: zmq.asyncio.Socket | None = None
        self._next_router: zmq.asyncio.Socket | None = None
        self.publish_address = ""
        self.replay_address = ""
        self.next_publish_address = ""
        self.next_replay_address = ""

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch published (-1: none yet)."""
        return self._last_seq

    @staticmethod
    def _secure(sock: zmq.asyncio.Socket, keys: CurveKeys, domain: str) -> None:
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
        if domain:  # the main sockets keep ZMQ's default domain, which the authenticator names "*"
            sock.zap_domain = domain.encode()

    def bind(self) -> None:
        """Start the authenticator (it admits, on each socket, the one client key its token derives) and bind
        the sockets; in plain mode, bind them only, and say so."""
        if self.config.plain:
            self._pub, self._router, self.publish_address, self.replay_address = self._bind(
                None, MAIN_DOMAIN, self.config.publish, self.config.replay, self._pub
            )
            logger.warning(
                "events: plain mode (--plain): no CURVE on %s%s; every subscriber that reaches it reads what the pool "
                "holds",
                self.publish_address,
                f" and {self.replay_address}" if self.replay_address else "",
            )
            return
        self._auth.start()
        # "*": the sockets of no ZAP domain (the main ones); a domain without a provider is refused.
        self._auth.configure_curve_callback(domain="*", credentials_provider=_OneKey(self._keys.client_public))
        if self._next_keys is not None:
            self._auth.configure_curve_callback(
                domain=NEXT_DOMAIN, credentials_provider=_OneKey(self._next_keys.client_public)
            )
        self._pub, self._router, self.publish_address, self.replay_address = self._bind(
            self._keys, MAIN_DOMAIN, self.config.publish, self.config.replay, self._pub
        )
        if self._next_keys is not None and self.config.publish_next is not None:
            sockets = self._bind(self._next_keys, NEXT_DOMAIN, self.config.publish_next, self.config.replay_next)
            self._next_pub, self._next_router, self.next_publish_address, self.next_replay_address = sockets

    def _bind(
        self,
        keys: CurveKeys | None,
        domain: str,
        publish: str,
        replay: str | None,
        pub: zmq.asyncio.Socket | None = None,
    ) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket | None, str, str]:
        """One token's PUB socket (and ROUTER, with ``replay``), bound: (pub, router, their addresses). No
        ``keys``: plain."""
        pub = pub if pub is not None else self._ctx.socket(zmq.PUB)
        if keys is not None:
            self._secure(pub, keys, domain)
        pub.bind(publish)
        router: zmq.asyncio.Socket | None = None
        replay_address = ""
        if replay is not None:
            router = self._ctx.socket(zmq.ROUTER)
            if keys is not None:
                self._secure(router, keys, domain)
            router.bind(replay)
            replay_address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        return pub, router, pub.getsockopt_string(zmq.LAST_ENDPOINT), replay_address

    async def run(self) -> None:
        """Poll the nodes and serve replays until cancelled."""
        async with PoolClient(self.pool) as client:
            self._publish([*self.view.snapshot()[:1]])  # AllBlocksCleared: a subscriber forgets an earlier run
            tasks = [asyncio.create_task(self._poll_loop(client))]
            for router in (self._router, self._next_router):
                if router is not None:
                    tasks.append(asyncio.create_task(self._replay_loop(router)))
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
        held, self._held = self._held, []
        ready = self._ready(parents_first([*held, *events]), {id(e) for e in held})
        if ready:
            self._publish(ready)
        if self.view.unsplit and not self._told_unsplit:
            self._told_unsplit = True
            logger.info("events: chunks without token ids are announced whole, not split (docs/fleet-events.md)")

    def _ready(self, events: list[object], due: set[int]) -> list[object]:
        """``events`` (parents first) less the stores whose parent is announced neither before nor in them: a
        put's chunks reach the endpoint node by node, so such a parent may come with the next poll. Those wait
        for it once (``self._held``); the ones in ``due`` (held last poll) go now whatever."""
        ready: list[object] = []
        waiting: set[int] = set()
        for event in events:
            if isinstance(event, BlockStored) and id(event) not in due:
                parent = event.parent_block_hash
                if parent is not None and (parent in waiting or not self.view.holds(parent)):
                    self._held.append(event)
                    waiting.add(event.block_hashes[-1])
                    continue
            ready.append(event)
        return ready

    async def _read_node(self, client: PoolClient, node: NodeInfo) -> list[object]:
        cursor = self._cursors.get(node.node_id)
        events: list[object] = []
        if cursor is None:
            events += await self._resync(client, node)
            cursor = self._cursors[node.node_id]
        while True:
            page = await client.node_admin.events(node, cursor.next_seq, MAX_EVENTS_KEYS, tokens=True)
            if page.gap:
                return events + await self._resync(client, node)
            for entry in page.entries:
                keys, tokens = self._own(entry.keys, entry.tokens)
                if entry.kind == EVENT_STORED:
                    events += self.view.stored(node.node_id, keys, tokens)
                else:
                    events += self.view.removed(node.node_id, keys)
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
        return list(self.view.replace(node.node_id, self._own(keys)[0]))

    def _own(
        self, keys: Sequence[str], tokens: Sequence[ChunkTokens | None] | None = None
    ) -> tuple[list[str], list[ChunkTokens | None] | None]:
        """Of ``keys`` (and their tokens), those this endpoint publishes, as their engines name them:
        the tenant's, unscoped; without a tenant, the keys of none."""
        prefix = self._prefix
        if not prefix:
            mine = [i for i, key in enumerate(keys) if tenant_of(key) is None]
            names = [keys[i] for i in mine]
        else:
            mine = [i for i, key in enumerate(keys) if key.startswith(prefix)]
            names = [keys[i][len(prefix) :] for i in mine]
        return names, [tokens[i] for i in mine] if tokens is not None else None

    def _publish(self, events: Sequence[object]) -> tuple[int, bytes]:
        """Publish ``events`` as the next batch of the stream (and keep it for replays): its sequence and bytes."""
        self._last_seq += 1
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=self.config.data_parallel_rank)  # type: ignore[arg-type]
        payload = self.wire.encode(batch)
        self._kept.append((self._last_seq, payload))
        # NOBLOCK: a PUB socket drops for a slow subscriber at its high-water mark, never blocks.
        for pub in (self._pub, self._next_pub):
            if pub is not None:
                pub.send_multipart((self.topic, seq_bytes(self._last_seq), payload), flags=zmq.NOBLOCK)
        return self._last_seq, payload

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
                # Before what is kept: the pool's contents now, as a batch of the stream with a sequence of its own
                # (every subscriber gets it, and the stream has no gap), then the end.
                seq, payload = self._publish(self.view.snapshot())
                self._keep_one_snapshot((seq, payload))
                await router.send_multipart((client_id, b"", *self.wire.replay_frames(self.topic, seq, payload)))
            else:
                for seq, payload in list(self._kept):
                    if seq >= start:
                        await router.send_multipart(
                            (client_id, b"", *self.wire.replay_frames(self.topic, seq, payload))
                        )
            await router.send_multipart((client_id, b"", *self.wire.replay_end()))

    def _keep_one_snapshot(self, snapshot: tuple[int, bytes]) -> None:
        """Drop the previous snapshot from the kept batches: it can be large (every block held), and a replay
        from before it gets the newer one, which supersedes it (it starts with ``AllBlocksCleared``)."""
        if self._snapshot is not None and self._snapshot in self._kept:
            self._kept.remove(self._snapshot)
        self._snapshot = snapshot

    def close(self) -> None:
        self._auth.stop()
        for sock in (self._pub, self._router, self._next_pub, self._next_router):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
