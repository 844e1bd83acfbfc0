"""PoolClient: batched put/get/contains/delete against a kvpool pool.

Lookups are one pipelined Redis round trip; bytes move between the client and the
nodes over per-node pools of multiplexed connections (many requests in flight on
each). Payloads are received with ``recv_into`` straight into buffers the caller's
*sink* hands out, so the LMCache connector receives into LMCache's own memory.

A node on this host publishes a shared-memory arena (``backend.shm``); the client then
asks it for a LEASE with offsets instead of the bytes and copies the chunks straight
out of the mapping, which skips the socket and one copy (``shm=off`` turns this off).

Errors: a node that is down, slow or answers a miss costs only the keys it held
(they come back as misses, with one warning per outage). Redis being unreachable
makes ``contains``/``get`` read as misses too (one warning per outage); ``put``,
``delete`` and the listing verbs raise :class:`MetadataError`. Nothing here ever
waits longer than ``timeout_ms`` for Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import ssl
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Generic, Protocol, TypeVar

from backend.config import PoolConfig
from backend.errors import (
    AuthError,
    CapacityError,
    ConfigError,
    IntegrityError,
    KVPoolError,
    MetadataError,
    NodeUnavailable,
    ProtocolError,
)
from backend.metadata import Location, MetadataStore, NodeInfo
from backend.placement import choose_nodes, next_fallback, rank_nodes
from backend.protocol import (
    DEFAULT_LIMITS,
    LEASE_MAP,
    PUT_INTEGRITY,
    PUT_STORED,
    ItemMeta,
    Op,
    Status,
    auth_mac,
    check_item,
    check_key,
    checksum,
    decode_flags,
    decode_get_response,
    decode_json,
    decode_lease_response,
    encode_header,
    encode_items,
    encode_json,
    encode_keys,
    encode_lease_request,
    encode_release,
    error_for_status,
)
from backend.shm import ArenaView
from backend.transport import Buffer, FrameSocket, client_tls_context

__all__ = ["Chunk", "Fetched", "Lock", "PoolClient", "SyncPoolClient", "Sink", "BytesSink"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

REGISTRY_REFRESH_S = 1.0
FRESH_VIEW_S = 0.1  # a registry view younger than this is trusted to call a node dead
MAX_FRAME_DATA_BYTES = 256 * 1024 * 1024  # split larger batches into several frames
MAX_FRAME_ITEMS = 1024  # keeps a frame's meta far below the 4 MiB limit even with 1 KiB keys
MIN_TRANSFER_BYTES_PER_S = 50 * 1024 * 1024  # a request's timeout grows by 20 ms per MiB it moves
PUT_ATTEMPTS = 3  # first choice, then the next-ranked nodes
# A node that failed a read (down, stalled, reset) is tried after its replicas for this long,
# or until it answers a read: about one heartbeat TTL, by when the registry has declared it dead.
SUSPECT_S = 5.0
# A same-host read holds its lease from the LEASE answer until the copy is done; the
# longest wait in between is the caller's allocator (the LMCache connector bounds it at 1 s).
SHM_LEASE_MS = 10_000
SHM_LEASE_TRUST = 0.5  # copy from the arena only within this share of the lease (clocks, queueing)
MAX_LOCK_TTL_MS = 600_000  # the node's bound (backend.node.leases.MAX_LEASE_TTL_MS)
# Why a put failed when every node answered but none stored the chunk (PUT_NO_CAPACITY or PUT_INTEGRITY).
NO_ROOM = ": no node took them (no room: larger than a node's DRAM tier or DRAM full of puts in flight; or corrupt on arrival)"


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One value to store: bytes plus the tensor layout they will be rebuilt with."""

    key: str
    data: Buffer
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    fmt: int = 0

    def item_meta(self) -> ItemMeta:
        view = memoryview(self.data).cast("B")
        shape = self.shape or (len(view),)
        return ItemMeta(self.key, len(view), checksum(view), self.dtype, shape, self.fmt)

    def checked_item_meta(self) -> ItemMeta:
        """:meth:`item_meta`, after checking the key, size and layout against the protocol's limits.

        The size is checked before the payload is hashed, so an oversized value is
        refused at once.
        """
        nbytes = memoryview(self.data).nbytes
        check_item(ItemMeta(self.key, nbytes, 0, self.dtype, self.shape or (nbytes,), self.fmt))
        return self.item_meta()


