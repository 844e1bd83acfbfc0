"""The pool node: an asyncio TCP server in front of its DRAM tier.

Put path (crash ordering): receive every byte into space reserved in the tier ->
verify each chunk's checksum -> insert into the tier -> commit the index entries to
Redis in one pipeline -> ack. A key becomes visible only at the commit, after its
bytes are complete; a put that fails anywhere before the commit leaves nothing
behind. If the commit itself fails the chunks are dropped again and the client is
told, so nothing is acknowledged that readers cannot find.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import logging
import os
import secrets
import signal
import socket
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from backend.errors import (
    AuthError,
    CapacityError,
    ConfigError,
    KVPoolError,
    MetadataError,
    NcclError,
    NodeUnavailable,
    ProtocolError,
)
from backend.latency import LatencyHistograms
from backend.metadata import Beat, Location, MetadataStore, NodeInfo
from backend.metrics import NodeMetricsServer
from backend.node.buffers import ChunkBuffer
from backend.node.collector import DEFAULT_GRACE_S, DeadNodeCollector
from backend.node.dram import StoredChunk
from backend.node.leases import MAX_LEASE_TTL_MS
from backend.node.recovery import RecoveryReport, node_identity, scan
from backend.node.tiers import DRAM, PUT_RESERVE_WAIT_S, TierConfig, TierManager
from backend.protocol import (
    DEFAULT_LIMITS,
    LEASE_MAP,
    MAGIC,
    NO_OFFSET,
    PUT_INTEGRITY,
    PUT_NO_CAPACITY,
    PUT_STORED,
    RESPONSE_BIT,
    Header,
    ItemMeta,
    Limits,
    Op,
    auth_mac,
    checksum,
    decode_channel_request,
    decode_items,
    decode_json,
    decode_keys,
    decode_lease_request,
    decode_put_staged,
    decode_release,
    encode_channel_response,
    encode_flags,
    encode_get_response,
    encode_header,
    encode_json,
    encode_lease_response,
    status_for_error,
)
from backend.shm import STAGE_NAME_RE, ArenaView
from backend.threads import map_in_threads
from backend.transport import BULK_BYTES, Buffer, FrameSocket, server_tls_context

__all__ = ["NodeConfig", "PoolNode", "run_node"]

logger = logging.getLogger(__name__)

MAX_REQUESTS_IN_FLIGHT_PER_CONNECTION = 32
RECENT_WINDOW_S = 300  # "recent" rates in STAT cover the last five minutes
RECENT_SNAPSHOTS = 400
INVENTORY_PAGE_MAX = 10_000
VERIFY_STATUS = {"ok": 0, "missing": 1, "corrupt": 2}
REPLY_TIMEOUT_S = 30.0  # a reply the client does not read in this time closes the connection
ACCEPT_RETRY_S = 0.1
SHUTDOWN_TIMEOUT_S = 5.0
# Threads that move large replies and puts (``backend.transport``): with one per busy
# connection, two clients' GETs are sent by both cores instead of the event loop's one.
BULK_THREADS = 4
BULK_COPY_THREADS = 2  # threads one staged put copies on (two cores' worth)
PUT_WINDOW_BYTES = 64 * 1024 * 1024  # a put's chunks are received this many bytes at a time


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Everything a node needs to run; built by the CLI or by tests."""

    redis_url: str
    namespace: str
    dram_bytes: int
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    advertise_port: int = 0  # 0: the port listened on; else a forwarder's (NAT, container, proxy)
    node_id: str = ""
    token: str = dataclasses.field(default="", repr=False)
    cluster: str = ""
    heartbeat_interval_ms: int = 1000
    heartbeat_ttl_ms: int = 5000
    redis_timeout_ms: int = 2000
    limits: Limits = DEFAULT_LIMITS
    nvme_dir: Path | None = None
    nvme_bytes: int = 0
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    frame_timeout_s: float = 30.0  # once a header arrived, the rest of its frame must follow
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    shm_dir: Path | None = None  # shared-memory arena for same-host clients; None: off
    channel: str = "off"  # serve CHANNEL_GET over this transport: "off", "cpu" or "nccl" (nccl_channel)
    device: str = "cuda:0"  # the CUDA device of the NCCL channel
    tls_cert: Path | None = None  # PEM certificate chain: serve the node protocol over TLS only
    tls_key: Path | None = None  # its private key (PEM)
    redis_password: str = dataclasses.field(default="", repr=False)  # Redis ACL password, if not in redis_url
    redis_ca_file: str = ""  # CA bundle verifying a rediss:// Redis; empty: the system trust store
    dead_node_grace_ms: int = int(DEFAULT_GRACE_S * 1000)  # a dead node's Redis entries go after this long
    pair_timeout_ms: int = 60_000  # deadline of one channel pairing (a cold NCCL init takes seconds)

    def tier_config(self) -> TierConfig:
        return TierConfig(
            dram_bytes=self.dram_bytes, nvme_dir=self.nvme_dir, nvme_bytes=self.nvme_bytes,
            high_watermark=self.high_watermark, low_watermark=self.low_watermark, shm_dir=self.shm_dir,
        )  # fmt: skip


