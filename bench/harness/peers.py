"""The storage services the harness compares, each started here and reached through LMCache.

A peer starts its server, gives the LMCache config that reaches it, names the Redis
server (if any) that answers its lookups, empties itself between measurements (kvpool
instead fills its DRAM, so that every measured put evicts: ``bench.harness.full_pool``), and
stops. Every server is a child process on 127.0.0.1 and is stopped by its own pid.

| peer | server | LMCache reaches it with |
|---|---|---|
| kvpool | ``kvpool up --nvme 0`` (private Redis + one DRAM node, as deployed) | the kvpool plugin with ``shm=off``: over TCP, as from another host |
| kvpool-shm | ``kvpool up --nvme 0`` (DRAM in a /dev/shm arena) | the kvpool plugin, same-host fast path |
| redis | ``redis-server`` | ``remote_url: redis://`` |
| resp | the same ``redis-server`` | ``remote_url: resp://`` (no chunk meta, no unfull chunks) |
| lm | ``python -m lmcache.v1.server HOST PORT cpu`` | ``remote_url: lm://`` |
| fs | a directory on the local disk | ``remote_url: fs://127.0.0.1:0/ABS/PATH`` |
| mooncake | ``mooncake_master`` + ``mooncake_client`` (if installed) | ``remote_url: mooncakestore://`` |
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from backend.config import PoolConfig
from backend.embedded import EmbeddedRedis, free_port
from backend.launch.processes import ServerProcess
from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config
from bench.harness.full_pool import FullPool

__all__ = ["Peer", "KVPoolPeer", "RedisPeer", "LMServerPeer", "FSPeer", "MooncakePeer", "PEER_NAMES", "make_peers"]

PEER_NAMES = ("kvpool", "kvpool-shm", "redis", "resp", "lm", "fs", "mooncake")
STORE_SETTLE_S = 10.0
LMCACHE_BLOCKING_TIMEOUT_S = 60  # LMCache's default (10 s) is short for 8 x 32 MiB over redis:// on 2 cores
LM_SERVER_MAX_BYTES = 4 << 30  # what lm:// (no delete, no eviction) may hold before it is restarted empty
KVPOOL_URL_RE = re.compile(r"^\s*(kvpool://\S+)\s*$")


def base_config(local_cpu_gib: float) -> dict[str, Any]:
    """What every LMCache config here shares: 256-token chunks, a local CPU buffer, no compression."""
    return {
        "chunk_size": 256,
        "local_cpu": True,
        "max_local_cpu_size": local_cpu_gib,
        "remote_serde": "naive",
        "blocking_timeout_secs": LMCACHE_BLOCKING_TIMEOUT_S,
    }


class Peer:
    """One backend as the harness drives it."""

    name = ""
    ceiling = "tcp_loopback"  # the machine ceiling its GB/s are compared with
    skip_reason: str | None = None  # set when it cannot run here

    def start(self) -> None:
        raise NotImplementedError

    def lmcache_config(self, local_cpu_gib: float, *, redis_port: int | None = None) -> dict[str, Any]:
        """LMCache config reaching this peer; ``redis_port`` replaces its Redis port (for the counting proxy)."""
        raise NotImplementedError

    @property
    def redis_port(self) -> int | None:
        """The Redis server that answers this peer's lookups, if it has one."""
        return None

    @property
    def redis_password(self) -> str | None:
        """The password that Redis wants, if any."""
        return None

    def clear(self, stack: LMCacheStack, keys: Sequence[Any]) -> None:
        """Forget ``keys`` so that the next measurement starts from an empty store."""

    def new_chunk_size(self, store_bytes: int) -> None:
        """Called before each chunk size's cells (in every round), with the bytes they will store."""

    def fill(self, chunk_bytes: int) -> dict[str, Any] | None:
        """Bring the store to its steady state (full) before a chunk size's cells; what was done, or None."""
        return None

    def evictions(self) -> int | None:
        """How many chunks the store has evicted so far, or None when it does not evict or count."""
        return None

    def stop(self) -> None:
        raise NotImplementedError


