"""Connections to one node: multiplexed request/response over the kvpool protocol.

Many requests are in flight on each connection; a reader task matches responses to
request ids. A GET's payload is received straight into the sink's buffers, on a
worker thread when it is large (``backend.transport``), and each chunk is verified
against its checksum there. A connection whose stream state is in doubt (a request
timed out mid-frame, a frame cut short) is closed, never reused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import ssl
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

from backend.client.chunks import (
    DECLINED,
    MISS,
    Failed,
    Hit,
    Outcome,
    Sink,
    allocate_view,
    layout_differs,
    release_hits,
    sink_fingerprint,
)
from backend.client.silence import SilenceWatch
from backend.config import PoolConfig
from backend.config.deadlines import Deadlines
from backend.errors import IntegrityError, KVPoolError, NodeUnavailable, ProtocolError
from backend.handshake import ClientHello, handshake_key
from backend.metadata import NodeInfo
from backend.protocol import DEFAULT_LIMITS, ItemMeta, Op, Status, checksum
from backend.protocol.frame import encode_header, error_for_status
from backend.protocol.meta import OtherLayout, decode_json, encode_json
from backend.protocol.reads import GetBatch
from backend.protocol.reports import Ping
from backend.transport import Buffer, FrameSocket

__all__ = [
    "Connections",
    "NodeConnection",
    "NodeConnectionSet",
    "NodeWatch",
    "check_tls_agrees",
    "frames",
    "frame_data_budget",
    "MAX_FRAME_ITEMS",
]

T = TypeVar("T")

MAX_FRAME_DATA_BYTES = 256 * 1024 * 1024  # split larger batches into several frames
MAX_FRAME_ITEMS = 1024  # keeps a frame's meta far below the 4 MiB limit even with 1 KiB keys


@dataclasses.dataclass
class _Pending:
    op: int
    future: asyncio.Future[Any]
    keys: Sequence[str] = ()
    sink: Sink[Any] | None = None
    hold_s: float = 0.0  # how long the node may hold the request back (a put waiting for room)


def _drop(pending: _Pending, result: Any) -> None:
    """A GET answer nobody waits for any more: give its buffers back."""
    if pending.op == Op.GET_BATCH and pending.sink is not None:
        release_hits(pending.sink, result)


class NodeConnection:
    """One multiplexed connection: a reader task matches responses to request ids."""

    def __init__(
        self, node: NodeInfo, config: PoolConfig, tls: ssl.SSLContext | None = None, bulk: Executor | None = None
    ) -> None:
        self.node = node
        self.config = config
        self.deadlines = Deadlines.from_config(config)
        self.tls = tls
        self.bulk = bulk
        self.sock: FrameSocket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._abandoned: set[int] = set()  # cancelled requests whose responses are still due
        self._reader: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        self._ready = False  # set once HELLO/AUTH succeeded; nothing else is sent before
        # The tenant the node bound this connection to (this client's token is that tenant's): the node
        # then refuses its arena, stages and channel, and the client reads and puts over TCP.
        self.tenant: str | None = None
        self.broken = False
        self._closed_by: BaseException | None = None  # why it was closed: what a later request raises
        self._told = False  # the node said why it closes this connection (an error frame for request id 0)

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
            check_tls_agrees(self.node, self.tls is not None)
            sock = await FrameSocket.connect(
                self.node.host, self.node.port, self.deadlines.connect_s, self.tls, self.bulk
            )
            self.sock = sock
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(sock))
            try:
                handshake = ClientHello(self.node.node_id, self.node.address, await self._handshake_key())
                hello = decode_json(await self.request(Op.HELLO, encode_json(handshake.request())))
                auth = handshake.answer(hello)  # the node is the one meant (None: the pool has no token)
                if auth is not None:
                    answer = decode_json(await self.request(Op.AUTH, encode_json(auth)))
                    handshake.check(answer)
                    tenant = answer.get("tenant")
                    self.tenant = tenant if isinstance(tenant, str) else None
                if hello.get("epoch") != self.node.epoch:
                    raise NodeUnavailable(f"node {self.node.node_id} restarted (epoch {hello.get('epoch')})")
                self._ready = True
            except BaseException:
                self.close(NodeUnavailable("handshake failed"))
                raise

    async def _handshake_key(self) -> bytes | None:
        """The pool's handshake key (None without a token): stretched once per process, on a worker thread
        (about 50 ms: not on the caller's loop, which may be LMCache's)."""
        if not self.config.token:
            return None
        return await asyncio.to_thread(handshake_key, self.config.token, self.config.namespace)

    def close(self, reason: BaseException | None = None) -> None:
        self.broken = True
        if self.sock is not None:
            self.sock.close()
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        error = reason or NodeUnavailable(f"connection to {self.node.node_id} closed")
        if self._closed_by is None:
            self._closed_by = error
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()

    async def request(
        self,
        op: int,
        meta: bytes,
        data: Sequence[Buffer] = (),
        keys: Sequence[str] = (),
        sink: Sink[Any] | None = None,
        expect_bytes: int = 0,
        hold_s: float = 0.0,
    ) -> Any:
        """Send one request and wait for its response (a GET's: one :data:`Outcome` per key).

        Abandoned when the connection moves no byte (sent or received, for any request on it)
        for its silence, the progress deadline plus the ``hold_s`` of the requests ahead of it
        (the node reads a connection's frames in order, and may hold a put back that long
        waiting for room), or when it passes its overall bound, that silence plus its bytes at
        the slowest rate waited on (``Deadlines.request_silence_s``, ``request_overall_s``).
        A dead or silent link is thus found by silence, whatever the request's size.
        """
        sock = self.sock
        assert sock is not None
        if self.broken and self._closed_by is not None:
            raise self._closed_by  # (e.g. the node's reason for closing it, read meanwhile)
        request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        ahead_s = sum(p.hold_s for p in self._pending.values())
        pending = self._pending[request_id] = _Pending(op, future, keys, sink, hold_s)
        data_len = sum(len(memoryview(b).cast("B")) for b in data)
        sent = False
        silence_s = self.deadlines.request_silence_s(ahead_s)
        overall_s = self.deadlines.request_overall_s(silence_s, data_len + expect_bytes)
        watch: SilenceWatch | None = None
        try:
            async with asyncio.timeout(overall_s) as deadline:
                watch = SilenceWatch(loop, sock, silence_s, deadline)
                try:
                    await sock.send([encode_header(op, request_id, meta, data_len), meta, *data])
                    sent = True
                    return await future
                finally:
                    watch.cancel()
        except BaseException as exc:
            if future.done() and not future.cancelled() and future.exception() is None:
                _drop(pending, future.result())  # answered too late
            if not isinstance(exc, TimeoutError):
                raise
            if watch is not None and watch.silent:
                why = f"moved no byte for {silence_s * 1000:.0f} ms"
            else:
                why = f"did not finish within {overall_s * 1000:.0f} ms"
            # The stream's state is unknown (maybe mid-frame): never reuse it.
            self.close(NodeUnavailable(f"node {self.node.node_id} timed out: the connection {why}"))
            raise NodeUnavailable(
                f"node {self.node.node_id} ({self.node.address}) timed out: the connection {why}"
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
                if header.request_id == 0 and header.status != Status.OK:
                    # Request id 0 is the connection's: the node's reason for closing it (shed, deadline).
                    self._told = True
                    raise error_for_status(header.status, bytes(meta).decode("utf-8", "replace"))
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
                    _drop(pending, result)
                else:
                    pending.future.set_result(result)
        except asyncio.CancelledError:
            pass
        except (KVPoolError, OSError) as exc:
            error = exc if isinstance(exc, KVPoolError) else NodeUnavailable(str(exc) or type(exc).__name__)
            if isinstance(error, NodeUnavailable) and not self._ready and not self._told:
                error = NodeUnavailable(
                    f"node {self.node.node_id} ({self.node.address}) ended the connection during the handshake "
                    f"without a reason: {error} (a node closes connections that have not finished their handshake "
                    "when a connection flood passes its --max-pending-connections, and all of them when it stops)"
                )
            self.close(error)
        except BaseException as exc:  # a sink bug must not leave waiters hanging
            self.close(NodeUnavailable(f"reader failed: {exc!r}"))
            raise

    async def _receive_get(self, sock: FrameSocket, data_len: int, meta: bytearray, pending: _Pending) -> list[Outcome]:
        """Take a buffer per found chunk from the sink, then receive and verify them all in one transfer.

        The request carried the sink's layout fingerprint (``GetBatch.encode_request``): a chunk of another
        layout is answered OtherLayout, and one the node sent anyway is received and dropped as one."""
        found = GetBatch.decode_answer(meta, pending.keys, data_len)
        sink = pending.sink
        assert sink is not None
        wanted = sink_fingerprint(sink)
        outcomes: list[Outcome] = []
        targets: list[Buffer | int] = []  # per found chunk: its buffer, or its size when it is dropped
        received: list[tuple[int, ItemMeta]] = []  # (index in outcomes, item) per buffer received
        try:
            for item in found:
                if item is None:
                    outcomes.append(MISS)
                    continue
                if isinstance(item, OtherLayout):
                    outcomes.append(item)
                    continue
                if layout_differs(wanted, item):
                    outcomes.append(OtherLayout(item.key))
                    targets.append(item.nbytes)
                    continue
                allocated = await allocate_view(sink, item)
                if allocated is None:
                    outcomes.append(DECLINED)
                    targets.append(item.nbytes)
                    continue
                handle, view = allocated
                outcomes.append(Hit(handle, item.checksum))
                targets.append(view)
                received.append((len(outcomes) - 1, item))
            digests = await sock.recv_many(targets, checksum)
        except BaseException:
            release_hits(sink, outcomes)
            raise
        digests = [d for t, d in zip(targets, digests) if not isinstance(t, int)]
        for (index, item), digest in zip(received, digests):
            if digest != item.checksum:
                release_hits(sink, [outcomes[index]])
                outcomes[index] = Failed(IntegrityError(f"checksum mismatch for {item.key!r}"))
        return outcomes


def check_tls_agrees(node: NodeInfo, tls: bool) -> None:
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


class NodeWatch(Protocol):
    """Told how each request to a node went (``backend.client.health.NodeHealth``)."""

    def failed(self, node: NodeInfo, error: BaseException) -> None: ...

    def answered(self, node: NodeInfo) -> None: ...


class NodeConnectionSet:
    """Up to ``connections_per_node`` connections to one node, least-loaded first."""

    def __init__(
        self,
        node: NodeInfo,
        config: PoolConfig,
        tls: ssl.SSLContext | None = None,
        bulk: Executor | None = None,
        watch: NodeWatch | None = None,
    ) -> None:
        self.node = node
        self.config = config
        self.tls = tls
        self.bulk = bulk
        self.watch = watch
        self.connections: list[NodeConnection] = []
        self.tenant: str | None = None  # once a connection was bound to a tenant (NodeConnection.tenant)

    async def request(self, op: int, meta: bytes, **kwargs: Any) -> Any:
        self.connections = [c for c in self.connections if not c.broken]
        if len(self.connections) < self.config.connections_per_node:
            conn = NodeConnection(self.node, self.config, self.tls, self.bulk)
            self.connections.append(conn)
        else:
            conn = min(self.connections, key=lambda c: c.load)
        try:
            await conn.ensure_open()
            self.tenant = self.tenant or conn.tenant
            result = await conn.request(op, meta, **kwargs)
        except BaseException as exc:
            if not conn._ready and conn in self.connections:
                self.connections.remove(conn)
            if self.watch is not None:
                self.watch.failed(self.node, exc)
            raise
        if self.watch is not None:
            self.watch.answered(self.node)
        return result

    async def open_all(self) -> list[NodeConnection]:
        """Open now every connection this set may have (``connections_per_node``), which the first
        requests would otherwise open one by one, each paying a connect and handshake."""
        self.connections = [c for c in self.connections if not c.broken]
        while len(self.connections) < self.config.connections_per_node:
            self.connections.append(NodeConnection(self.node, self.config, self.tls, self.bulk))
        for conn in list(self.connections):
            try:
                await conn.ensure_open()
            except BaseException:
                self.connections.remove(conn)
                raise
            self.tenant = self.tenant or conn.tenant
        return list(self.connections)

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.connections = []


def frame_data_budget() -> int:
    # Never ask a node for a response larger than this side accepts.
    return min(MAX_FRAME_DATA_BYTES, DEFAULT_LIMITS.max_data_bytes)


def frames(items: Sequence[T]) -> list[list[T]]:
    """Split items (ItemMeta or Wanted) into frames within the size and count limits."""
    out: list[list[T]] = [[]]
    size = 0
    for item in items:
        nbytes = item.nbytes  # type: ignore[attr-defined]
        if out[-1] and (size + nbytes > frame_data_budget() or len(out[-1]) >= MAX_FRAME_ITEMS):
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


class Connections:
    """One :class:`NodeConnectionSet` per live node (by id and epoch), closed when the node leaves the registry."""

    def __init__(self, config: PoolConfig, tls: ssl.SSLContext | None, bulk: Callable[[], Executor]) -> None:
        self.config = config
        self.tls = tls
        self._bulk = bulk
        self.watch: NodeWatch | None = None  # given to every set made from now on
        self._sets: dict[tuple[str, int], NodeConnectionSet] = {}

    def to(self, node: NodeInfo) -> NodeConnectionSet:
        """The connections to ``node``, made the first time it is named."""
        ident = (node.node_id, node.epoch)
        conns = self._sets.get(ident)
        if conns is None:
            conns = self._sets[ident] = NodeConnectionSet(node, self.config, self.tls, self._bulk(), self.watch)
        return conns

    async def probe(self, node: NodeInfo) -> None:
        """Whether ``node`` answers: connect (``Deadlines.connect_s``), HELLO and PING (each
        ``Deadlines.progress_s``) on a connection of its own; raises NodeUnavailable (or another KVPoolError) if not."""
        conn = NodeConnection(node, self.config, self.tls)
        try:
            await conn.ensure_open()
            await conn.request(Op.PING, Ping.encode_request())
        finally:
            conn.close()

    def drop(self, node: NodeInfo) -> None:
        """Close every connection to ``node`` (it stopped answering): requests waiting on them fail now."""
        conns = self._sets.get((node.node_id, node.epoch))
        if conns is not None:
            conns.close()

    def sets(self) -> list[NodeConnectionSet]:
        return list(self._sets.values())

    def prune(self, live: set[tuple[str, int]]) -> None:
        """Close the connections of nodes that left or restarted."""
        for ident in [i for i in self._sets if i not in live]:
            self._sets.pop(ident).close()

    def forget(self) -> None:
        """After a fork: the sockets belong to the parent, never use (or close) them here."""
        self._sets = {}

    def close(self) -> None:
        for conns in self._sets.values():
            conns.close()
        self._sets = {}
