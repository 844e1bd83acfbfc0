"""The pool node process: a thin owner that wires its parts together, starts them and stops them.

The parts, one module each:

* ``tiers.py`` (with ``dram.py``, ``nvme_tier.py``, ``demotion.py``, ``arena.py``,
  ``leases.py``): where chunks live;
* ``session.py``: the accept loop and one session per connection (TLS, auth, frames);
  ``admission.py``: what a connection gets before its handshake is done;
* ``ops.py``: what each request op does; ``puts.py``: the put path and its crash ordering;
* ``publisher.py``: heartbeat, index flush, republish after Redis loss;
* ``stats.py``: counters, recent rates, service times (STAT, /metrics).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from backend.config import NodeConfig
from backend.errors import ConfigError, KVPoolError, NcclError, NodeUnavailable
from backend.metadata import MetadataStore, NodeInfo
from backend.metrics import NodeMetricsServer
from backend.node.admission import Admission
from backend.node.collector import DeadNodeCollector
from backend.node.ops import OpHandlers
from backend.node.publisher import IndexPublisher
from backend.node.puts import PutReceiver
from backend.node.recovery import RecoveryReport, node_identity, scan
from backend.node.session import accept_loop
from backend.node.stats import NodeStats
from backend.node.tiers import TierConfig, TierManager
from backend.transport import FrameSocket, server_tls_context

__all__ = ["PoolNode"]

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0
# Threads that move large replies and puts (``backend.transport``): with one per busy
# connection, two clients' GETs are sent by both cores instead of the event loop's one.
BULK_THREADS = 4


def tier_config(config: NodeConfig) -> TierConfig:
    """The tier manager's part of a node's settings."""
    return TierConfig(
        dram_bytes=config.dram_bytes, nvme_dir=config.nvme_dir, nvme_bytes=config.nvme_bytes,
        high_watermark=config.high_watermark, low_watermark=config.low_watermark, shm_dir=config.shm_dir,
    )  # fmt: skip


class PoolNode:
    """One node: accepts client connections, stores chunks, keeps Redis in step."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.tiers = TierManager(tier_config(config))
        self.recovery: RecoveryReport | None = None
        self.meta = MetadataStore(
            config.redis_url, config.namespace, config.redis_timeout_ms / 1000,
            password=config.redis_password, ca_file=config.redis_ca_file,
        )  # fmt: skip
        self.tls: ssl.SSLContext | None = None
        self.statistics = NodeStats()
        self.counters: Counter[str] = self.statistics.counters
        self.epoch = 0
        self.node_id = config.node_id
        self.started_at = time.time()
        self.listener: socket.socket | None = None
        self.connections: set[FrameSocket] = set()
        self.admission = Admission(self.counters, config.max_pending_connections)  # those not yet admitted
        self.metrics: NodeMetricsServer | None = None
        self.bulk = ThreadPoolExecutor(BULK_THREADS, thread_name_prefix="kvpool-node-bulk")
        self.channel: Any = None  # nccl_channel.channel.ChannelServer once started, if configured
        self.collector: DeadNodeCollector | None = None  # made once the node id is known
        self.publisher = IndexPublisher(self)
        self.puts = PutReceiver(self)
        self.ops = OpHandlers(self)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()

    # -- lifecycle --------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self.listener is not None
        return int(self.listener.getsockname()[1])

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

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def start(self) -> None:
        """Bind, take an epoch, register. Raises MetadataError if Redis is unreachable."""
        transport = self._channel_transport()  # a ConfigError here leaves no port bound
        self.tls = self._tls_context()
        try:
            listener = socket.create_server((self.config.host, self.config.port), backlog=512, reuse_port=False)
        except OSError as exc:  # a taken port or an address not on this machine: exit 1 with one line
            where = f"{self.config.host}:{self.config.port}"
            raise NodeUnavailable(f"port: cannot listen on {where}: {exc.strerror or exc}") from None
        listener.setblocking(False)
        self.listener = listener
        if self.tiers.nvme is not None:
            root = self.tiers.nvme.root
            self.node_id = await asyncio.to_thread(node_identity, root, self.node_id)
            records, report = await asyncio.to_thread(scan, root)
            self.recovery = report
            self.tiers.load_nvme(records)
            await asyncio.to_thread(self.tiers.nvme.warn_if_larger_than_disk)
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
        await self.publisher.join()
        self.tiers.start()
        self.spawn(accept_loop(self))
        self.spawn(self.publisher.heartbeat_loop())
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
        if self.listener is not None:
            self.listener.close()
        for conn in list(self.connections):
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
                await self.meta.remove(self.node_id, self.epoch, self.tiers.held.all())
                await self.meta.deregister(self.node_id)
        except (KVPoolError, TimeoutError) as exc:
            logger.warning("node %s: could not deregister cleanly: %s", self.node_id, exc)
        if self.metrics is not None:
            await self.metrics.stop()
        if self.channel is not None:
            await self.channel.close()
        await self.tiers.close()
        await self.meta.close()
        self.bulk.shutdown(wait=False)
        logger.info("node %s stopped", self.node_id)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of this node: cancelled when the node stops."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- what the node says about itself ----------------------------------------------
    def info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            host=self.advertise_host,
            port=self.advertise_port,
            epoch=self.epoch,
            cluster=self.config.cluster,
            channel=self.channel.kind if self.channel is not None else "",
            tls=self.tls is not None,
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
        return self.statistics.report(self)

    def health(self) -> dict[str, Any]:
        """What ``/health`` answers: ok while serving with Redis reachable."""
        serving = self.listener is not None and not self._stopping.is_set()
        redis_ok = self.publisher.redis_ok
        healthy = serving and redis_ok
        return {"status": "ok" if healthy else "degraded", "node_id": self.node_id, "epoch": self.epoch,
                "serving": serving, "redis_reachable": redis_ok,
                "nvme_disk_full": self.tiers.disk_full}  # fmt: skip

    def other_counters(self) -> Counter[str]:
        """The channel's and the dead-node collector's counters, where they run."""
        counters: Counter[str] = Counter(self.channel.counters) if self.channel is not None else Counter()
        return counters + (self.collector.counters if self.collector is not None else Counter())

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
