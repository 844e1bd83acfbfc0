"""redis-server topologies for tests and benchmarks: a Redis Cluster, a Sentinel.

:class:`RedisProcesses` starts redis-servers in a directory and stops them all at the
end; :meth:`RedisProcesses.start_cluster` joins three (or more) into a Redis Cluster
with ``redis-cli --cluster create`` and waits for ``cluster_state:ok``.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import redis

from backend.embedded import free_port

__all__ = ["RedisProcesses", "cli", "cluster_port"]

START_TIMEOUT_S = 30.0
CLUSTER_NODE_TIMEOUT_MS = 2000  # how long a silent master takes to be marked failed
PORT_RACE_RETRIES = 3


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 >= 65536:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _cluster_ok(port: int) -> bool:
    return "cluster_state:ok" in cli(port, "CLUSTER", "INFO")


def cli(port: int, *args: str) -> str:
    """``redis-cli -p PORT ARGS...``'s output."""
    proc = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=30)
    return proc.stdout


def _ping(port: int) -> bool:
    try:
        return cli(port, "PING").strip() == "PONG"
    except subprocess.TimeoutExpired:
        return False


def _wait(predicate: Callable[[], bool], what: str, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline or (process is not None and process.poll() is not None):
            raise RuntimeError(f"{what} within {START_TIMEOUT_S} s")
        time.sleep(0.05)


class RedisProcesses:
    """redis-server processes started under ``root``; :meth:`stop_all` ends them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.args: dict[int, tuple[str, ...]] = {}

    def start(self, port: int, *args: str) -> int:
        """A redis-server; started again on a port it ran on, it keeps its arguments (and cluster config)."""
        args = args or self.args.get(port, ())
        self.args[port] = args
        workdir = self.root / str(port)
        workdir.mkdir(exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [
                "redis-server",
                *args,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--logfile",
                str(workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=workdir,
        )
        process = self.processes[port]
        try:
            _wait(lambda: _ping(port), f"redis-server on port {port} did not answer", process)
        except RuntimeError:
            self.processes.pop(port)
            process.kill()
            process.wait(10)
            log = workdir / "redis.log"
            raise RuntimeError(
                f"redis-server on port {port} did not start: {log.read_text()[-1000:] if log.exists() else ''}"
            ) from None
        return port

    def start_cluster(self, masters: int = 3) -> list[int]:
        """``masters`` masters, no replicas, all 16384 slots assigned; returns their ports."""
        ports: list[int] = []
        for attempt in range(masters + PORT_RACE_RETRIES):
            if len(ports) == masters:
                break
            port = cluster_port()
            try:
                self.start(
                    port,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    str(CLUSTER_NODE_TIMEOUT_MS),
                )
            except RuntimeError:
                if attempt >= masters + PORT_RACE_RETRIES - 1:
                    raise
                continue  # another process took the port (or its bus port) since it was free
            ports.append(port)
        if masters == 1:  # redis-cli --cluster create wants three: one primary takes every slot itself
            with redis.Redis(port=ports[0]) as primary:
                primary.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            self.wait_cluster_ok(ports)
            return ports
        create = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout[-2000:]}{create.stderr[-2000:]}")
        self.wait_cluster_ok(ports)
        return ports

    def wait_cluster_ok(self, ports: list[int]) -> None:
        for port in ports:
            _wait(partial(_cluster_ok, port), f"cluster not ok on port {port}")

    def start_sentinel(self, port: int, master: str, master_port: int) -> int:
        """A Sentinel monitoring ``127.0.0.1:master_port`` as ``master`` (quorum 1)."""
        conf = self.root / f"sentinel-{port}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\nsentinel monitor {master} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {master} 1000\nsentinel failover-timeout {master} 5000\n"
        )
        self.processes[port] = subprocess.Popen(
            ["redis-server", str(conf), "--sentinel", "--logfile", str(self.root / f"sentinel-{port}.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.root,
        )
        _wait(lambda: _ping(port), f"sentinel on port {port} did not answer")
        return port

    def kill(self, port: int) -> None:
        """SIGKILL, as a crash would."""
        process = self.processes.pop(port)
        process.kill()
        process.wait(10)

    def stop_all(self) -> None:
        for port in list(self.processes):
            process = self.processes.pop(port)
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