class KVPoolPeer(Peer):
    """kvpool's own pool, DRAM only: ``kvpool up --dram SIZE --nvme 0``.

    ``shm=False`` measures the TCP path, as a client on another host sees it (the
    node is the same default node, DRAM in its arena; the client says ``shm=off``);
    ``shm=True`` measures the same-host fast path; ``up_args`` are more flags of
    ``kvpool up`` (the workload replay's ``--eviction``) and ``url_options`` more
    ``key=value`` options of the client's URL. Its DRAM is
    filled before each chunk size (``fill``), so measured puts evict as in service.
    """

    def __init__(
        self, dram: str, *, shm: bool = False, up_args: Sequence[str] = (), url_options: Sequence[str] = ()
    ) -> None:
        self.dram = dram
        self.url_options = tuple(url_options)
        self.shm = shm
        self.name = "kvpool-shm" if shm else "kvpool"
        self.ceiling = "memcpy" if shm else "tcp_loopback"
        self.url = ""
        self.full: FullPool | None = None
        command = [sys.executable, "-m", "backend.cli", "up", "--dram", dram, "--nvme", "0", *up_args]
        self.server = ServerProcess("kvpool up", command, KVPOOL_URL_RE)

    def start(self) -> None:
        self.url = self.server.start().wait_ready().group(1)
        self.full = FullPool(self.url)

    @property
    def redis_port(self) -> int | None:
        return urlsplit(self.url).port

    @property
    def redis_password(self) -> str | None:
        """`kvpool up`'s Redis wants the password of the file its URL names (redis_password_file=)."""
        return PoolConfig.from_url(self.url).redis_password or None

    def lmcache_config(self, local_cpu_gib: float, *, redis_port: int | None = None) -> dict[str, Any]:
        parts = urlsplit(self.url)
        if redis_port is not None:
            parts = parts._replace(netloc=f"{parts.hostname}:{redis_port}")
        options = [*self.url_options, *(() if self.shm else ("shm=off",))]
        if options:
            parts = parts._replace(query="&".join(q for q in (parts.query, *options) if q))
        url = urlunsplit(parts)
        config = kvpool_lmcache_config(url, local_cpu_gib=local_cpu_gib)
        config["blocking_timeout_secs"] = LMCACHE_BLOCKING_TIMEOUT_S
        return config

    def clear(self, stack: LMCacheStack, keys: Sequence[Any]) -> None:
        """Nothing: removing keys would leave room that the next puts fill without evicting; LRU evicts them."""

    def fill(self, chunk_bytes: int) -> dict[str, Any] | None:
        assert self.full is not None, "fill before start"
        return self.full.fill(chunk_bytes)

    def evictions(self) -> int | None:
        assert self.full is not None, "evictions before start"
        return self.full.evictions()

    def stop(self) -> None:
        try:
            if self.full is not None:
                self.full.close()
                self.full = None
        finally:
            self.server.stop(signal.SIGINT)  # Ctrl-C, as a user stops it


class SharedRedis:
    """One ``redis-server`` for the redis:// and resp:// peers, started by the first that needs it."""

    def __init__(self) -> None:
        self.server: EmbeddedRedis | None = None
        self.users = 0

    def acquire(self) -> EmbeddedRedis:
        if self.server is None:
            self.server = EmbeddedRedis().start()
        self.users += 1
        return self.server

    def release(self) -> None:
        self.users -= 1
        if self.users == 0 and self.server is not None:
            self.server.cleanup()
            self.server = None


class RedisPeer(Peer):
    """LMCache's own ``redis://`` or ``resp://`` connector on a redis-server started here."""

    def __init__(self, scheme: str, shared: SharedRedis) -> None:
        self.name = scheme
        self.scheme = scheme
        self.shared = shared
        self.server: EmbeddedRedis | None = None

    def start(self) -> None:
        self.server = self.shared.acquire()

    @property
    def redis_port(self) -> int | None:
        return self.server.port if self.server is not None else None

    def lmcache_config(self, local_cpu_gib: float, *, redis_port: int | None = None) -> dict[str, Any]:
        config = base_config(local_cpu_gib)
        config["remote_url"] = f"{self.scheme}://127.0.0.1:{redis_port or self.redis_port}"
        if self.scheme == "resp":
            # LMCache's RESP adapter asserts both (it stores raw bytes of full chunks only).
            config["save_unfull_chunk"] = False
            config["extra_config"] = {"save_chunk_meta": False}
        return config

    def clear(self, stack: LMCacheStack, keys: Sequence[Any]) -> None:
        with redis.Redis(port=self.redis_port, socket_timeout=30) as client:
            client.flushall()

    def stop(self) -> None:
        if self.server is not None:
            self.server = None
            self.shared.release()


