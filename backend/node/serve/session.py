"""Client connections to a node: the accept loop, and one session per connection.

A session sniffs TLS (a node with a certificate serves TLS only, and tells a
plaintext kvpool client so in a plaintext error frame), runs the mutual handshake
(``backend.handshake``: HELLO and its answer carry both sides' nonces and the node's
proof of the token, AUTH the client's), then runs the frame loop:
requests are received in stream order, each handed to its op's handler in the op
table (``ops.py``), which sees the connection as a ``Peer`` (``peer.py``) and is
answered while the next one is received, up to 32 in flight. Once a header has
arrived the rest of its frame must follow within ``frame_timeout_s``; a reply the
client does not read within ``REPLY_TIMEOUT_S`` closes the connection. A malformed
frame is answered with an error frame and closes this connection only.

Until it is admitted (``admission.py``: AUTH done, or on a node without a token its
first complete frame) a connection must finish within ``handshake_timeout_s`` of
its accept, TLS included, its frames carry at most ``max_handshake_meta_bytes`` of
meta, and it counts against the node's cap on pending connections.

What a connection holds ends with it: its leases (nobody is left to release them),
and the client stages it mapped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from backend.counters import NodeCounter
from backend.errors import AuthError, KVPoolError, NodeUnavailable, ProtocolError
from backend.handshake import NodeHello
from backend.node.context import NodeContext
from backend.node.serve.admission import Admission
from backend.node.serve.ops import OpTable
from backend.node.serve.peer import Answer, Reply, Request, host_of
from backend.node.stats import NodeStats
from backend.protocol import Op
from backend.protocol.frame import MAGIC, RESPONSE_BIT, Header, encode_header, status_for_error
from backend.protocol.meta import decode_json, encode_json
from backend.shm import STAGE_NAME_RE, ArenaView
from backend.transport import Buffer, FrameSocket

__all__ = ["Acceptor", "Served", "Session"]

logger = logging.getLogger(__name__)

MAX_REQUESTS_IN_FLIGHT_PER_CONNECTION = 32
REPLY_TIMEOUT_S = 30.0  # a reply the client does not read in this time closes the connection
ACCEPT_RETRY_S = 0.1


@dataclasses.dataclass(frozen=True)
class Served:
    """The parts a session hands its connection and its requests to."""

    admission: Admission  # what the connection gets until its handshake is done
    stats: NodeStats  # each answered request's service time
    ops: OpTable  # each request's handler, by op
    tls: ssl.SSLContext | None = None  # the node serves TLS only when set


class Acceptor:
    """The node's door: accepts connections, serves each in a :class:`Session`, and closes them all at stop."""

    def __init__(self, ctx: NodeContext, admission: Admission, stats: NodeStats, ops: OpTable) -> None:
        self.ctx = ctx
        self.admission = admission
        self.stats = stats
        self.ops = ops
        self.connections: set[FrameSocket] = set()

    async def accept_loop(self, listener: socket.socket, tls: ssl.SSLContext | None) -> None:
        """Accept connections on ``listener`` until cancelled; a session task per connection."""
        ctx = self.ctx
        served = Served(self.admission, self.stats, self.ops, tls)
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    sock, address = await loop.sock_accept(listener)
                except OSError as exc:  # EMFILE, ECONNABORTED, ...: keep accepting
                    ctx.counters[NodeCounter.ACCEPT_ERRORS] += 1
                    logger.warning("node %s: accept failed: %s", ctx.node_id, exc)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                    continue
                ctx.counters[NodeCounter.CONNECTIONS_ACCEPTED] += 1
                conn = FrameSocket(sock, loop, f"{address[0]}:{address[1]}", ctx.bulk)
                ctx.spawn(self._serve(Session(ctx, served, conn)))
        except asyncio.CancelledError:
            raise
        except BaseException:
            # A node that cannot accept must not stay registered as alive.
            logger.exception("node %s: accept loop failed; stopping", ctx.node_id)
            ctx.request_stop()
            raise

    async def _serve(self, session: Session) -> None:
        self.connections.add(session.conn)
        try:
            await session.serve()
        finally:
            self.connections.discard(session.conn)

    def close(self) -> None:
        """Close every open connection (the node is stopping)."""
        for conn in list(self.connections):
            conn.close()