@dataclasses.dataclass(frozen=True)
class Lock:
    """A key pinned on one node by :meth:`PoolClient.lock` until unlocked or its ttl ends."""

    key: str
    node_id: str
    lease_id: int
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A chunk read back with :class:`BytesSink`."""

    meta: ItemMeta
    data: bytearray


class Sink(Protocol[T]):  # type: ignore[misc]
    """Where a get puts bytes: hands out a buffer per item, takes it back on failure."""

    async def allocate(self, meta: ItemMeta) -> tuple[T, Buffer] | None: ...

    def release(self, handle: T) -> None: ...


class BytesSink:
    """The default sink: a fresh bytearray per item."""

    async def allocate(self, meta: ItemMeta) -> tuple[Fetched, Buffer] | None:
        data = bytearray(meta.nbytes)
        return Fetched(meta, data), data

    def release(self, handle: Fetched) -> None:
        pass


@dataclasses.dataclass
class _Pending(Generic[T]):
    op: int
    future: asyncio.Future[Any]
    keys: Sequence[str] = ()
    sink: Sink[T] | None = None


class _NodeConnection:
    """One multiplexed connection: a reader task matches responses to request ids."""

    def __init__(self, node: NodeInfo, config: PoolConfig, tls: ssl.SSLContext | None = None) -> None:
        self.node = node
        self.config = config
        self.tls = tls
        self.sock: FrameSocket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending[Any]] = {}
        self._abandoned: set[int] = set()  # cancelled requests whose responses are still due
        self._reader: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        self._ready = False  # set once HELLO/AUTH succeeded; nothing else is sent before
        self.broken = False

    @property
    def load(self) -> int:
        return len(self._pending)

    async def ensure_open(self) -> None:
        if self._ready:
            return
        async with self._connect_lock:
            if self._ready:
                return
            if self.broken:
                raise NodeUnavailable(f"connection to {self.node.node_id} is closed")
            _check_tls_agrees(self.node, self.tls is not None)
            sock = await FrameSocket.connect(self.node.host, self.node.port, self.config.timeout_s, self.tls)
            self.sock = sock
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(sock))
            try:
                hello = decode_json(await self.request(Op.HELLO, encode_json({"client": "kvpool"})))
                if hello.get("auth_required"):
                    if not self.config.token:
                        raise AuthError(f"node {self.node.node_id} requires a token; add it as kvpool://:TOKEN@...")
                    mac = auth_mac(self.config.token, bytes.fromhex(str(hello.get("nonce", ""))))
                    await self.request(Op.AUTH, encode_json({"mac": mac}))
                if hello.get("epoch") != self.node.epoch:
                    raise NodeUnavailable(f"node {self.node.node_id} restarted (epoch {hello.get('epoch')})")
                self._ready = True
            except BaseException:
                self.close(NodeUnavailable("handshake failed"))
                raise

    def close(self, reason: BaseException | None = None) -> None:
        self.broken = True
        if self.sock is not None:
            self.sock.close()
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        error = reason or NodeUnavailable(f"connection to {self.node.node_id} closed")
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()

    async def request(self, op: int, meta: bytes, data: Sequence[Buffer] = (), keys: Sequence[str] = (),
                      sink: Sink[Any] | None = None, expect_bytes: int = 0) -> Any:  # fmt: skip
        """Send one request and wait for its response.

        Bounded by the pool's ``timeout_ms`` plus the time the request's bytes (sent
        and expected back) take at ``MIN_TRANSFER_BYTES_PER_S``: a 256 MiB frame is
        not a slow node.
        """
        assert self.sock is not None
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = _Pending(op, future, keys, sink)
        data_len = sum(len(memoryview(b).cast("B")) for b in data)
        sent = False
        timeout_s = self.config.timeout_s + (data_len + expect_bytes) / MIN_TRANSFER_BYTES_PER_S
        try:
            async with asyncio.timeout(timeout_s):
                await self.sock.send([encode_header(op, request_id, meta, data_len), meta, *data])
                sent = True
                return await future
        except BaseException as exc:
            if future.done() and not future.cancelled() and future.exception() is None:
                _release_results(sink, future.result() if op == Op.GET_BATCH else [])  # answered too late
            if not isinstance(exc, TimeoutError):
                raise
            # The stream's state is unknown (maybe mid-frame): never reuse it.
            self.close(NodeUnavailable(f"node {self.node.node_id} timed out after {timeout_s * 1000:.0f} ms"))
            raise NodeUnavailable(
                f"node {self.node.node_id} ({self.node.address}) timed out after {timeout_s * 1000:.0f} ms"
            ) from None
        finally:
            answered = future.done() and not future.cancelled()
            if self._pending.pop(request_id, None) is not None and sent and not answered and not self.broken:
                self._abandoned.add(request_id)  # cancelled by the caller: skip its response
            if future.done() and not future.cancelled():
                future.exception()  # mark retrieved

    async def _read_loop(self, sock: FrameSocket) -> None:
        try:
            while True:
                header, meta = await sock.recv_frame_head(DEFAULT_LIMITS)
                if header.request_id in self._abandoned:
                    self._abandoned.discard(header.request_id)
                    await sock.discard(header.data_len)
                    continue
                pending = self._pending.get(header.request_id)
                if pending is None or not header.is_response or header.base_op != pending.op:
                    raise ProtocolError(f"unexpected response (op {header.op}, id {header.request_id})")
                if header.status != Status.OK:
                    await sock.discard(header.data_len)
                    message = bytes(meta).decode("utf-8", "replace")
                    if not pending.future.done():
                        pending.future.set_exception(error_for_status(header.status, message))
                    continue
                if pending.op == Op.GET_BATCH:
                    result: Any = await self._receive_get(sock, header.data_len, meta, pending)
                else:
                    await sock.discard(header.data_len)
                    result = meta
                self._abandoned.discard(header.request_id)  # it may have been cancelled mid-receive
                if pending.future.done():
                    _release_results(pending.sink, result if pending.op == Op.GET_BATCH else [])
                else:
                    pending.future.set_result(result)
        except asyncio.CancelledError:
            pass
        except (KVPoolError, OSError) as exc:
            self.close(exc if isinstance(exc, KVPoolError) else NodeUnavailable(str(exc)))
        except BaseException as exc:  # a sink bug must not leave waiters hanging
            self.close(NodeUnavailable(f"reader failed: {exc!r}"))
            raise

    async def _receive_get(
        self, sock: FrameSocket, data_len: int, meta: bytearray, pending: _Pending[Any]
    ) -> list[Any]:
        found = decode_get_response(meta, pending.keys, data_len)
        sink = pending.sink
        assert sink is not None
        results: list[Any] = []
        try:
            for item in found:
                if item is None:
                    results.append(None)
                    continue
                allocated = await sink.allocate(item)
                if allocated is None:
                    await sock.discard(item.nbytes)
                    results.append(DECLINED)
                    continue
                handle, buffer = allocated
                results.append(handle)
                view = memoryview(buffer).cast("B")
                if len(view) != item.nbytes:
                    raise ProtocolError(f"sink gave {len(view)} bytes for a {item.nbytes}-byte item")
                await sock.recv_into(view)
                if checksum(view) != item.checksum:
                    sink.release(handle)
                    results[-1] = IntegrityError(f"checksum mismatch for {item.key!r}")
        except BaseException:
            _release_results(sink, results)
            raise
        return results


DECLINED = object()  # the sink had no room: a miss for this call only, the copy is fine
TCP = object()  # a mapped read that must be redone over TCP


def _release_results(sink: Sink[Any] | None, results: Sequence[Any]) -> None:
    if sink is None:
        return
    for handle in results:
        if handle is not None and handle is not DECLINED and not isinstance(handle, BaseException):
            sink.release(handle)


def _release_task(task: asyncio.Task[Any], sink: Sink[Any]) -> None:
    if not task.cancelled() and task.exception() is None:
        _release_results(sink, task.result())


def _check_tls_agrees(node: NodeInfo, tls: bool) -> None:
    """Refuse before connecting when the client and the node's registry entry disagree about TLS."""
    if node.tls and not tls:
        raise NodeUnavailable(
            f"node {node.node_id} ({node.address}) serves TLS only; add tls=on (and tls_ca=PATH for a private CA) "
            "to the pool URL"
        )
    if tls and not node.tls:
        raise NodeUnavailable(
            f"node {node.node_id} ({node.address}) does not serve TLS but the pool URL says tls=on; "
            "start the node with --tls-cert and --tls-key"
        )


