"""The pool node process: a thin owner that wires its parts together, starts them and stops them.

The parts, one module each:

* ``startup.py``: the start's order (secrets, Redis, the id's claim, arena, recovery, join) and what
  each step checks; ``claim.py``: one process per node id;
* ``tiers.py`` (``TierManager``, the store's one door, over ``dram.py``, ``nvme_tier.py`` and its file
  format ``nvme_format.py``, ``demotion.py``, ``arena.py``, ``leases.py``): where chunks live and every
  store operation; ``pins.py``: pins, leases of no connection; ``recovery.py``: the NVMe scan at start;
* ``session.py``: the accept loop and one session per connection (TLS, auth, frames);
  ``admission.py``: what a connection gets before its handshake is done; ``stages.py``: the
  same-host clients' put stages, swept when their client is gone;
* ``ops.py``, ``read_ops.py``: what each request op does; ``puts.py``: the put path and its crash ordering;
* ``publisher.py``: heartbeat, index flush, republish after Redis loss; ``reaper.py``: what dead
  nodes left in Redis, removed by one live node;
* ``stats.py``: counters, recent rates, service times; ``report()`` answers STAT and feeds /metrics.

Each part is given a :class:`~backend.node.context.NodeContext` (config, tiers, index,
counters, identity, worker threads, tasks) and the parts it uses; none holds this
object. Only :meth:`PoolNode.start` sets the node's id and epoch, once it claimed the id.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from collections import Counter
from typing import Any

from backend.config import NodeConfig
from backend.counters import NodeCounter
from backend.errors import ConfigError, KVPoolError, NcclError
from backend.metadata import ClaimHolder, MetadataStore, NodeInfo, NodeMetadata
from backend.metrics import NodeMetricsServer
from backend.node.context import NodeContext
from backend.node.index.claim import IdClaim, chosen_node_id
from backend.node.index.publisher import Advert, IndexPublisher
from backend.node.index.reaper import DeadNodeReaper
from backend.node.index.recovery import NvmeRecovery, RecoveryReport, keep_node_id
from backend.node.serve.admission import Admission
from backend.node.serve.ops import OpTable
from backend.node.serve.puts import PutReceiver
from backend.node.serve.read_ops import ChannelServing
from backend.node.serve.session import Acceptor
from backend.node.serve.stages import sweep_stages
from backend.node.startup import NewDirectory, check_redis, listen, take_arena
from backend.node.stats import NodeStats
from backend.node.store.dirlock import DirectoryLock
from backend.node.store.tiers import TierConfig, TierManager
from backend.protocol.reports import NodeReport
from backend.transport import FrameSocket, server_tls_context

__all__ = ["PoolNode"]

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0


def tier_config(config: NodeConfig) -> TierConfig:
    """The tier manager's part of a node's settings."""
    return TierConfig(
        dram_bytes=config.dram_bytes,
        nvme_dir=config.nvme_dir,
        nvme_bytes=config.nvme_bytes,
        high_watermark=config.high_watermark,
        low_watermark=config.low_watermark,
        shm_dir=config.shm_dir,
        prefault=config.prefault,
        eviction=config.eviction,
    )


class PoolNode:
    """One node: accepts client connections, stores chunks, keeps Redis in step."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._store = MetadataStore(
            config.redis_url,
            config.namespace,
            config.redis_timeout_s,
            password=config.redis_password,
            ca_file=config.redis_ca_file,
        )
        # The tiers' memory (the DRAM arena) is taken at start, once Redis and the node id are checked.
        self.ctx = NodeContext(config, TierManager(tier_config(config), defer_memory=True), NodeMetadata(self._store))
        self.tiers = self.ctx.tiers
        self.counters: Counter[NodeCounter] = self.ctx.counters
        self.stats = NodeStats(self.ctx)
        self.admission = Admission(self.counters, config.max_pending_connections)  # those not yet admitted
        self.publisher = IndexPublisher(self.ctx, self.stats)
        self.puts = PutReceiver(self.ctx, self.publisher)
        self.ops = OpTable(self.ctx, self.stats, self.publisher, self.puts)
        self.acceptor = Acceptor(self.ctx, self.admission, self.stats, self.ops)
        # Made by start():
        self.tls: ssl.SSLContext | None = None
        self.listener: socket.socket | None = None
        self._dir_lock: DirectoryLock | None = None  # the NVMe directory's, held while the node runs
        self.metrics: NodeMetricsServer | None = None
        self.channel: ChannelServing | None = None  # nccl_channel.node.ChannelServer, if configured
        self.reaper: DeadNodeReaper | None = None  # made once the node id is known
        self.prefaulted_bytes = 0  # DRAM arena memory taken at start (--prefault), and how long it took
        self.prefault_s = 0.0
        self.started_at = time.time()  # set again by start(): NVMe files older than it are the last run's

    # -- lifecycle --------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self.ctx.node_id

    @property
    def epoch(self) -> int:
        return self.ctx.epoch

    @property
    def recovery(self) -> RecoveryReport | None:
        """The NVMe tier's recovery so far (None without NVMe): it runs in the background from the start."""
        return self.stats.recovery

    @property
    def connections(self) -> set[FrameSocket]:
        return self.acceptor.connections

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
        return self.ctx.stopping

    @property
    def lost_claim(self) -> KVPoolError | None:
        """Why the node stopped itself: another process took its id (None otherwise)."""
        return self.publisher.lost_claim

    async def start(self) -> None:
        """Start in the order of ``startup.py``: local settings and the listen port, Redis (reach, password,
        version, namespace), the id's claim with a new epoch, then, renewing the claim, the NVMe directory's id
        file, the DRAM arena and its prefault, metrics, channel, the NVMe tier's recovery (begun: it goes on in
        the background, ``recovery.py``), publication. The node serves and takes puts while recovery runs.

        Raises MetadataError for Redis, ConfigError for a setting or a live node holding the id (``claim.py``),
        NodeUnavailable for a taken port; whatever the step, what the steps before took is given back first.
        """
        self.started_at = time.time()  # before anything of this run can write a file
        transport = self._channel_transport()  # a ConfigError here leaves no port bound
        self.tls = self._tls_context()
        self.listener = listen(self.config)
        made = NewDirectory(self.tiers.nvme_root)
        claim: IdClaim | None = None
        try:
            await check_redis(self._store, self.config)
            claim = await self._claim_id()
            async with claim.kept():
                await self._start_claimed(transport, claim.node_id)
        except BaseException:  # give back what it took: a retry need not wait out a heartbeat TTL
            await self.ctx.cancel_tasks()  # the recovery, if it began
            if self._dir_lock is not None:  # while it holds the lock, no other node is in the directory
                made.remove()
            await self._release(withdraw=claim is not None)
            raise
        self.tiers.start()
        self.ctx.spawn(self.acceptor.accept_loop(self.listener, self.tls))
        self.ctx.spawn(self.publisher.heartbeat_loop(self.reaper))
        if self.tiers.shm_arena is not None:  # clients on this host stage their puts next to it
            self.ctx.spawn(sweep_stages(self.ctx, self.tiers.shm_arena.path.parent))
        nvme_root, nvme_bytes = self.tiers.nvme_root, self.tiers.capacity_bytes - self.tiers.dram_capacity_bytes
        logger.info(
            "node %s epoch %d listening on %s:%d, advertised as %s:%d (DRAM %d bytes, NVMe %s, namespace %s)",
            self.node_id,
            self.epoch,
            self.config.host,
            self.port,
            self.advertise_host,
            self.advertise_port,
            self.tiers.dram_capacity_bytes,
            f"{nvme_bytes} bytes at {nvme_root}" if nvme_root else "off",
            self.config.namespace,
        )

    async def _claim_id(self) -> IdClaim:
        """This node's id claimed with a new epoch (``claim.py``): from here on its identity. Its NVMe
        directory is locked first (``dirlock.py``): the id it keeps there is read only under the lock."""
        nvme_root = self.tiers.nvme_root
        if nvme_root is not None:
            self._dir_lock = DirectoryLock(nvme_root)
        node_id, source = await chosen_node_id(self.config.node_id, nvme_root, self.port)
        epoch = await self._store.registry.new_epoch()
        holder = ClaimHolder(epoch, self.advertise_host, self.advertise_port, os.getpid(), socket.gethostname())
        claim = IdClaim(self._store.registry, node_id, holder, self.config, source)
        await claim.take()
        self.ctx.joined(node_id, epoch, f"{self.advertise_host}:{self.advertise_port}")
        return claim

    async def _start_claimed(self, transport: Any, node_id: str) -> None:
        """Everything of the start that the id names or that takes time, once the id is this node's."""
        nvme_root = self.tiers.nvme_root
        if nvme_root is not None:
            await asyncio.to_thread(keep_node_id, nvme_root, node_id)
        self.reaper = DeadNodeReaper(self._store, node_id, self.config.dead_node_grace_s)
        self.stats.count_also(self.reaper.counters)
        prefault = await take_arena(self.tiers, self.config.prefault, node_id)
        self.prefaulted_bytes, self.prefault_s = prefault.taken_bytes, prefault.seconds
        # The metrics port opens once the arena is taken (a startup probe waits for it: docs/deploy.md), and
        # before registering: if it is taken, nothing is left in Redis.
        if self.config.metrics_port is not None:
            self.metrics = NodeMetricsServer(
                self.report, self.health, self.config.metrics_host, self.config.metrics_port
            )
            await self.metrics.start()
            logger.info(
                "node %s: metrics at http://%s:%d/metrics", node_id, self.config.metrics_host, self.metrics.port
            )
        self._start_channel(transport, node_id)
        advert = Advert(
            self.advertise_host,
            self.advertise_port,
            tls=self.tls is not None,
            channel=self.channel.kind if self.channel is not None else "",
        )
        if nvme_root is not None:
            await self.ctx.pins.load()  # before recovery adopts files: a pinned chunk enters pinned
            NvmeRecovery(self.ctx, self.stats, nvme_root, written_before=self.started_at).start()
        await self.publisher.join(advert)

    def _tls_context(self) -> ssl.SSLContext | None:
        cert, key = self.config.tls_cert, self.config.tls_key
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise ConfigError("--tls-cert", "TLS needs both --tls-cert and --tls-key")
        return server_tls_context(str(cert), str(key))

    async def wait_stopped(self) -> None:
        await self.ctx.wait_stopped()

    def request_stop(self) -> None:
        self.ctx.request_stop()

    async def stop(self) -> None:
        """Stop serving, withdraw this node's index entries, deregister. Bounded in time."""
        self.ctx.request_stop()
        if self.listener is not None:
            self.listener.close()  # first: no connection is accepted while the node stops
        self.acceptor.close()
        await self.ctx.cancel_tasks()
        await self._release(withdraw=True)
        logger.info("node %s stopped", self.node_id)

    async def _release(self, *, withdraw: bool) -> None:
        """Give back what the node took: its registry entry and index entries (``withdraw``: only while its id
        is still this run's claim), port, metrics port, channel, tiers, Redis connection.

        The registry entry goes first: once it is gone readers take the node's entries for a dead node's
        (misses), so a node of a million chunks, whose entries take longer to withdraw than the stop may,
        still leaves the pool at once; what it could not withdraw in time the dead-node reaper removes.
        """
        if self.listener is not None:
            self.listener.close()
        try:
            async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
                if withdraw:
                    await self._store.registry.deregister(self.node_id, self.epoch)  # leaves a new holder's entries
                    await self._store.index.remove(self.node_id, self.epoch, self.tiers.keys())
        except (KVPoolError, TimeoutError) as exc:
            logger.warning("node %s: could not withdraw its index entries cleanly: %s", self.node_id, exc)
        if self.metrics is not None:
            await self.metrics.stop()
        if self.channel is not None:
            await self.channel.close()
        await self.tiers.close()
        if self._dir_lock is not None:
            self._dir_lock.release()  # after the tiers: nothing of this node touches the directory any more
        await self._store.close()
        self.ctx.bulk.shutdown(wait=False)

    # -- what the node says about itself ----------------------------------------------
    def info(self) -> NodeInfo:
        """This node's registry entry (once started)."""
        return self.publisher.info()

    def report(self) -> NodeReport:
        """STAT's answer (``NodeStats.report``)."""
        return self.stats.report()

    def health(self) -> dict[str, Any]:
        """What ``/health`` answers: ok while serving with Redis reachable."""
        serving = self.listener is not None and not self.ctx.stopping
        redis_ok = self.publisher.redis_ok
        trouble = self.publisher.redis_trouble
        healthy = serving and redis_ok and not trouble
        return {
            "status": "ok" if healthy else "degraded",
            "node_id": self.node_id,
            "epoch": self.epoch,
            "serving": serving,
            "redis_reachable": redis_ok,
            "redis": trouble or "ok",  # "full", "slow" or "unreachable" since its last failure
            "nvme_disk_full": self.tiers.disk_full,
        }

    # -- channel (nccl_channel) --------------------------------------------------------
    def _channel_transport(self) -> Any:
        """The transport of ``config.channel`` (None when off); ConfigError if it cannot run here."""
        if self.config.channel == "off":
            return None
        try:
            from nccl_channel.channel import make_transport
        except ImportError as exc:  # the core install has no torch
            raise ConfigError(
                "--channel",
                f"the channel moves torch tensors, and this install cannot import them ({exc}); install kvpool[nccl]",
            ) from None

        try:
            return make_transport(self.config.channel, self.config.device)
        except NcclError as exc:
            raise ConfigError("--channel", str(exc)) from None

    def _start_channel(self, transport: Any, node_id: str) -> None:
        """Build the channel server over ``transport`` for the op handlers (once the node id is known)."""
        if transport is None:
            return
        from nccl_channel.channel import ChannelServer
        from nccl_channel.rendezvous import Rendezvous

        self.channel = ChannelServer(
            transport,
            Rendezvous(self._store.rendezvous),
            node_id,
            self.config.cluster,
            self.config.redis_timeout_s,
            pair_timeout_s=self.config.pair_timeout_s,
        )
        self.ops.use_channel(self.channel)
        self.stats.count_also(self.channel.counters)