class PoolNode:
    """One node: accepts client connections, stores chunks, keeps Redis in step."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.tiers = TierManager(config.tier_config())
        self.recovery: RecoveryReport | None = None
        self.meta = MetadataStore(
            config.redis_url, config.namespace, config.redis_timeout_ms / 1000,
            password=config.redis_password, ca_file=config.redis_ca_file,
        )  # fmt: skip
        self._tls: ssl.SSLContext | None = None
        self.counters: Counter[str] = Counter()
        self.epoch = 0
        self.node_id = config.node_id
        self.started_at = time.time()
        self._started_monotonic = time.monotonic()
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._connections: set[FrameSocket] = set()
        self._redis_ok = True
        self._generation = ""  # the namespace marker this node last published under
        self._published_view: tuple[Any, ...] = ()  # what clients keep of this node, as last published
        self.metrics: NodeMetricsServer | None = None
        self._snapshots: collections.deque[tuple[float, int, int, int]] = collections.deque(maxlen=RECENT_SNAPSHOTS)
        self._snapshots.append((time.monotonic(), 0, 0, 0))  # the window of a young node starts at zero
        self.latency = LatencyHistograms()  # service time per op, for STAT and /metrics
        self._stopping = asyncio.Event()
        self._bulk = ThreadPoolExecutor(BULK_THREADS, thread_name_prefix="kvpool-node-bulk")
        self._stages: dict[FrameSocket, dict[tuple[str, str], ArenaView]] = {}  # per connection: its client's stages
        self.channel: Any = None  # nccl_channel.channel.ChannelServer once started, if configured
        self.collector: DeadNodeCollector | None = None  # made once the node id is known

    # -- lifecycle --------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.getsockname()[1])

    @property
    def advertise_host(self) -> str:
        if self.config.advertise_host:
            return self.config.advertise_host
        if self.config.host in ("", "0.0.0.0", "::"):
            return socket.gethostname()
        return self.config.host

    @property
    def advertise_port(self) -> int:
        return self.config.advertise_port or self.port

    async def start(self) -> None:
        """Bind, take an epoch, register. Raises MetadataError if Redis is unreachable."""
        transport = self._channel_transport()  # a ConfigError here leaves no port bound
        self._tls = self._tls_context()
        listener = socket.create_server((self.config.host, self.config.port), backlog=512, reuse_port=False)
        listener.setblocking(False)
        self._listener = listener
        if self.tiers.nvme is not None:
            root = self.tiers.nvme.root
            self.node_id = await asyncio.to_thread(node_identity, root, self.node_id)
            records, report = await asyncio.to_thread(scan, root)
            self.recovery = report
            self.tiers.load_nvme(records)
            logger.info("node %s: recovered %d NVMe chunks (%d bytes) in %.2f s; %d quarantined, %d temp files removed",
                        self.node_id, report.files, report.bytes, report.seconds,
                        report.quarantined, report.temp_removed)  # fmt: skip
        if not self.node_id:
            self.node_id = f"{socket.gethostname()}-{self.port}"
        self.collector = DeadNodeCollector(self.meta, self.node_id, self.config.dead_node_grace_ms / 1000)
        # Bind the metrics port before registering: if it is taken, nothing is left in Redis.
        if self.config.metrics_port is not None:
            self.metrics = NodeMetricsServer(
                self.stats, self.health, self.config.metrics_host, self.config.metrics_port
            )
            await self.metrics.start()
            logger.info("node %s: metrics at http://%s:%d/metrics", self.node_id, self.config.metrics_host,
                        self.metrics.port)  # fmt: skip
        self._start_channel(transport)
        self._generation = await self.meta.ensure_marker()
        self.epoch = await self.meta.new_epoch()
        if self.recovery is not None and self.recovery.files:
            await self._publish_inventory()  # the old epoch's entries are overwritten
        await self._heartbeat()
        self.tiers.start()
        self._spawn(self._accept_loop())
        self._spawn(self._heartbeat_loop())
        nvme = self.tiers.nvme
        logger.info(
            "node %s epoch %d listening on %s:%d, advertised as %s:%d (DRAM %d bytes, NVMe %s, namespace %s)",
            self.node_id, self.epoch, self.config.host, self.port, self.advertise_host, self.advertise_port,
            self.tiers.dram.capacity_bytes,
            f"{nvme.capacity_bytes} bytes at {nvme.root}" if nvme else "off", self.config.namespace,
        )  # fmt: skip

    def _tls_context(self) -> ssl.SSLContext | None:
        cert, key = self.config.tls_cert, self.config.tls_key
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise ConfigError("--tls-cert", "TLS needs both --tls-cert and --tls-key")
        return server_tls_context(str(cert), str(key))

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        """Stop serving, withdraw this node's index entries, deregister. Bounded in time."""
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._connections):
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
                await self.meta.remove(self.node_id, self.epoch, sorted(self.tiers.keys()))
                await self.meta.deregister(self.node_id)
        except (KVPoolError, TimeoutError) as exc:
            logger.warning("node %s: could not deregister cleanly: %s", self.node_id, exc)
        if self.metrics is not None:
            await self.metrics.stop()
        if self.channel is not None:
            await self.channel.close()
        await self.tiers.close()
        await self.meta.close()
        self._bulk.shutdown(wait=False)
        logger.info("node %s stopped", self.node_id)

    def info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            host=self.advertise_host,
            port=self.advertise_port,
            epoch=self.epoch,
            cluster=self.config.cluster,
            channel=self.channel.kind if self.channel is not None else "",
            tls=self._tls is not None,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            capacity_bytes=self.tiers.capacity_bytes,
            used_bytes=self.tiers.used_bytes,
            object_count=len(self.tiers),
            tiers=self.tiers.stats(),
            heartbeat_at=time.time(),
            shm_path=str(self.tiers.arena.path) if self.tiers.arena is not None else "",
            shm_token=self.tiers.arena.token if self.tiers.arena is not None else "",
        )

    def stats(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "epoch": self.epoch,
            "uptime_s": round(time.monotonic() - self._started_monotonic, 3),
            "counters": dict(self.counters + self.tiers.counters + self.tiers.leases.counters + self._other_counters()),
            "objects": len(self.tiers),
            "leases": len(self.tiers.leases),
            "arena": self.tiers.arena.stats() if self.tiers.arena is not None else None,
            "tiers": self.tiers.stats(),
            "recovery": dataclasses.asdict(self.recovery) if self.recovery else None,
            "latency": self.latency.to_json(),
            "recent": self._recent(),
        }

    def _snapshot(self) -> tuple[float, int, int, int]:
        c = self.counters
        return (time.monotonic(), c["requests"], c["gets"], c["hits"])

    def _recent(self) -> dict[str, Any]:
        """Requests, gets and hits over the last ``RECENT_WINDOW_S`` (or since start)."""
        now = self._snapshot()
        old = next((s for s in self._snapshots if now[0] - s[0] <= RECENT_WINDOW_S), self._snapshots[-1])
        window = max(now[0] - old[0], 1e-3)
        return {"window_s": round(window, 1), "requests_per_s": round((now[1] - old[1]) / window, 3),
                "gets": now[2] - old[2], "hits": now[3] - old[3]}  # fmt: skip

    def _inventory(self, request: dict[str, Any]) -> bytes:
        """One page of ``[key, tier, nbytes, checksum]`` after ``request["after"]``, sorted by key."""
        after, limit = request.get("after", ""), request.get("limit", 1000)
        if not isinstance(after, str) or not isinstance(limit, int) or not 0 < limit <= INVENTORY_PAGE_MAX:
            raise ProtocolError(f"INVENTORY wants {{after: str, limit: 1..{INVENTORY_PAGE_MAX}}}")
        page, more = _inventory_page(self.tiers, after, limit)
        return encode_json({"items": page, "more": more})

    def health(self) -> dict[str, Any]:
        """What ``/health`` answers: ok while serving with Redis reachable."""
        serving = self._listener is not None and not self._stopping.is_set()
        healthy = serving and self._redis_ok
        return {"status": "ok" if healthy else "degraded", "node_id": self.node_id, "epoch": self.epoch,
                "serving": serving, "redis_reachable": self._redis_ok,
                "nvme_disk_full": self.tiers.disk_full}  # fmt: skip

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- background -------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_ms / 1000
        while not self._stopping.is_set():
            await asyncio.sleep(interval)
            self.tiers.leases.expire()
            self._snapshots.append(self._snapshot())
            try:
                beat = await self._heartbeat()
                if beat.generation != self._generation:
                    await self._republish("the namespace was missing in Redis")
                elif beat.registered_anew:
                    await self._republish("this node's registry entry was gone (collected as dead while away)")
                await self._flush_index()
                if self.collector is not None:
                    await self.collector.step()
                if not self._redis_ok:
                    logger.warning("node %s: Redis reachable again", self.node_id)
                    self._redis_ok = True
            except MetadataError as exc:
                if self._redis_ok:
                    logger.warning("node %s: Redis unreachable, serving what is held: %s", self.node_id, exc)
                    self._redis_ok = False

    async def _heartbeat(self) -> Beat:
        """One heartbeat; clients are told (registry version) when what they keep of this node changed."""
        info = self.info()
        view = info.view()
        beat = await self.meta.heartbeat(info, self.config.heartbeat_ttl_ms, changed=view != self._published_view)
        self._published_view = view
        return beat

    async def _republish(self, why: str) -> None:
        """Redis lost what we published (restart, flush, or we were collected as dead): publish it again.

        Every node does this once per new marker generation, whichever node
        recreated the marker first.
        """
        generation = await self.meta.ensure_marker()
        await self.meta.ensure_epoch_at_least(self.epoch)
        self._published_view = ()  # Redis lost the registry: clients re-read it all anyway
        await self._heartbeat()
        count = await self._publish_inventory()
        self._generation = generation
        logger.warning("node %s: %s; republished %d chunks", self.node_id, why, count)

    async def _publish_inventory(self) -> int:
        held = [(meta.key, self._location(meta, tier)) for meta, tier in self.tiers.inventory()]
        await self.meta.commit(held)
        self.counters["republished"] += len(held)
        return len(held)

    async def _flush_index(self) -> None:
        """Publish what the tiers did since the last flush: evictions, drops and tier moves."""
        removed, self.tiers.index_removed = self.tiers.index_removed, set()
        moved, self.tiers.index_moved = self.tiers.index_moved, {}
        gone = [key for key in removed if not self.tiers.contains(key)]
        moves = []
        for key in moved:
            meta, tier = self.tiers.meta_of(key), self.tiers.tier_of(key)
            if meta is not None and tier is not None:
                moves.append((key, self._location(meta, tier)))
        try:
            await self.meta.remove(self.node_id, self.epoch, gone)
            await self.meta.move(moves)
        except MetadataError:
            # Keep them for the next flush; an index entry that outlives its bytes reads as a miss.
            self.tiers.index_removed |= set(gone)
            self.tiers.index_moved.update({key: loc.tier for key, loc in moves})
            raise

    def _location(self, meta: ItemMeta, tier: str = DRAM) -> Location:
        return Location(self.node_id, self.epoch, tier, meta.nbytes, meta.checksum)

    # -- connections ------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    sock, address = await loop.sock_accept(self._listener)
                except OSError as exc:  # EMFILE, ECONNABORTED, ...: keep accepting
                    self.counters["accept_errors"] += 1
                    logger.warning("node %s: accept failed: %s", self.node_id, exc)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                    continue
                self.counters["connections_accepted"] += 1
                conn = FrameSocket(sock, loop, f"{address[0]}:{address[1]}", self._bulk)
                self._spawn(self._serve_connection(conn))
        except asyncio.CancelledError:
            raise
        except BaseException:
            # A node that cannot accept must not stay registered as alive.
            logger.exception("node %s: accept loop failed; stopping", self.node_id)
            self.request_stop()
            raise

    async def _serve_connection(self, conn: FrameSocket) -> None:
        self._connections.add(conn)
        authed = not self.config.token
        nonce = b""
        in_flight = asyncio.Semaphore(MAX_REQUESTS_IN_FLIGHT_PER_CONNECTION)
        header: Header | None = None
        try:
            if self._tls is not None and not await self._start_tls(conn, self._tls):
                return
            while True:
                header = None  # an error before the header parses answers request id 0
                header = await conn.recv_header(self.config.limits)
                started = time.perf_counter()
                async with asyncio.timeout(self.config.frame_timeout_s):
                    meta = await conn.recv_meta(header)
                if header.is_response:
                    raise ProtocolError(f"client sent a response frame (op {header.op})")
                op = header.base_op
                if op != Op.PUT_BATCH and header.data_len:
                    raise ProtocolError(f"op {op} carries no data, got {header.data_len} bytes")
                if op == Op.HELLO:
                    nonce = secrets.token_bytes(32)
                    body = {"node_id": self.node_id, "epoch": self.epoch, "auth_required": bool(self.config.token),
                            "nonce": nonce.hex()}  # fmt: skip
                    await self._reply(conn, header, encode_json(body))
                    continue
                if op == Op.AUTH:
                    authed = self._check_auth(decode_json(meta), nonce)
                    if not authed:
                        self.counters["auth_failures"] += 1
                        raise AuthError("wrong or missing token")
                    await self._reply(conn, header, encode_json({"ok": True}))
                    continue
                if not authed:
                    self.counters["auth_failures"] += 1
                    raise AuthError("this node requires a token: send HELLO and AUTH first")
                if op == Op.PUT_BATCH:
                    # Bytes must leave the socket in order, so the receive happens here;
                    # verification, commit and reply overlap with the next request.
                    items = decode_items(meta, header.data_len, self.config.limits)
                    async with asyncio.timeout(self.config.frame_timeout_s):
                        received = await self._receive_put(conn, items)
                    await in_flight.acquire()
                    self._spawn(self._finish(conn, header, in_flight, self._commit_put(received), started))
                    continue
                await in_flight.acquire()
                self._spawn(self._finish(conn, header, in_flight, self._handle(op, meta, conn), started))
        except asyncio.CancelledError:
            raise
        except NodeUnavailable:
            pass  # the client went away
        except TimeoutError:
            self.counters["stalled_connections"] += 1
            logger.warning("node %s: %s stalled mid-frame for %.0f s; closing", self.node_id, conn.peer,
                           self.config.frame_timeout_s)  # fmt: skip
        except KVPoolError as exc:
            if isinstance(exc, ProtocolError):
                self.counters["protocol_errors"] += 1
            elif not isinstance(exc, AuthError):  # refused tokens are counted once, as auth_failures
                self.counters["connection_errors"] += 1
            logger.warning("node %s: closing connection from %s: %s", self.node_id, conn.peer, exc)
            with contextlib.suppress(KVPoolError, OSError):
                async with asyncio.timeout(1.0):
                    await self._reply_error(conn, header, exc)
        except OSError as exc:
            logger.info("node %s: connection from %s failed: %s", self.node_id, conn.peer, exc)
        finally:
            conn.close()
            self._connections.discard(conn)
            # Its client is gone (crashed, or gave up on the connection): nobody will release
            # what it leased, and pinned DRAM would refuse puts until the ttl ran out.
            self.tiers.leases.release_owner(conn)
            self._stages.pop(conn, None)  # its client's stages: mapped for this connection only

    async def _start_tls(self, conn: FrameSocket, context: ssl.SSLContext) -> bool:
        """Complete a TLS handshake within the frame timeout; False (counted, logged) if it fails.

        A plaintext kvpool client is told, in a plaintext error frame, that this node serves TLS only.
        """
        header: Header | None = None
        try:
            async with asyncio.timeout(self.config.frame_timeout_s):
                if await conn.peek_byte() != MAGIC[0]:
                    await conn.start_tls(context)
                    return True
                header = await conn.recv_header(self.config.limits)
            raise ProtocolError("this node serves TLS only: add tls=on (and tls_ca=PATH) to the pool URL")
        except (KVPoolError, TimeoutError) as exc:
            self.counters["tls_failures"] += 1
            logger.warning("node %s: TLS from %s failed: %s", self.node_id, conn.peer, exc or "timed out")
            if header is not None:
                with contextlib.suppress(KVPoolError, OSError):
                    async with asyncio.timeout(1.0):
                        await self._reply_error(conn, header, exc)
            return False

    def _check_auth(self, body: dict[str, Any], nonce: bytes) -> bool:
        if not self.config.token:
            return True
        mac = body.get("mac")
        if not nonce or not isinstance(mac, str):
            return False
        # As bytes: compare_digest refuses str with non-ASCII characters (a TypeError, not a refusal).
        given = mac.encode("utf-8", "surrogatepass")
        return hmac.compare_digest(given, auth_mac(self.config.token, nonce).encode("ascii"))

    async def _finish(
        self, conn: FrameSocket, header: Header, in_flight: asyncio.Semaphore, work: Any, started: float
    ) -> None:
        try:
            try:
                meta, data = await work
            except Exception as exc:
                self.counters["request_errors"] += 1
                if not isinstance(exc, KVPoolError):
                    logger.exception("node %s: internal error serving op %d", self.node_id, header.base_op)
                await self._reply_error(conn, header, exc)
                if isinstance(exc, ProtocolError):
                    # A malformed request: this peer's stream can't be trusted any more.
                    self.counters["protocol_errors"] += 1
                    logger.warning("node %s: closing connection from %s: %s", self.node_id, conn.peer, exc)
                    conn.close()
                return
            await self._reply(conn, header, meta, data)
            self.counters["requests"] += 1
            self.latency.observe(Op(header.base_op).name.lower(), time.perf_counter() - started)
        except (NodeUnavailable, OSError):
            conn.close()
        finally:
            in_flight.release()

    async def _reply(self, conn: FrameSocket, header: Header, meta: bytes, data: list[Buffer] | None = None) -> None:
        data = data or []
        data_len = sum(len(b) for b in data)
        head = encode_header(header.base_op | RESPONSE_BIT, header.request_id, meta, data_len)
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                await conn.send([head, meta, *data])
        except TimeoutError:
            conn.close()  # the client stopped reading: do not pin buffers for it
            raise NodeUnavailable(f"{conn.peer} did not read its reply in {REPLY_TIMEOUT_S:.0f} s") from None

    async def _reply_error(self, conn: FrameSocket, header: Header | None, exc: BaseException) -> None:
        message = str(exc).encode("utf-8", "replace")[:4096]
        op = (header.base_op if header is not None else Op.PING) | RESPONSE_BIT
        request_id = header.request_id if header is not None else 0
        await conn.send([encode_header(op, request_id, message, 0, status_for_error(exc)), message])

    # -- requests ---------------------------------------------------------------------
    async def _receive_put(
        self, conn: FrameSocket, items: list[ItemMeta]
    ) -> list[tuple[int, ItemMeta, StoredChunk | None]]:
        """Receive a PUT_BATCH's chunks off the socket (see :meth:`_take_chunks`)."""

        async def fill(window: list[tuple[ItemMeta, ChunkBuffer]]) -> list[int]:
            return await conn.recv_many([buffer for _, buffer in window], checksum)

        return await self._take_chunks(items, fill, conn.discard)

    async def _receive_staged(
        self, meta: bytearray, conn: FrameSocket
    ) -> list[tuple[int, ItemMeta, StoredChunk | None]]:
        """Copy a PUT_STAGED's chunks out of the client's stage (see :meth:`_take_chunks`)."""
        name, token, items, offsets = decode_put_staged(meta, self.config.limits)
        stage = self._stage(conn, name, token)
        offset_of = {id(item): offset for item, offset in zip(items, offsets)}

        def copy(job: tuple[ItemMeta, ChunkBuffer]) -> int:
            item, buffer = job
            try:
                return stage.copy_checked(buffer, offset_of[id(item)])
            except ValueError as exc:
                raise ProtocolError(f"PUT_STAGED offset of {item.key!r}: {exc}") from None

        async def fill(window: list[tuple[ItemMeta, ChunkBuffer]]) -> list[int]:
            if sum(item.nbytes for item, _ in window) < BULK_BYTES:
                return [copy(job) for job in window]
            return await map_in_threads(self._bulk, BULK_COPY_THREADS, copy, window)

        async def drop(nbytes: int) -> None:
            pass  # nothing to read off a socket

        self.counters["staged_put_bytes"] += sum(item.nbytes for item in items)
        return await self._take_chunks(items, fill, drop)

    def _stage(self, conn: FrameSocket, name: str, token: str) -> ArenaView:
        """The client's stage named in a PUT_STAGED, mapped read-only once per connection.

        Only a file in this node's arena directory, with a stage's name, of this node's
        user, whose header carries ``token``: no client can make the node read any other file.
        """
        if self.tiers.arena is None:
            raise ProtocolError(f"node {self.node_id} has no shared-memory arena: put over TCP")
        if not STAGE_NAME_RE.match(name):
            raise ProtocolError(f"{name!r} is not a kvpool stage name")
        stages = self._stages.setdefault(conn, {})
        view = stages.get((name, token))
        if view is None:
            path = self.tiers.arena.path.parent / name
            try:
                view = ArenaView(str(path), token, owned=True)
            except (OSError, ValueError) as exc:
                raise ProtocolError(f"stage {name} cannot be used: {exc}") from None
            stages[(name, token)] = view
        return view

    async def _take_chunks(
        self,
        items: list[ItemMeta],
        fill: Callable[[list[tuple[ItemMeta, ChunkBuffer]]], Awaitable[list[int]]],
        drop: Callable[[int], Awaitable[None]],
    ) -> list[tuple[int, ItemMeta, StoredChunk | None]]:
        """Bring each chunk into reserved DRAM and verify it; returns a PUT outcome per item.

        Chunks come in windows of up to ``PUT_WINDOW_BYTES``: space for each is reserved
        first, then ``fill`` brings the window's bytes (from the socket in one transfer,
        or from a stage; on worker threads, checksums included) and answers each chunk's
        checksum. A verified chunk enters the tiers at once (so a batch larger than DRAM
        can demote its own first chunks), but is not visible to readers before the index
        commit. A chunk this node already holds with the same bytes is not stored twice
        (and so cannot be lost if this put fails). An item with no room is dropped
        (``drop`` reads its bytes off the socket).
        """
        received: list[tuple[int, ItemMeta, StoredChunk | None]] = []
        window: list[tuple[ItemMeta, ChunkBuffer]] = []  # reserved, bytes not brought yet

        async def receive_window() -> None:
            try:
                digests = await fill(window)
            except BaseException:
                for item, _ in window:
                    self.tiers.release(item.nbytes)
                window.clear()
                raise
            for (item, buffer), digest in zip(window, digests):
                if digest != item.checksum:
                    self.tiers.release(item.nbytes)
                    received.append((PUT_INTEGRITY, item, None))
                elif self.tiers.holds(item.key, item.checksum):
                    self.tiers.release(item.nbytes)
                    received.append((PUT_STORED, item, None))
                else:
                    chunk = StoredChunk(item, buffer)
                    self.tiers.insert(chunk)
                    received.append((PUT_STORED, item, chunk))
            window.clear()

        try:
            for item in items:
                try:
                    # Another stripe of the put may fill DRAM with its window: with no window of its
                    # own (nothing another waiter could wait for), this chunk may wait for that one.
                    await self.tiers.reserve(item.nbytes, wait_s=0.0 if window else PUT_RESERVE_WAIT_S)
                except CapacityError:
                    if not window:
                        await drop(item.nbytes)
                        received.append((PUT_NO_CAPACITY, item, None))
                        continue
                    await receive_window()  # the window's chunks become evictable for this one
                    try:
                        await self.tiers.reserve(item.nbytes, wait_s=PUT_RESERVE_WAIT_S)
                    except CapacityError:
                        await drop(item.nbytes)
                        received.append((PUT_NO_CAPACITY, item, None))
                        continue
                window.append((item, self.tiers.take_buffer(item.nbytes)))
                if sum(i.nbytes for i, _ in window) >= PUT_WINDOW_BYTES:
                    await receive_window()
            if window:
                await receive_window()
        except BaseException:
            # The frame never completed (peer gone, stalled): nothing of it stays.
            await self._discard_uncommitted([c for _, _, c in received if c is not None])
            raise
        return received

    async def _discard_uncommitted(self, chunks: list[StoredChunk]) -> None:
        for chunk in chunks:
            await self.tiers.discard(chunk)

    async def _commit_put(self, received: list[tuple[int, ItemMeta, StoredChunk | None]]) -> tuple[bytes, list[Buffer]]:
        flags: list[int] = []
        visible: list[tuple[str, Location]] = []
        for flag, item, _ in received:
            if flag == PUT_STORED and not self.tiers.holds(item.key, item.checksum):
                flag = PUT_NO_CAPACITY  # evicted by a later chunk of its own batch: never acknowledge it
            if flag == PUT_STORED:
                visible.append((item.key, self._location(item, self.tiers.tier_of(item.key) or DRAM)))
            flags.append(flag)
        self.counters["put_rejected_capacity"] += flags.count(PUT_NO_CAPACITY)
        self.counters["integrity_failures"] += flags.count(PUT_INTEGRITY)
        try:
            await self.meta.commit(visible)
        except MetadataError:
            # Not visible, so not kept: a put is acknowledged only once readers can find it.
            await self._discard_uncommitted([c for _, _, c in received if c is not None])
            raise
        with contextlib.suppress(MetadataError):
            await self._flush_index()  # what the batch evicted; kept for the heartbeat if this fails
        self.counters["puts"] += len(visible)
        self.counters["put_bytes"] += sum(loc.nbytes for _, loc in visible)
        return encode_flags(flags), []

    async def _handle(self, op: int, meta: bytearray, conn: FrameSocket) -> tuple[bytes, list[Buffer]]:
        limits = self.config.limits
        if op == Op.GET_BATCH:
            found: list[ItemMeta | None] = []
            data: list[Buffer] = []
            budget = limits.max_data_bytes  # a response never exceeds what a client accepts
            for key in decode_keys(meta, limits):
                chunk = await self.tiers.get(key)
                self.counters["gets"] += 1
                if chunk is not None and chunk.meta.nbytes > budget:
                    self.counters["get_over_frame_limit"] += 1
                    chunk = None
                if chunk is None:
                    self.counters["misses"] += 1
                    found.append(None)
                else:
                    self.counters["hits"] += 1
                    self.counters["get_bytes"] += chunk.meta.nbytes
                    found.append(chunk.meta)
                    data.append(chunk.buffer)
                    budget -= chunk.meta.nbytes
            return encode_get_response(found, limits), data
        if op == Op.EXISTS_BATCH:
            return encode_flags([int(self.tiers.contains(key)) for key in decode_keys(meta, limits)]), []
        if op == Op.DELETE_BATCH:
            keys = decode_keys(meta, limits)
            deleted = [key for key in keys if await self.tiers.delete(key)]
            await self.meta.remove(self.node_id, self.epoch, deleted)
            self.counters["deletes"] += len(deleted)
            gone = set(deleted)
            return encode_flags([int(key in gone) for key in keys]), []
        if op == Op.INVENTORY:
            return self._inventory(decode_json(meta)), []
        if op == Op.VERIFY_BATCH:
            flags = [VERIFY_STATUS[await self.tiers.verify(k)] for k in decode_keys(meta, limits)]
            if any(flags):
                await self._flush_index()  # a dropped corrupt copy leaves the index now, not at the next beat
            return encode_flags(flags), []
        if op == Op.LEASE:
            ttl_ms, lease_flags, keys = decode_lease_request(meta, limits)
            if ttl_ms > MAX_LEASE_TTL_MS:
                raise ProtocolError(f"lease ttl_ms {ttl_ms} exceeds {MAX_LEASE_TTL_MS}")
            return await self._lease(keys, ttl_ms, bool(lease_flags & LEASE_MAP), conn), []
        if op == Op.RELEASE:
            lease_id, keys = decode_release(meta, limits)
            return encode_json({"released": self.tiers.leases.release(lease_id, keys)}), []
        if op == Op.PUT_STAGED:
            return await self._commit_put(await self._receive_staged(meta, conn))
        if op == Op.CHANNEL_GET:
            return await self._channel_get(meta)
        if op == Op.STAT:
            return encode_json(self.stats()), []
        if op == Op.PING:
            return encode_json({"node_id": self.node_id, "epoch": self.epoch}), []
        raise ProtocolError(f"op {op} is not a request")

    async def _lease(self, keys: list[str], ttl_ms: int, want_map: bool, conn: FrameSocket) -> bytes:
        """Pin the keys this node holds for ``conn``; with ``want_map``, also answer their arena offsets.

        A mapped read is a GET whose bytes the client copies itself: the chunk is
        fetched (an NVMe hit is promoted into the arena) and the lease holds the
        chunk object, so its region outlives a concurrent delete or eviction.
        Without ``want_map`` this is a lock only: nothing moves, so it never waits.
        """
        found: list[tuple[ItemMeta, int] | None] = []
        held: list[str] = []
        chunks: list[StoredChunk] = []
        arena = self.tiers.arena
        for key in keys:
            if want_map:
                chunk = await self.tiers.get(key)
                self.counters["gets"] += 1
                if chunk is None:
                    self.counters["misses"] += 1
                    found.append(None)
                    continue
                offset = arena.offset_of(chunk.buffer) if arena is not None else None
                self.counters["hits"] += 1
                if offset is not None:
                    self.counters["shm_get_bytes"] += chunk.meta.nbytes
                found.append((chunk.meta, NO_OFFSET if offset is None else offset))
                chunks.append(chunk)
            else:
                item = self.tiers.meta_of(key)
                found.append(None if item is None else (item, NO_OFFSET))
                if item is None:
                    continue
            held.append(key)
        leases = self.tiers.leases
        lease_id = leases.grant(held, chunks, ttl_ms, owner=conn) if held else 0
        if lease_id and conn.closed:
            leases.release_owner(conn)  # it closed while we fetched: its teardown has already run
        return encode_lease_response(lease_id, found, self.config.limits)

    # -- channel (nccl_channel) --------------------------------------------------------
    def _channel_transport(self) -> Any:
        """The transport of ``config.channel`` (None when off); ConfigError if it cannot run here."""
        if self.config.channel == "off":
            return None
        try:
            from nccl_channel.channel import make_transport
        except ImportError as exc:  # the core install has no torch
            raise ConfigError("--channel", f"the channel moves torch tensors, and this install cannot import them "
                              f"({exc}); install kvpool[nccl]") from None  # fmt: skip

        try:
            return make_transport(self.config.channel, self.config.device)
        except NcclError as exc:
            raise ConfigError("--channel", str(exc)) from None

    def _start_channel(self, transport: Any) -> None:
        """Build the channel server over ``transport`` (once the node id is known)."""
        if transport is None:
            return
        from nccl_channel.channel import ChannelServer
        from nccl_channel.rendezvous import Rendezvous

        self.channel = ChannelServer(transport, Rendezvous(self.meta), self.node_id, self.config.cluster,
                                     self.config.redis_timeout_ms / 1000,
                                     pair_timeout_s=self.config.pair_timeout_ms / 1000)  # fmt: skip

    def _other_counters(self) -> Counter[str]:
        """The channel's and the dead-node collector's counters, where they run."""
        counters: Counter[str] = Counter(self.channel.counters) if self.channel is not None else Counter()
        return counters + (self.collector.counters if self.collector is not None else Counter())

    async def _channel_get(self, meta: bytearray) -> tuple[bytes, list[Buffer]]:
        """CHANNEL_GET: join the pair if new, answer which keys are held, send their bytes over the pair."""
        if self.channel is None:
            raise ProtocolError(f"node {self.node_id} serves no channel (start it with --channel)")
        session, keys = decode_channel_request(meta, self.config.limits)
        if not keys:
            # Pairing: answered once the offer is taken; the join runs on with its own deadline,
            # so a slow NCCL init never holds this request (and the client's connection) open.
            await self.channel.start_join(session)
            return encode_channel_response([], self.config.limits), []
        await self.channel.join(session)  # NcclError: answered as an error; the client falls back to TCP
        found: list[ItemMeta | None] = []
        buffers: list[Buffer] = []
        budget = self.config.limits.max_data_bytes  # as GET_BATCH: keys past it are misses, read over TCP
        for key in keys:
            chunk = await self.tiers.get(key)
            self.counters["channel_gets"] += 1
            if chunk is not None and chunk.meta.nbytes > budget:
                self.counters["get_over_frame_limit"] += 1
                chunk = None
            if chunk is None:
                self.counters["channel_misses"] += 1
                found.append(None)
            else:
                self.counters["channel_hits"] += 1
                found.append(chunk.meta)
                buffers.append(chunk.buffer)
                budget -= chunk.meta.nbytes
        if buffers:
            # The client receives after reading the answer; the pair's lock keeps batches in order.
            self._spawn(self.channel.send(session, buffers))
        return encode_channel_response(found, self.config.limits), []


def _inventory_page(tiers: TierManager, after: str, limit: int) -> tuple[list[list[Any]], bool]:
    keys = sorted(k for k in tiers.keys() if k > after)
    page = []
    for key in keys[:limit]:
        meta, tier = tiers.meta_of(key), tiers.tier_of(key)
        if meta is not None and tier is not None:
            page.append([key, tier, meta.nbytes, meta.checksum])
    return page, len(keys) > limit


async def run_node(config: NodeConfig, ready: Any = None) -> None:
    """Run a node until SIGTERM/SIGINT, then withdraw it from the pool cleanly."""
    node = PoolNode(config)
    await node.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.request_stop)
    if ready is not None:
        ready(node)
    try:
        await node.wait_stopped()
    finally:
        await node.stop()