class LMServerPeer(Peer):
    """LMCache's own server: ``python -m lmcache.v1.server 127.0.0.1 PORT cpu``.

    It has no delete and no eviction, so it is restarted empty before a chunk size
    whose cells would take what it holds past ``LM_SERVER_MAX_BYTES``.
    """

    name = "lm"

    def __init__(self) -> None:
        self.port = 0
        self.server: ServerProcess | None = None
        self.stored_bytes = 0

    def start(self) -> None:
        self.stored_bytes = 0
        self.port = free_port()
        self.server = ServerProcess(
            "lmcache.v1.server", [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(self.port), "cpu"]
        ).start()
        self.server.wait_port(self.port)

    def lmcache_config(self, local_cpu_gib: float, *, redis_port: int | None = None) -> dict[str, Any]:
        return {**base_config(local_cpu_gib), "remote_url": f"lm://127.0.0.1:{self.port}"}

    def new_chunk_size(self, store_bytes: int) -> None:
        if self.stored_bytes and self.stored_bytes + store_bytes > LM_SERVER_MAX_BYTES:
            self.stop()
            self.start()
        self.stored_bytes += store_bytes

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class FSPeer(Peer):
    """LMCache's ``fs://`` connector on a fresh directory of the local disk (page cache, no fsync)."""

    name = "fs"
    ceiling = "memcpy"

    def __init__(self, parent: str | None = None) -> None:
        self.parent = parent
        self.path: Path | None = None

    def start(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="kvpool-bench-fs-", dir=self.parent)).resolve()

    def lmcache_config(self, local_cpu_gib: float, *, redis_port: int | None = None) -> dict[str, Any]:
        return {**base_config(local_cpu_gib), "remote_url": f"fs://127.0.0.1:0{self.path}"}

    def clear(self, stack: LMCacheStack, keys: Sequence[Any]) -> None:
        assert self.path is not None
        for child in self.path.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()

    def stop(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


def mooncake_missing() -> str | None:
    """Why Mooncake cannot run here, or None when its module and binaries are present."""
    missing = []
    if importlib.util.find_spec("mooncake") is None:
        missing.append("no 'mooncake' module (pip package mooncake-transfer-engine-non-cuda)")
    for binary in ("mooncake_master", "mooncake_client"):
        if shutil.which(binary) is None:
            missing.append(f"no {binary} binary")
    return "; ".join(missing) or None


class MooncakePeer(Peer):
    """LMCache's ``mooncakestore://`` connector on a local master and one store node (TCP).

    Settings follow the project's LMCache notes: the master address must be given as
    ``mooncake_master_server_addr``, and a single-key get is not implemented (LMCache
    uses its batched get). Not yet run: Mooncake was not installed where this was written.
    """

    name = "mooncake"

    def __init__(self, segment_bytes: int) -> None:
        self.segment_bytes = segment_bytes
        self.skip_reason = mooncake_missing()
        self.rpc_port = self.http_port = 0
        self.servers: list[ServerProcess] = []
        self.sizes_served = 0

    def start(self) -> None:
        self.rpc_port, self.http_port, metrics_port, store_port = (free_port() for _ in range(4))
        master = ServerProcess(
            "mooncake_master",
            [
                "mooncake_master",
                "-rpc_port",
                str(self.rpc_port),
                "-rpc_address",
                "127.0.0.1",
                "-enable_http_metadata_server=true",
                "-http_metadata_server_port",
                str(self.http_port),
                "-http_metadata_server_host",
                "127.0.0.1",
                "-metrics_port",
                str(metrics_port),
                "-metrics_host",
                "127.0.0.1",
            ],
        ).start()
        self.servers.append(master)
        master.wait_port(self.rpc_port)
        master.wait_port(self.http_port)
        store = ServerProcess(
            "mooncake_client",
            [
                "mooncake_client",
                "-host",
                "127.0.0.1",
                "-port",
                str(store_port),
                "-global_segment_size",
                str(self.segment_bytes),
                "-local_buffer_size",
                "0",
                "-master_server_address",
                f"127.0.0.1:{self.rpc_port}",
                "-metadata_server",
                f"http://127.0.0.1:{self.http_port}/metadata",
                "-protocol",
                "tcp",
            ],
        ).start()
        self.servers.append(store)
        # Whether the store node listens on -port itself is not documented: give it a
        # moment, and require only that it is still running.
        store.wait_port(store_port, STORE_SETTLE_S, required=False)
        store.check_alive()

    def lmcache_config(self, local_cpu_gib: float, *, redis_port: int | None = None) -> dict[str, Any]:
        local_buffer_bytes = int(local_cpu_gib * 2**30)
        return {
            **base_config(local_cpu_gib),
            "remote_url": f"mooncakestore://127.0.0.1:{self.rpc_port}",
            "extra_config": {
                "local_hostname": "127.0.0.1",
                "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
                "mooncake_master_server_addr": f"127.0.0.1:{self.rpc_port}",
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": 0,
                "local_buffer_size": local_buffer_bytes,
                "transfer_timeout": LMCACHE_BLOCKING_TIMEOUT_S,
            },
        }

    def new_chunk_size(self, store_bytes: int) -> None:
        if self.sizes_served:  # LMCache's Mooncake connector has no remove: start empty instead
            self.stop()
            self.start()
        self.sizes_served += 1

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.servers = []


def make_peers(names: Sequence[str], *, kvpool_dram: str, fs_parent: str | None, mooncake_bytes: int) -> list[Peer]:
    """The peers called ``names``, in that order; redis and resp share one redis-server."""
    shared = SharedRedis()
    factories: dict[str, Callable[[], Peer]] = {
        "kvpool": lambda: KVPoolPeer(kvpool_dram),
        "kvpool-shm": lambda: KVPoolPeer(kvpool_dram, shm=True),
        "redis": lambda: RedisPeer("redis", shared),
        "resp": lambda: RedisPeer("resp", shared),
        "lm": LMServerPeer,
        "fs": lambda: FSPeer(fs_parent),
        "mooncake": lambda: MooncakePeer(mooncake_bytes),
    }
    return [factories[name]() for name in names]