class Session:
    """One client connection: TLS, authentication, the frame loop, and what the connection holds.

    It is the ``Peer`` its requests' handlers see (``peer.py``), and the owner of the leases they take.
    """

    def __init__(self, ctx: NodeContext, served: Served, conn: FrameSocket) -> None:
        self.ctx = ctx
        self.served = served
        self.conn = conn
        self.stages: dict[tuple[str, str], ArenaView] = {}  # its client's stages: mapped for this connection only
        self._authed = not ctx.keys
        self._admitted = False  # past the handshake: no deadline, full limits (admission.py)
        self._hello = NodeHello(ctx.keys, ctx.node_id, ctx.address)
        self._in_flight = asyncio.Semaphore(MAX_REQUESTS_IN_FLIGHT_PER_CONNECTION)

    async def serve(self) -> None:
        ctx, conn, config, admission = self.ctx, self.conn, self.ctx.config, self.served.admission
        admission.arrived(conn, ctx.node_id)
        handshake_timeout_s = config.handshake_timeout_s
        header: Header | None = None
        # Lifted (rescheduled to never) once the connection is admitted.
        deadline = asyncio.timeout(handshake_timeout_s)
        try:
            async with deadline:
                tls = self.served.tls
                if tls is not None and not await self._start_tls(tls):
                    return
                while True:
                    header = None  # an error before the header parses answers request id 0
                    header = await conn.recv_header(config.limits)
                    await self._receive_request(header, deadline)
        except asyncio.CancelledError:
            raise
        except NodeUnavailable:
            pass  # the client went away (or the node shed this connection: admission.py)
        except TimeoutError:
            if deadline.expired():
                admission.timed_out(conn, ctx.node_id, handshake_timeout_s)
            else:
                ctx.counters[NodeCounter.STALLED_CONNECTIONS] += 1
                logger.warning(
                    "node %s: %s stalled mid-frame for %.0f s; closing", ctx.node_id, conn.peer, config.frame_timeout_s
                )
        except KVPoolError as exc:
            if isinstance(exc, ProtocolError):
                ctx.counters[NodeCounter.PROTOCOL_ERRORS] += 1
            elif not isinstance(exc, AuthError):  # refused tokens are counted once, as auth_failures
                ctx.counters[NodeCounter.CONNECTION_ERRORS] += 1
            logger.warning("node %s: closing connection from %s: %s", ctx.node_id, conn.peer, exc)
            with contextlib.suppress(KVPoolError, OSError):
                async with asyncio.timeout(1.0):
                    await self._reply_error(header, exc)
        except OSError as exc:
            logger.info("node %s: connection from %s failed: %s", ctx.node_id, conn.peer, exc)
        finally:
            conn.close()
            admission.admitted(conn)  # (if it never was, it is gone now: no longer pending)
            # Its client is gone (crashed, or gave up on the connection): nobody will release
            # what it leased, and pinned DRAM would refuse puts until the ttl ran out.
            ctx.tiers.leasing.end_all_of(self)
            self.stages.clear()

    async def _receive_request(self, header: Header, deadline: asyncio.Timeout) -> None:
        """Receive the rest of the frame ``header`` starts and answer it, or run its handler."""
        ctx, conn, config, ops = self.ctx, self.conn, self.ctx.config, self.served.ops
        started = time.perf_counter()
        handshake_limit = config.limits.max_handshake_meta_bytes
        if header.meta_len > handshake_limit and (not self._admitted or header.base_op in (Op.HELLO, Op.AUTH)):
            # Refused from the header: a peer that has proven nothing does not get 4 MiB held for it.
            raise ProtocolError(
                f"meta section of {header.meta_len} bytes exceeds {handshake_limit}, the most a HELLO or AUTH "
                "(or any frame before the handshake is done) may carry"
            )
        async with asyncio.timeout(config.frame_timeout_s):
            meta = await conn.recv_meta(header)
        if header.is_response:
            raise ProtocolError(f"client sent a response frame (op {header.op})")
        op = header.base_op
        if header.data_len and not ops.carries_data(op):
            raise ProtocolError(f"op {op} carries no data, got {header.data_len} bytes")
        if op in (Op.HELLO, Op.AUTH):
            await self._reply(header, self._handshake(op, meta))
            self._admit_once_authed(deadline)
            return
        if not self._authed:
            ctx.counters[NodeCounter.AUTH_FAILURES] += 1
            raise AuthError("this node requires a token: send HELLO and AUTH first")
        self._admit_once_authed(deadline)
        await ops.handle(Request(header, meta, started), self)

    def _admit_once_authed(self, deadline: asyncio.Timeout) -> None:
        """Once authenticated (at once on a node without a token): no deadline, no place among the pending."""
        if self._authed and not self._admitted:
            self._admitted = True
            deadline.reschedule(None)
            self.served.admission.admitted(self.conn)

    def _handshake(self, op: int, meta: bytearray) -> bytes:
        """HELLO: this node and a fresh nonce. AUTH: the client's proof checked, answered with this node's
        proof; AuthError if it is wrong."""
        try:
            if op == Op.HELLO:
                return encode_json(self._hello.answer(decode_json(meta), self.ctx.epoch))
            if not self.ctx.keys:
                return encode_json({"ok": True})
            answer = self._hello.check(decode_json(meta))
            self._authed = True
            return encode_json(answer)
        except AuthError:
            self.ctx.counters[NodeCounter.AUTH_FAILURES] += 1
            raise

    async def _start_tls(self, context: ssl.SSLContext) -> bool:
        """Complete a TLS handshake; False (counted, logged) if it fails. The handshake deadline bounds it.

        A plaintext kvpool client is told, in a plaintext error frame, that this node serves TLS only.
        """
        ctx, conn = self.ctx, self.conn
        header: Header | None = None
        try:
            if await conn.peek_byte() != MAGIC[0]:
                await conn.start_tls(context)
                return True
            header = await conn.recv_header(ctx.config.limits)
            raise ProtocolError("this node serves TLS only: add tls=on (and tls_ca=PATH) to the pool URL")
        except KVPoolError as exc:
            if conn.closed:
                return False  # closed by this node (shed, or stopping): no failure of the peer's
            ctx.counters[NodeCounter.TLS_FAILURES] += 1
            logger.warning("node %s: TLS from %s failed: %s", ctx.node_id, conn.peer, exc)
            if header is not None:
                with contextlib.suppress(KVPoolError, OSError):
                    async with asyncio.timeout(1.0):
                        await self._reply_error(header, exc)
            return False

    # -- what its requests' handlers may touch (Peer) ----------------------------------------
    @property
    def host(self) -> str:
        return host_of(self.conn.peer)

    @property
    def closed(self) -> bool:
        return self.conn.closed

    @property
    def tenant(self) -> str | None:
        return self._hello.tenant

    async def recv_data(self, targets: Sequence[Buffer | int], digest: Callable[[Any], int] | None = None) -> list[int]:
        return await self.conn.recv_many(targets, digest)

    async def answer(self, request: Request, work: Answer) -> None:
        """Answer ``request`` with ``work``'s reply beside the next requests, once fewer than 32 are in flight."""
        await self._in_flight.acquire()
        self.ctx.spawn(self._finish(request, work()))

    def stage(self, name: str, token: str) -> ArenaView:
        """The client's stage named in a PUT_STAGED, mapped read-only once per connection.

        Only a file in this node's arena directory, with a stage's name, of this node's
        user, whose header carries ``token``: no client can make the node read any other file.
        """
        arena = self.ctx.tiers.shm_arena
        if arena is None:
            raise ProtocolError(f"node {self.ctx.node_id} has no shared-memory arena: put over TCP")
        if not STAGE_NAME_RE.match(name):
            raise ProtocolError(f"{name!r} is not a kvpool stage name")
        view = self.stages.get((name, token))
        if view is None:
            try:
                view = ArenaView(str(arena.path.parent / name), token, owned=True)
            except (OSError, ValueError) as exc:
                raise ProtocolError(f"stage {name} cannot be used: {exc}") from None
            self.stages[(name, token)] = view
        return view

    async def _finish(self, request: Request, work: Awaitable[Reply]) -> None:
        ctx, conn, header = self.ctx, self.conn, request.header
        try:
            try:
                meta, data = await work
            except Exception as exc:
                ctx.counters[NodeCounter.REQUEST_ERRORS] += 1
                if not isinstance(exc, KVPoolError):
                    logger.exception("node %s: internal error serving op %d", ctx.node_id, header.base_op)
                await self._reply_error(header, exc)
                if isinstance(exc, ProtocolError):
                    # A malformed request: this peer's stream can't be trusted any more.
                    ctx.counters[NodeCounter.PROTOCOL_ERRORS] += 1
                    logger.warning("node %s: closing connection from %s: %s", ctx.node_id, conn.peer, exc)
                    conn.close()
                return
            await self._reply(header, meta, data)
            self.served.stats.served(Op(header.base_op).name.lower(), request.started)
        except (NodeUnavailable, OSError):
            conn.close()
        finally:
            self._in_flight.release()

    async def _reply(self, header: Header, meta: bytes, data: list[Buffer] | None = None) -> None:
        data = data or []
        data_len = sum(len(b) for b in data)
        head = encode_header(header.base_op | RESPONSE_BIT, header.request_id, meta, data_len)
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                await self.conn.send([head, meta, *data])
        except TimeoutError:
            self.conn.close()  # the client stopped reading: do not pin buffers for it
            raise NodeUnavailable(f"{self.conn.peer} did not read its reply in {REPLY_TIMEOUT_S:.0f} s") from None

    async def _reply_error(self, header: Header | None, exc: BaseException) -> None:
        message = str(exc).encode("utf-8", "replace")[:4096]
        op = (header.base_op if header is not None else Op.PING) | RESPONSE_BIT
        request_id = header.request_id if header is not None else 0
        await self.conn.send([encode_header(op, request_id, message, 0, status_for_error(exc)), message])
