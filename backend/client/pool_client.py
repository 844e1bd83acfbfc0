"""PoolClient: the facade both LMCache layers, the CLI and the bench use.

It wires the parts together and delegates: the registry view and the index lookup
(``registry``), one reader per path (``channel``, ``arena``, ``tcp``) behind the get
failover (``failover``); the channel too is built here, from the config
(``channel.open_channel``: ``nccl=on``), so every user of the client reads through it, the put planner (``putter``), leases (``leases``: the public ``lock``/``unlock``), and the
connections (``connection``). ``node_admin`` (``backend.client.node_admin.NodeAdmin``)
holds the typed requests the admin verbs address to one node. ``index``
(``backend.client.index.PoolIndex``) is the only way its users reach the metadata;
the ``MetadataStore`` itself stays private.

Errors: a node that is down, slow or answers a miss costs only the keys it held
(they come back as misses, with one warning per outage). Redis being unreachable
makes ``contains``/``get`` read as misses too (one warning per outage); ``put``,
``delete`` and the listing verbs raise :class:`MetadataError`. Nothing here ever
waits longer than ``progress_timeout_s`` for Redis, and after one timeout nothing waits at all
until Redis answers a probe (``backend.metadata.breaker``); a node that stopped
answering is likewise skipped until it answers a probe (``health``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, TypeVar

from backend.client.arena import ArenaReader
from backend.client.channel import Channel, ChannelReader, open_channel
from backend.client.chunks import BytesSink, Chunk, Fetched, Hit, Lock, Sink, Wanted
from backend.client.connection import Connections
from backend.client.context import ClientContext
from backend.client.failover import Getter, Reader
from backend.client.health import NodeHealth
from backend.client.index import PoolIndex
from backend.client.leases import Leases
from backend.client.node_admin import NodeAdmin
from backend.client.putter import PutPlanner
from backend.client.registry import Locator, RegistryView
from backend.client.stage import StagedWriter
from backend.client.tcp import TcpReader
from backend.client.touch import LookupTouches
from backend.config import PoolConfig
from backend.counters import ClientCounter
from backend.errors import AuthError, KVPoolError, NodeUnavailable
from backend.metadata import MetadataStore, NodeInfo
from backend.protocol import Op
from backend.protocol.meta import ANY_FINGERPRINT, NO_FINGERPRINT, check_key
from backend.tenants import scoped, unscoped
from backend.transport import client_tls_context

__all__ = ["PoolClient"]

logger = logging.getLogger("backend.client")

T = TypeVar("T")
OPEN_PROBES = 3  # live nodes connect() asks at most for its token check: dead ones each cost a connect timeout
CLOSE_BOUND_S = 1.0  # the channel's aborts and Redis's close each get this long; close never hangs on a dead peer


class PoolClient:
    """Async client of one pool namespace. Use on one event loop; ``close()`` when done."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        # Made once: loading the CA bundle is file I/O, and a bad path fails here, before any connection.
        tls = client_tls_context(config.tls_ca) if config.tls else None
        self._ctx = ClientContext(config)
        self.deadlines = self._ctx.deadlines  # every bound this client waits under (backend.config.deadlines)
        self._store = MetadataStore(
            config.redis_url,
            config.namespace,
            self.deadlines.redis_call_s,
            password=config.redis_password,
            ca_file=config.tls_ca,
            password_file=config.redis_password_file,
        )
        self.index = PoolIndex(self._store)
        self.counters: defaultdict[ClientCounter, int] = self._ctx.counters
        self.connections = Connections(config, tls, lambda: self._ctx.bulk)
        self.health = NodeHealth(self._ctx, self.connections.probe, self.connections.drop)
        self.connections.watch = self.health
        self.registry = RegistryView(self._ctx, self._store, self.health)
        self.node_admin = NodeAdmin(self.connections)
        self.arena = ArenaReader(self._ctx, self.connections)
        self.registry.on_change += [self.connections.prune, self.arena.prune, self.health.prune]
        self._locator = Locator(self._ctx, self._store, self.registry)
        self._tcp = TcpReader(self._ctx, self.connections)
        self._channel = open_channel(config, self.deadlines, self.index, self.channel_request)
        readers: list[Reader] = [self.arena, self._tcp]
        if self._channel is not None:
            readers.insert(0, ChannelReader(self._ctx, self._channel, self.connections))
        self._getter = Getter(self._ctx, self.registry, self._locator, readers)
        self._staged = StagedWriter(self._ctx, self.connections, self.arena)
        self._putter = PutPlanner(self._ctx, self.registry, self.connections, self._staged)
        self._leases = Leases(self._ctx, self.registry, self._locator, self.connections)
        # Lookup touches go on connections of their own (one a node): an older node closes the
        # connection of an op it does not know, and no read must share it.
        self._touch_connections = Connections(
            dataclasses.replace(config, connections_per_node=1), tls, lambda: self._ctx.bulk
        )
        self.registry.on_change.append(self._touch_connections.prune)
        self._touches = LookupTouches(self._ctx, self._locator.lookup, self.registry.node, self._send_touch)
        self.registry.on_change.append(self._touches.nodes_changed)

    def _check_open(self) -> None:
        if self._ctx.check_open():  # forked: the parent's sockets and mappings are not ours
            self.connections.forget()
            self.arena.forget()
            self._staged.forget()
            self._touch_connections.forget()

    @property
    def channel(self) -> Channel | None:
        """The channel same-cluster hits are read over first; None when ``nccl=on`` is not asked or cannot run here."""
        return self._channel

    # -- the data path ----------------------------------------------------------------
    async def nodes(self, refresh: bool = False) -> list[NodeInfo]:
        """Live nodes (refreshed in the background at most every second)."""
        self._check_open()
        return await self.registry.nodes(refresh)

    async def prepare_puts(self) -> int:
        """Ready the same-host put path to every live node on this host (arena mapped, stage made) before
        the first put needs it; how many nodes it serves. For a client that will put (the LMCache connector)."""
        self._check_open()
        return sum([await self._staged.prepare(node) for node in await self.registry.nodes(False)])

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held by a live node (one Redis round trip). The nodes holding the keys found
        from the start hear of them, later, where ``touch`` says (``backend.client.touch``)."""
        self._check_open()
        keys = self._scope(keys)
        hits = await self._locator.contains(keys)
        if self._touches.wanted:
            self._touches.found(keys[: hits.index(False) if False in hits else len(hits)])
        return hits

    async def hit_prefix(self, keys: Sequence[str]) -> int:
        """How many keys from the start are all present (one Redis round trip that stops at the first miss).
        The nodes holding them hear of it, later, where ``touch`` says (``backend.client.touch``)."""
        self._check_open()
        keys = self._scope(keys)
        found = await self._locator.hit_prefix(keys)
        if self._touches.wanted:
            self._touches.found(keys[:found])
        return found

    async def put(self, chunks: Sequence[Chunk], *, only: Sequence[str] | None = None) -> None:
        """Store every chunk on ``replicas`` nodes; raises if any chunk could not be stored.

        Returns only when the nodes have acknowledged (bytes complete and indexed)
        or failed, so the caller may reuse its buffers as soon as this returns.
        ``only`` restricts placement to these node ids (``kvpool drain --to``).
        """
        self._check_open()
        tenant = self.config.tenant
        if not tenant:
            await self._putter.put(chunks, only)
            return
        _check_keys([c.key for c in chunks])
        try:
            await self._putter.put([dataclasses.replace(c, key=scoped(tenant, c.key)) for c in chunks], only)
        except KVPoolError as exc:  # the outcomes name the keys as the caller did, not as the pool holds them
            if exc.outcomes:
                exc.outcomes = MappingProxyType({unscoped(tenant, k): o for k, o in exc.outcomes.items()})
            raise

    async def get(
        self, keys: Sequence[str], sink: Sink[T] | None = None, *, fingerprint: int = NO_FINGERPRINT
    ) -> list[T | None]:
        """Fetch keys into buffers from ``sink`` (default: new bytearrays); misses are None.

        Every chunk is checked against its checksum before it is returned; a
        mismatch is a miss, and that copy is dropped from the index. Only chunks stored
        with the reader's layout fingerprint are returned: the sink's (``sink.fingerprint``),
        else ``fingerprint`` (0: chunks stored without one); any other is a miss.
        """
        self._check_open()
        keys = self._scope(keys)
        chosen = sink if sink is not None else BytesSink(fingerprint)
        return await self._getter.get(keys, chosen)  # type: ignore[arg-type]

    async def lock(self, keys: Sequence[str], ttl_ms: int) -> list[Lock | None]:
        """Lease each key on the node that serves it for ``ttl_ms`` (see ``backend.client.leases``): the public
        name says lock, and a :class:`Lock` is the lease taken; None where the pool lacks the key."""
        self._check_open()
        return await self._leases.take(self._scope(keys), ttl_ms)

    async def unlock(self, locks: Sequence[Lock | None]) -> None:
        """End the leases taken by :meth:`lock`; idempotent."""
        self._check_open()
        await self._leases.release(locks)

    async def _send_touch(self, node: NodeInfo, meta: bytes) -> None:
        await self._touch_connections.to(node).request(Op.TOUCH, meta)

    async def channel_request(self, node: NodeInfo, meta: bytes) -> bytes:
        """One CHANNEL_GET to ``node`` over its TCP protocol; returns the response meta."""
        return bytes(await self.connections.to(node).request(Op.CHANNEL_GET, meta))

    # -- delete, admin, stats ---------------------------------------------------------
    async def delete(self, keys: Sequence[str]) -> int:
        """Remove keys everywhere: index first (so nobody reads them), then the bytes."""
        keys = self._scope(keys)
        entries = await self._store.index.lookup(keys)
        existed = await self._store.index.delete(keys)
        holders: dict[str, list[str]] = defaultdict(list)
        for key, entry in zip(keys, entries):
            for loc in entry:
                holders[loc.node_id].append(key)
        await self.registry.nodes(refresh=True)
        for nid, node_keys in holders.items():
            node = self.registry.node(nid)
            if node is None:
                continue
            try:
                await self.node_admin.delete_on(node, node_keys)
            except KVPoolError as exc:
                logger.warning("kvpool: delete on node %s failed (its copies age out): %s", nid, exc)
        return existed

    async def node(self, node_id: str) -> NodeInfo:
        """A live node by id (NodeUnavailable if it is not alive)."""
        nodes = {n.node_id: n for n in await self.nodes(refresh=True)}
        if node_id not in nodes:
            raise NodeUnavailable(f"node {node_id!r} is not alive in namespace {self.config.namespace!r}")
        return nodes[node_id]

    async def fetch_from(self, node: NodeInfo, wanted: Sequence[tuple[str, int]]) -> list[Fetched | None]:
        """Read ``(key, nbytes)`` from one given node (not any replica), whatever layout fingerprint each was
        stored with (``Fetched.meta.fingerprint`` says which: an admin copy keeps it); verified like ``get``."""
        sink = BytesSink(ANY_FINGERPRINT)
        outcomes = await self._getter.read_node(node, [Wanted(key, nbytes) for key, nbytes in wanted], sink)
        self.registry.trust(node.node_id)  # it answers reads again: no longer tried last
        return [o.handle if isinstance(o, Hit) else None for o in outcomes]

    async def list_keys(self, match: str = "*") -> list[str]:
        """The keys the index holds that match the glob ``match``: a tenant's client sees its own keys only,
        as its callers name them."""
        tenant = self.config.tenant
        if not tenant:
            return [key async for key in self._store.index.scan_keys(match)]
        return [unscoped(tenant, key) async for key in self._store.index.scan_keys(scoped(tenant, match))]

    async def node_stats(self, node: NodeInfo) -> dict[str, Any]:
        """One node's STAT answer as JSON (``node_admin.stats`` has it typed)."""
        return (await self.node_admin.stats(node)).to_json()

    async def ping(self) -> float:
        """Redis round trip in ms; raises MetadataError if Redis is unreachable."""
        return await self._store.connection.ping()

    async def close(self) -> None:
        """Close every connection; returns promptly even with nodes or Redis down."""
        if self._ctx.closed:
            return
        if self._channel is not None:  # its pairs first: their requests go over the connections
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_BOUND_S):
                    await self._channel.close()
        self.connections.close()
        self._touch_connections.close()
        self.arena.close()
        self._staged.close()
        await self._ctx.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_BOUND_S):
                await self._store.close()

    def _scope(self, keys: Sequence[str]) -> Sequence[str]:
        """Check ``keys`` (before any I/O) and make them the tenant's, when this client has one."""
        _check_keys(keys)
        tenant = self.config.tenant
        if not tenant:
            return keys
        scoped_keys = [scoped(tenant, key) for key in keys]
        _check_keys(scoped_keys)
        return scoped_keys

    async def connect(self, *, check_token: bool = True) -> PoolClient:
        """Open: Redis answers with this config's credentials, and (``check_token``) a live node takes its token.

        Raises :class:`RedisAuthError` (an ``AuthError``) when Redis refuses the password,
        :class:`RedisUnreachableError` or another ``MetadataError`` when Redis does not answer, and
        ``AuthError`` when a live node refuses the token. With no live node it succeeds: gets and
        lookups then miss and puts raise ``CapacityError`` until a node joins. A node that does not
        answer is not this client's fault: the next one is asked (at most ``OPEN_PROBES``), and none
        answering is no error.
        """
        self._check_open()
        await self._store.connection.ping()
        if not check_token:
            return self
        for node in (await self.registry.nodes(refresh=True))[:OPEN_PROBES]:
            try:
                await self.connections.probe(node)
            except AuthError:
                raise
            except KVPoolError as exc:
                logger.debug("kvpool: node %s did not answer the open's token check: %s", node.node_id, exc)
                continue
            break
        return self

    async def __aenter__(self) -> PoolClient:
        """Check Redis and its credentials now (``connect(check_token=False)``), not at the first call."""
        try:
            return await self.connect(check_token=False)
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _check_keys(keys: Sequence[str]) -> None:
    """Refuse a call with a key no node could store (empty, too long, not UTF-8) before any I/O."""
    for key in keys:
        check_key(key)