class _NodePool:
    """Up to ``connections_per_node`` connections to one node, least-loaded first."""

    def __init__(self, node: NodeInfo, config: PoolConfig, tls: ssl.SSLContext | None = None) -> None:
        self.node = node
        self.config = config
        self.tls = tls
        self.connections: list[_NodeConnection] = []

    async def request(self, op: int, meta: bytes, **kwargs: Any) -> Any:
        self.connections = [c for c in self.connections if not c.broken]
        if len(self.connections) < self.config.connections_per_node:
            conn = _NodeConnection(self.node, self.config, self.tls)
            self.connections.append(conn)
        else:
            conn = min(self.connections, key=lambda c: c.load)
        try:
            await conn.ensure_open()
        except BaseException:
            if conn in self.connections:
                self.connections.remove(conn)
            raise
        return await conn.request(op, meta, **kwargs)

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.connections = []


class PoolClient:
    """Async client of one pool namespace. Use on one event loop; ``close()`` when done."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        # Made once: loading the CA bundle is file I/O, and a bad path fails here, before any connection.
        self._tls = client_tls_context(config.tls_ca) if config.tls else None
        self.meta = MetadataStore(
            config.redis_url, config.namespace, config.timeout_s, password=config.redis_password, ca_file=config.tls_ca
        )
        self.counters: defaultdict[str, int] = defaultdict(int)
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_at = 0.0
        self._pools: dict[tuple[str, int], _NodePool] = {}
        self._arenas: dict[tuple[str, int], ArenaView | None] = {}  # None: not on this host
        self._pid = os.getpid()
        self._warned: set[str] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._refreshing: asyncio.Task[None] | None = None
        self._suspect_until: dict[str, float] = {}  # node id -> monotonic time it is read from last until
        self._closed = False

    # -- registry ---------------------------------------------------------------------
    async def nodes(self, refresh: bool = False) -> list[NodeInfo]:
        """Live nodes (refreshed in the background at most every second)."""
        self._check_fork()
        now = time.monotonic()
        if refresh or not self._nodes_at:
            await self._refresh_nodes()
        elif now - self._nodes_at > REGISTRY_REFRESH_S and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = self._spawn(self._refresh_nodes_quietly())
        return list(self._nodes.values())

    async def _refresh_nodes(self) -> None:
        infos = await self.meta.nodes()
        self._nodes = {n.node_id: n for n in infos if n.alive}
        self._nodes_at = time.monotonic()
        live = {(n.node_id, n.epoch) for n in self._nodes.values()}
        for ident in [i for i in self._pools if i not in live]:
            self._pools.pop(ident).close()
        for ident in [i for i in self._arenas if i not in live]:
            del self._arenas[ident]

    async def _refresh_nodes_quietly(self) -> None:
        with contextlib.suppress(KVPoolError):
            await self._refresh_nodes()

    def _pool(self, node: NodeInfo) -> _NodePool:
        ident = (node.node_id, node.epoch)
        pool = self._pools.get(ident)
        if pool is None:
            pool = self._pools[ident] = _NodePool(node, self.config, self._tls)
        return pool

    def _check_fork(self) -> None:
        if self._closed:
            raise KVPoolError("PoolClient is closed")
        if os.getpid() != self._pid:
            # Sockets made before a fork belong to the parent: forget, never reuse.
            self._pools = {}
            self._arenas = {}
            self._pid = os.getpid()

    def _warn_once(self, cause: str, message: str, *args: Any) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            logger.warning(message, *args)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _alive(self, loc: Location) -> bool:
        node = self._nodes.get(loc.node_id)
        return node is not None and node.epoch == loc.epoch

    def _ordered(self, entry: Sequence[Location]) -> list[Location]:
        """Live locations: nodes that just failed a read last, then same cluster first, then least loaded."""
        now = time.monotonic()

        def rank(loc: Location) -> tuple[bool, int, float]:
            node = self._nodes[loc.node_id]
            suspect = self._suspect_until.get(loc.node_id, 0.0) > now
            same = int(bool(self.config.cluster) and node.cluster == self.config.cluster)
            load = node.used_bytes / node.capacity_bytes if node.capacity_bytes else 1.0
            return (suspect, -same, load)

        return sorted((loc for loc in entry if self._alive(loc)), key=rank)

    # -- lookup -----------------------------------------------------------------------
    async def _lookup(self, keys: Sequence[str]) -> list[list[Location]]:
        """Index entries for ``keys``; locations on dead nodes are queued for cleanup.

        Redis unreachable (down, restarting, failing over) reads as every key missing:
        a lookup is a hint, and a miss costs a recompute, never a failed request.
        """
        try:
            entries = await self.meta.lookup(keys)
            await self.nodes()
            if any(not self._alive(loc) for entry in entries for loc in entry):
                if time.monotonic() - self._nodes_at > FRESH_VIEW_S:
                    await self._refresh_nodes()  # the view may predate a node's (re)start
        except MetadataError as exc:
            self._warn_once("redis", "kvpool: Redis lookup failed, reading as misses until it is back: %s", exc)
            self.counters["lookup_failures"] += 1
            return [[] for _ in keys]
        self._warned.discard("redis")
        if any(not self._alive(loc) for entry in entries for loc in entry):
            stale = [(k, loc) for k, entry in zip(keys, entries) for loc in entry if not self._alive(loc)]
            if stale:
                self._clean_later(stale, confirmed=False)
        return entries

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held by a live node (one Redis round trip)."""
        _check_keys(keys)
        entries = await self._lookup(keys)
        return [any(self._alive(loc) for loc in entry) for entry in entries]

    async def hit_prefix(self, keys: Sequence[str]) -> int:
        """How many keys from the start are all present."""
        hits = await self.contains(keys)
        return hits.index(False) if False in hits else len(hits)

    def _clean_later(self, stale: Sequence[tuple[str, Location]], *, confirmed: bool) -> None:
        """Drop stale locations in the background.

        ``confirmed``: the node itself said so (miss, bad checksum). Otherwise the
        location only looked dead from this client's view, which is re-read first so
        that a view older than a node's restart never deletes a live entry.
        """
        self._spawn(self._clean_quietly(list(stale), confirmed))

    async def _clean_quietly(self, stale: list[tuple[str, Location]], confirmed: bool) -> None:
        with contextlib.suppress(KVPoolError):
            if not confirmed:
                await self._refresh_nodes()
                stale = [(key, loc) for key, loc in stale if not self._alive(loc)]
            self.counters["stale_entries"] += len(stale)
            await self.meta.remove_stale(stale)

    # -- put --------------------------------------------------------------------------
    async def put(self, chunks: Sequence[Chunk], *, only: Sequence[str] | None = None) -> None:
        """Store every chunk on ``replicas`` nodes; raises if any chunk could not be stored.

        Returns only when the nodes have acknowledged (bytes complete and indexed)
        or failed, so the caller may reuse its buffers as soon as this returns.
        ``only`` restricts placement to these node ids (``kvpool drain --to``).
        """
        if not chunks:
            return
        # A chunk that breaks a limit refuses the whole call before anything is sent.
        items = [c.checked_item_meta() for c in chunks]
        data = {c.key: c.data for c in chunks}
        nodes = await self.nodes()
        if only is not None:
            nodes = [n for n in nodes if n.node_id in set(only)]
        if not nodes:
            raise CapacityError(f"no live node in namespace {self.config.namespace!r} can take writes")
        # key -> nodes still to try, best first; each key needs `replicas` successes.
        plans = {item.key: rank_nodes(item.key, nodes) for item in items}
        wanted = {item.key: choose_nodes(item.key, nodes, self.config.replicas) for item in items}
        stored: dict[str, set[str]] = defaultdict(set)  # key -> distinct nodes holding it
        tried: dict[str, set[str]] = defaultdict(set)
        failed_on: dict[str, set[str]] = defaultdict(set)  # key -> nodes its copy failed on
        last_error: KVPoolError | None = None
        targets = {item.key: [n for n in wanted[item.key]] for item in items}
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
                *(self._put_on_node(node_of[nid], group, data) for nid, group in groups.items()),
                return_exceptions=True,
            )
            targets = {}
            for (nid, group), outcome in zip(groups.items(), outcomes):
                for item, ok in zip(group, _put_flags(outcome, len(group))):
                    if ok:
                        stored[item.key].add(nid)
                        continue
                    failed_on[item.key].add(nid)
                    fallback = next_fallback(plans[item.key], tried[item.key], failed_on[item.key])  # another host
                    if fallback is not None:
                        targets.setdefault(item.key, []).append(fallback)
                        tried[item.key].add(fallback.node_id)  # never the same fallback twice
                if isinstance(outcome, KVPoolError):
                    last_error = outcome
                    self._warn_once(f"put:{nid}", "kvpool: put to node %s failed: %s", nid, outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome
        eligible = sum(1 for n in nodes if not n.draining)
        failed = [item.key for item in items if len(stored[item.key]) < min(self.config.replicas, max(eligible, 1))]
        self.counters["put_chunks"] += len(items) - len(failed)
        self.counters["put_bytes"] += sum(i.nbytes for i in items if i.key not in set(failed))
        if failed:
            self.counters["put_failures"] += len(failed)
            cause = f": {last_error}" if last_error else NO_ROOM
            error_type = type(last_error) if last_error is not None else CapacityError
            raise error_type(f"{len(failed)} of {len(items)} chunks were not stored{cause}")

    async def _put_on_node(self, node: NodeInfo, group: list[ItemMeta], data: dict[str, Buffer]) -> list[int]:
        pool = self._pool(node)
        flags: list[int] = []
        for frame in _frames(group):
            meta = encode_items(frame)
            reply = await pool.request(Op.PUT_BATCH, meta, data=[data[i.key] for i in frame])
            flags.extend(decode_flags(reply, len(frame)))
        integrity = sum(1 for f in flags if f == PUT_INTEGRITY)
        if integrity:
            self.counters["integrity_failures"] += integrity
        return flags

    # -- get --------------------------------------------------------------------------
    async def get(self, keys: Sequence[str], sink: Sink[T] | None = None) -> list[T | None]:
        """Fetch keys into buffers from ``sink`` (default: new bytearrays); misses are None.

        Every chunk is checked against its checksum before it is returned; a
        mismatch is a miss, and that copy is dropped from the index.
        """
        self._check_fork()
        _check_keys(keys)
        the_sink: Sink[Any] = sink if sink is not None else BytesSink()
        results: list[Any] = [None] * len(keys)
        if not keys:
            return results
        entries = await self._lookup(keys)
        candidates = [self._ordered(entry) for entry in entries]
        stale: list[tuple[str, Location]] = []  # copies a node said it lacks or corrupted
        todo = [i for i, cands in enumerate(candidates) if cands]
        tasks: list[asyncio.Task[list[Any]]] = []
        try:
            while todo:
                groups: dict[str, list[int]] = defaultdict(list)
                for i in todo:
                    groups[candidates[i][0].node_id].append(i)
                tasks = [
                    asyncio.ensure_future(
                        self._get_from_node(
                            self._nodes[nid], [(keys[i], candidates[i][0].nbytes) for i in idx], the_sink
                        )
                    )
                    for nid, idx in groups.items()
                ]
                await asyncio.wait(tasks)
                todo = []
                for (nid, idx), task in zip(groups.items(), tasks):
                    error = task.exception()
                    if error is not None and not isinstance(error, KVPoolError):
                        raise error
                    if error is not None:
                        self._warn_once(f"get:{nid}", "kvpool: get from node %s failed; its keys go to "
                                        "replicas, else miss: %s", nid, error)  # fmt: skip
                        self._suspect_until[nid] = time.monotonic() + SUSPECT_S
                        outcome: list[Any] = [error] * len(idx)
                    else:
                        self._warned.discard(f"get:{nid}")
                        self._suspect_until.pop(nid, None)
                        outcome = task.result()
                    for i, got in zip(idx, outcome):
                        loc = candidates[i].pop(0)
                        if got is DECLINED:
                            continue  # no room here this time; the copy itself is fine
                        if got is None or isinstance(got, BaseException):
                            if isinstance(got, IntegrityError):
                                self.counters["integrity_failures"] += 1
                                logger.warning("kvpool: %s on node %s; dropping that copy", got, nid)
                            if got is None or isinstance(got, IntegrityError):
                                stale.append((keys[i], loc))
                            if candidates[i]:
                                todo.append(i)
                                if isinstance(got, KVPoolError):
                                    self.counters["get_failovers"] += 1
                        else:
                            results[i] = got
                tasks = []
        except BaseException:
            # Cancelled (LMCache gave up) or failed: hand back every buffer taken so far.
            for task in tasks:
                if task.done():
                    _release_task(task, the_sink)
                else:
                    task.cancel()
                    task.add_done_callback(lambda t: _release_task(t, the_sink))
            _release_results(the_sink, results)
            raise
        if stale:
            self._clean_later(stale, confirmed=True)
        hits = sum(1 for r in results if r is not None)
        self.counters["get_hits"] += hits
        self.counters["get_misses"] += len(keys) - hits
        return results

    async def _get_from_node(self, node: NodeInfo, wanted: list[tuple[str, int]], sink: Sink[Any]) -> list[Any]:
        """GET ``(key, expected size)`` pairs from one node: mapped when it is on this host, else TCP."""
        arena = self._arena(node)
        if arena is not None:
            return await self._get_mapped(node, arena, wanted, sink)
        return await self._get_over_tcp(node, wanted, sink)

    async def _get_over_tcp(self, node: NodeInfo, wanted: list[tuple[str, int]], sink: Sink[Any]) -> list[Any]:
        """GET_BATCH in frames within the size limits; bytes arrive straight in the sink's buffers."""
        pool = self._pool(node)
        out: list[Any] = []
        try:
            for frame in _frames(wanted):
                keys = [key for key, _ in frame]
                expect = sum(nbytes for _, nbytes in frame)
                out.extend(
                    await pool.request(Op.GET_BATCH, encode_keys(keys), keys=keys, sink=sink, expect_bytes=expect)
                )
        except BaseException:
            _release_results(sink, out)  # an earlier frame's buffers are ours to give back
            raise
        return out

    # -- same-host reads --------------------------------------------------------------
    def _arena(self, node: NodeInfo) -> ArenaView | None:
        """The node's shared-memory arena if this process can map it (same host, same user)."""
        if not self.config.shm or not node.shm_path:
            return None
        ident = (node.node_id, node.epoch)
        if ident not in self._arenas:
            try:
                self._arenas[ident] = ArenaView(node.shm_path, node.shm_token)
                logger.info("kvpool: node %s is on this host; reading through %s", node.node_id, node.shm_path)
            except (OSError, ValueError):
                self._arenas[ident] = None  # another host, another user, or a stale file: TCP
        return self._arenas[ident]

    async def _get_mapped(
        self, node: NodeInfo, arena: ArenaView, wanted: list[tuple[str, int]], sink: Sink[Any]
    ) -> list[Any]:
        """LEASE the keys with offsets, copy each from the arena while the lease holds, release.

        A chunk goes over TCP instead when the node gives it no region (it could not
        promote it into the arena), when the node refuses the lease (its lease table
        is full), when the sink kept us waiting so long that the lease may be ending,
        or when the mapped copy fails its checksum: the TCP read then decides whether
        the chunk itself is bad, so a mapped read never drops a copy on its own.
        """
        pool = self._pool(node)
        out: list[Any] = [None] * len(wanted)
        over_tcp: list[int] = []
        try:
            for start in range(0, len(wanted), MAX_FRAME_ITEMS):
                keys = [key for key, _ in wanted[start : start + MAX_FRAME_ITEMS]]
                trust_until = time.monotonic() + SHM_LEASE_MS / 1000 * SHM_LEASE_TRUST
                try:
                    reply = await pool.request(Op.LEASE, encode_lease_request(keys, SHM_LEASE_MS, LEASE_MAP))
                except CapacityError:
                    over_tcp.extend(range(start, start + len(keys)))
                    continue
                lease_id, found = decode_lease_response(reply, keys)
                try:
                    for index, entry in enumerate(found, start):
                        if entry is None:
                            continue
                        item, offset = entry
                        got = TCP if offset is None else await self._copy_mapped(node, arena, item, offset,
                                                                                   sink, trust_until)  # fmt: skip
                        if got is TCP:
                            over_tcp.append(index)
                        else:
                            out[index] = got
                finally:
                    if lease_id:
                        self._spawn(self._release_quietly(pool, lease_id))
            if over_tcp:
                got = await self._get_over_tcp(node, [wanted[i] for i in over_tcp], sink)
                for index, handle in zip(over_tcp, got):
                    out[index] = handle
        except BaseException:
            _release_results(sink, out)
            raise
        return out

    async def _copy_mapped(
        self, node: NodeInfo, arena: ArenaView, item: ItemMeta, offset: int, sink: Sink[Any], trust_until: float
    ) -> Any:
        """Copy one leased chunk from the arena into a sink buffer; TCP when the copy cannot be trusted."""
        allocated = await sink.allocate(item)
        if allocated is None:
            return DECLINED
        handle, buffer = allocated
        view = memoryview(buffer).cast("B")
        try:
            if len(view) != item.nbytes:
                raise ProtocolError(f"sink gave {len(view)} bytes for a {item.nbytes}-byte item")
            if time.monotonic() < trust_until:
                try:
                    arena.copy_into(view, offset)
                except ValueError as exc:
                    raise ProtocolError(f"node {node.node_id} answered a bad arena offset: {exc}") from None
                if time.monotonic() < trust_until and checksum(view) == item.checksum:
                    self.counters["shm_get_bytes"] += item.nbytes
                    return handle
                logger.debug("kvpool: mapped copy of %r not trusted; reading it over TCP", item.key)
        except BaseException:
            sink.release(handle)
            raise
        sink.release(handle)
        return TCP

    async def _release_quietly(self, pool: _NodePool, lease_id: int, keys: Sequence[str] = ()) -> None:
        try:
            await pool.request(Op.RELEASE, encode_release(lease_id, keys))
        except KVPoolError as exc:  # the lease ends at its deadline instead
            logger.debug("kvpool: releasing lease on node %s failed: %s", pool.node.node_id, exc)

    # -- locks ------------------------------------------------------------------------
    async def lock(self, keys: Sequence[str], ttl_ms: int) -> list[Lock | None]:
        """Pin each key on the node that serves it for ``ttl_ms``; None where the pool lacks it.

        One Redis round trip for the locations, then one LEASE per node. A locked key
        is neither demoted nor evicted by its node until :meth:`unlock` or the ttl.
        A node that fails costs only its keys (None), like a miss.
        """
        self._check_fork()
        if not 0 < ttl_ms <= MAX_LOCK_TTL_MS:
            raise ConfigError("ttl_ms", f"{ttl_ms} is outside 1..{MAX_LOCK_TTL_MS}")
        _check_keys(keys)
        results: list[Lock | None] = [None] * len(keys)
        if not keys:
            return results
        entries = await self._lookup(keys)
        groups: dict[str, list[int]] = defaultdict(list)
        for index, entry in enumerate(entries):
            ordered = self._ordered(entry)
            if ordered:
                groups[ordered[0].node_id].append(index)

        async def on_node(node: NodeInfo, indexes: list[int]) -> None:
            for start in range(0, len(indexes), MAX_FRAME_ITEMS):
                part = indexes[start : start + MAX_FRAME_ITEMS]
                names = [keys[i] for i in part]
                reply = await self._pool(node).request(Op.LEASE, encode_lease_request(names, ttl_ms, 0))
                lease_id, found = decode_lease_response(reply, names)
                for index, entry in zip(part, found):
                    if entry is not None:
                        results[index] = Lock(keys[index], node.node_id, lease_id, node.epoch)

        outcomes = await asyncio.gather(
            *(on_node(self._nodes[nid], indexes) for nid, indexes in groups.items()), return_exceptions=True
        )
        for nid, outcome in zip(groups, outcomes):
            if isinstance(outcome, KVPoolError):
                self._warn_once(f"lock:{nid}", "kvpool: lock on node %s failed, reading as misses: %s", nid, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
        return results

    async def unlock(self, locks: Sequence[Lock | None]) -> None:
        """End locks taken by :meth:`lock`; idempotent, so a failed call may simply be repeated.

        Locks on nodes gone from the registry or restarted are ignored (their leases
        died with them). Every node is tried; then the first failure (a node that did
        not answer) is raised, and its locks end at their ttl unless a retry succeeds.
        """
        self._check_fork()
        by_lease: dict[tuple[str, int, int], list[str]] = defaultdict(list)
        for held in locks:
            if held is not None:
                by_lease[(held.node_id, held.epoch, held.lease_id)].append(held.key)
        if not by_lease:
            return
        await self.nodes()
        releases = []
        for (nid, epoch, lease_id), names in by_lease.items():
            node = self._nodes.get(nid)
            if node is None or node.epoch != epoch:
                continue  # the node restarted: its leases died with it
            pool = self._pool(node)
            releases += [pool.request(Op.RELEASE, encode_release(lease_id, names[i : i + MAX_FRAME_ITEMS]))
                         for i in range(0, len(names), MAX_FRAME_ITEMS)]  # fmt: skip
        outcomes = await asyncio.gather(*releases, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, KVPoolError):
                raise outcome
        failed = [outcome for outcome in outcomes if isinstance(outcome, KVPoolError)]
        if failed:
            raise failed[0]

    # -- channel (nccl_channel) --------------------------------------------------------
    async def channel_plan(
        self, keys: Sequence[str], reachable: Callable[[NodeInfo], bool]
    ) -> dict[str, tuple[NodeInfo, list[int]]]:
        """Group key indices by the node a channel would read them from.

        A key is planned only when its best live copy (same cluster first, then least
        loaded, as for ``get``) is on a node for which ``reachable(node)`` holds;
        the others are left to ``get``. One Redis round trip.
        """
        self._check_fork()
        plan: dict[str, tuple[NodeInfo, list[int]]] = {}
        if not keys:
            return plan
        for index, entry in enumerate(await self._lookup(keys)):
            ordered = self._ordered(entry)
            if not ordered:
                continue
            node = self._nodes[ordered[0].node_id]
            if reachable(node):
                plan.setdefault(node.node_id, (node, []))[1].append(index)
        return plan

    async def channel_request(self, node: NodeInfo, meta: bytes) -> bytes:
        """One CHANNEL_GET to ``node`` over its TCP protocol; returns the response meta."""
        return bytes(await self._pool(node).request(Op.CHANNEL_GET, meta))

    # -- delete, listing, stats -------------------------------------------------------
    async def delete(self, keys: Sequence[str]) -> int:
        """Remove keys everywhere: index first (so nobody reads them), then the bytes."""
        _check_keys(keys)
        entries = await self.meta.lookup(keys)
        existed = await self.meta.delete(keys)
        holders: dict[str, list[str]] = defaultdict(list)
        for key, entry in zip(keys, entries):
            for loc in entry:
                holders[loc.node_id].append(key)
        await self.nodes(refresh=True)
        for nid, node_keys in holders.items():
            node = self._nodes.get(nid)
            if node is None:
                continue
            try:
                await self._pool(node).request(Op.DELETE_BATCH, encode_keys(node_keys))
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
        """Read ``(key, nbytes)`` from one given node (not any replica); verified like ``get``."""
        got = await self._get_from_node(node, list(wanted), BytesSink())
        self._suspect_until.pop(node.node_id, None)  # it answers reads again: no longer tried last
        return [g if isinstance(g, Fetched) else None for g in got]

    async def node_request(self, node: NodeInfo, op: Op, meta: bytes) -> bytes:
        """One admin request to one node; returns the response meta."""
        return bytes(await self._pool(node).request(op, meta))

    async def list_keys(self, match: str = "*") -> list[str]:
        return [key async for key in self.meta.scan_keys(match)]

    async def node_stats(self, node: NodeInfo) -> dict[str, Any]:
        return decode_json(await self._pool(node).request(Op.STAT, b""))

    async def ping(self) -> float:
        """Redis round trip in ms; raises MetadataError if Redis is unreachable."""
        return await self.meta.ping()

    async def close(self) -> None:
        """Close every connection; returns promptly even with nodes or Redis down."""
        if self._closed:
            return
        self._closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools = {}
        for task in list(self._background):
            task.cancel()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await asyncio.gather(*self._background, return_exceptions=True)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self.meta.close()

    async def __aenter__(self) -> PoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _check_keys(keys: Sequence[str]) -> None:
    """Refuse a call with a key no node could store (empty, too long, not UTF-8) before any I/O."""
    for key in keys:
        check_key(key)


def _frame_data_budget() -> int:
    # Never ask a node for a response larger than this side accepts.
    return min(MAX_FRAME_DATA_BYTES, DEFAULT_LIMITS.max_data_bytes)


def _frames(items: Sequence[T]) -> list[list[T]]:
    """Split items (ItemMeta, or (key, nbytes) pairs) into frames within the size and count limits."""
    frames: list[list[T]] = [[]]
    size = 0
    for item in items:
        nbytes = item.nbytes if isinstance(item, ItemMeta) else item[1]  # type: ignore[index]
        if frames[-1] and (size + nbytes > _frame_data_budget() or len(frames[-1]) >= MAX_FRAME_ITEMS):
            frames.append([])
            size = 0
        frames[-1].append(item)
        size += nbytes
    return frames


def _put_flags(outcome: Any, n: int) -> list[bool]:
    if isinstance(outcome, BaseException):
        return [False] * n
    return [flag == PUT_STORED for flag in outcome]


class SyncPoolClient:
    """Blocking twin of :class:`PoolClient`: the same code on a private event-loop thread."""

    def __init__(self, config: PoolConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvpool-client", daemon=True)
        self._thread.start()
        self._client = self._call(self._make(config))
        self.config = config

    @staticmethod
    async def _make(config: PoolConfig) -> PoolClient:
        return PoolClient(config)

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout_s)

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._client.counters)

    def put(self, chunks: Sequence[Chunk]) -> None:
        self._call(self._client.put(chunks))

    def get(self, keys: Sequence[str]) -> list[Fetched | None]:
        return self._call(self._client.get(keys))

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return self._call(self._client.contains(keys))

    def hit_prefix(self, keys: Sequence[str]) -> int:
        return self._call(self._client.hit_prefix(keys))

    def delete(self, keys: Sequence[str]) -> int:
        return self._call(self._client.delete(keys))

    def lock(self, keys: Sequence[str], ttl_ms: int) -> list[Lock | None]:
        return self._call(self._client.lock(keys, ttl_ms))

    def unlock(self, locks: Sequence[Lock | None]) -> None:
        self._call(self._client.unlock(locks))

    def nodes(self, refresh: bool = True) -> list[NodeInfo]:
        return self._call(self._client.nodes(refresh=refresh))

    def list_keys(self, match: str = "*") -> list[str]:
        return self._call(self._client.list_keys(match))

    def node_stats(self, node: NodeInfo) -> dict[str, Any]:
        return self._call(self._client.node_stats(node))

    def ping(self) -> float:
        return self._call(self._client.ping())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._client.close(), timeout_s=5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> SyncPoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
