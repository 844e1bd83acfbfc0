"""The client host's side of ``python -m bench.harness.run --hosts``: the worker, the stream sink, the probe.

    python -m bench.hosts.worker worker PLAN_JSON [--probe]   # the measuring LMCache engine (bench.hosts.harness starts it)
    python -m bench.hosts.worker sink ADDRESS PORT            # the far end of the path's raw TCP stream

The worker answers the parent's commands, one JSON line in and one out: a round of a
backend's cells (``bench.harness.cells``: every chunk read back is compared byte for byte), a
raw TCP stream to the sink, a ping. The parent (``bench.hosts.harness``) starts it on the
bed's client host and never imports it: the two share the plan (``bench.harness.plan``) only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.harness.plan import MIB, Plan

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

STREAM_BUFFER_BYTES = 4 * MIB


# -- the worker (on the client host) -----------------------------------------------------------------------
def _worker_peer(spec: dict[str, Any]) -> Any:
    """The harness's peer for a service on another host (started by the parent: start and stop do nothing)."""
    from bench.harness.full_pool import FullPool
    from bench.harness.peers import KVPoolPeer, LMServerPeer, RedisPeer, SharedRedis

    if spec["kind"] == "kvpool":
        peer = KVPoolPeer("0")
        peer.name, peer.url = spec["name"], spec["url"]
        peer.full = FullPool(peer.url)
        return peer

    if spec["kind"] == "redis":

        class HostRedisPeer(RedisPeer):
            @property
            def redis_port(self) -> int | None:
                return int(spec["port"])

            def lmcache_config(self, local_cpu_gib: float, *, redis_port: int | None = None) -> dict[str, Any]:
                config = super().lmcache_config(local_cpu_gib)
                config["remote_url"] = f"{self.scheme}://{spec['address']}:{spec['port']}"
                return config

            def clear(self, stack: Any, keys: Sequence[Any]) -> None:
                import redis

                with redis.Redis(host=spec["address"], port=spec["port"], socket_timeout=30) as client:
                    client.flushall()

        return HostRedisPeer(spec["scheme"], SharedRedis())

    class HostLMPeer(LMServerPeer):
        def lmcache_config(self, local_cpu_gib: float, *, redis_port: int | None = None) -> dict[str, Any]:
            return {**super().lmcache_config(local_cpu_gib), "remote_url": f"lm://{spec['address']}:{spec['port']}"}

        def new_chunk_size(self, store_bytes: int) -> None:
            """The parent restarts the server when it would hold too much."""

    return HostLMPeer()


def worker_round(plan: Plan, bases: dict[str, Any], spec: dict[str, Any], round_no: int) -> dict[str, Any]:
    from bench.harness import cells

    peer = _worker_peer(spec)
    _probe_spec.clear()
    _probe_spec.update(spec)
    out: dict[str, Any] = {"round_cells": [], "fills": [], "errors": [], "seconds": 0.0}
    try:
        cells.run_cells(peer, plan, bases, round_no, out)
    except Exception as exc:
        import traceback

        traceback.print_exc(file=sys.stderr)
        out["errors"].append(f"round {round_no}: {exc!r}")
    finally:
        if getattr(peer, "full", None) is not None:
            peer.full.close()
    for cell in out["round_cells"]:
        if cell.get("errors"):
            out["errors"] += [f"{cell['chunk']}: {e}" for e in cell["errors"]]
    return out


def stream(address: str, port: int, nbytes: int) -> float:
    """GB/s of one TCP stream of ``nbytes`` to a sink, until the sink acknowledged the last byte."""
    payload = memoryview(bytearray(os.urandom(1024)) * (STREAM_BUFFER_BYTES // 1024))
    with socket.create_connection((address, port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sock.sendall(nbytes.to_bytes(8, "little"))
        sent = 0
        while sent < nbytes:
            piece = payload[: min(len(payload), nbytes - sent)]
            sock.sendall(piece)
            sent += len(piece)
        if sock.recv(1) != b"k":
            raise RuntimeError("the sink did not acknowledge the stream")
        return nbytes / (time.perf_counter() - start) / 1e9


def ping(address: str, port: int, repeats: int = 20) -> float:
    """Median ms of a 1-byte request and its 1-byte answer over one connection (the sink echoes)."""
    with socket.create_connection((address, port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall((0).to_bytes(8, "little"))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sock.sendall(b"p")
            if sock.recv(1) != b"p":
                raise RuntimeError("the sink did not echo")
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)


def _serve_one(conn: socket.socket) -> None:
    """A stream: an 8-byte length, that many bytes, then b'k'; length 0: echo single bytes until the end."""
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = b""
        while len(header) < 8:
            got = conn.recv(8 - len(header))
            if not got:
                return
            header += got
        total = int.from_bytes(header, "little")
        if total == 0:
            while byte := conn.recv(1):
                conn.sendall(byte)
            return
        sink = memoryview(bytearray(STREAM_BUFFER_BYTES))
        left = total
        while left:
            n = conn.recv_into(sink[: min(len(sink), left)])
            if n == 0:
                return
            left -= n
        conn.sendall(b"k")


def serve_sink(address: str, port: int) -> None:
    listener = socket.create_server((address, port), backlog=16)
    print(f"listening on {address}:{port}", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def serve_worker(plan_json: str, probe: bool = False) -> None:
    """Answer the parent's commands (JSON lines on stdin) with one JSON line each on stdout."""
    import logging

    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench.harness.cells import base_bytes

    fields = json.loads(plan_json)
    fields["shapes"] = {k: tuple(v) for k, v in fields["shapes"].items()}
    for name in ("batches", "clients"):
        fields[name] = tuple(fields[name])
    plan = Plan(**fields)
    bases = {size: base_bytes(shape) for size, shape in plan.shapes.items()}
    if probe:
        install_probe()
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # the harness's progress lines go to the log; stdout carries answers only
    real_stdout.write(json.dumps({"ready": True}) + "\n")
    real_stdout.flush()
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "round":
            answer: dict[str, Any] = worker_round(plan, bases, command["peer"], command["round"])
        elif op == "stream":
            answer = {"gbps": max(stream(command["address"], command["port"], command["bytes"]) for _ in range(2))}
        elif op == "ping":
            answer = {"rtt_ms": ping(command["address"], command["port"])}
        else:
            answer = {"error": f"unknown op {op!r}"}
        real_stdout.write(json.dumps(answer) + "\n")
        real_stdout.flush()


# -- the probe (``--probe``): what a cell's puts and gets cost, per process and in round trips ---------------
# Diagnostic, not for the table: it reads /proc around every timed call (about 0.1 ms) and Redis's
# commandstats around every cell.
def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (every core and process, interrupts included)."""
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    return (sum(cpu) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _process_name(argv: list[str]) -> str | None:
    """What a process the parent started on the bed is, from its command line (None: not one of ours)."""
    text = " ".join(argv)
    if argv and "redis-server" in argv[0]:  # redis-server rewrites its command line to "redis-server ADDR:PORT"
        return f"redis {text.split()[-1]}"
    if "bench.hosts.bed" in text and "delay" in argv:
        return f"proxy {argv[argv.index('delay') + 1]}"
    if "backend.cli" in text and "node" in argv:
        where = argv[argv.index("--advertise") + 1] if "--advertise" in argv else argv[argv.index("--host") + 1]
        return f"node {where} ({argv[argv.index('--namespace') + 1]})"
    if "lmcache.v1.server" in text:
        return "lmcache.v1.server"
    return None


def bed_processes() -> dict[int, str]:
    """The worker and its siblings (what the parent started on the bed's hosts), by pid."""
    parent = os.getppid()
    found = {os.getpid(): "client (LMCache + the backend's client)"}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                argv = f.read().split("\0")[:-1]
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and (name := _process_name(argv)) is not None:
            found[int(entry)] = name
    return found


class Probe:
    """Per phase (put, get) of a cell: CPU seconds per bed process, the machine's busy cores, node requests."""

    active: Probe | None = None

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.pids = bed_processes()
        self.wall_s: Counter[str] = Counter()
        self.busy_s: Counter[str] = Counter()
        self.cpu_s: dict[str, Counter[str]] = {"put": Counter(), "get": Counter()}
        self.requests: dict[str, Counter[str]] = {"put": Counter(), "get": Counter()}
        self.request_s: dict[str, Counter[str]] = {"put": Counter(), "get": Counter()}
        self.phase = "put"
        self.commands = self._redis_commands()

    def _redis_commands(self) -> dict[str, int]:
        if self.spec["kind"] != "kvpool":
            return {}
        import redis

        from backend.config import PoolConfig
        from bench.harness.cells import command_calls

        with redis.Redis.from_url(PoolConfig.from_url(self.spec["url"]).redis_url, socket_timeout=30) as client:
            return command_calls(client)

    def timed(self, phase: str, call: Any) -> Any:
        """Run one timed call of the harness (a put or a get) and charge what it cost to ``phase``."""
        self.phase = phase
        cpu = {pid: _proc_cpu_s(pid) for pid in self.pids}
        busy, start = _machine_busy_s(), time.perf_counter()
        try:
            return call()
        finally:
            self.wall_s[phase] += time.perf_counter() - start
            self.busy_s[phase] += _machine_busy_s() - busy
            for pid, name in self.pids.items():
                with contextlib.suppress(OSError):
                    self.cpu_s[phase][name] += _proc_cpu_s(pid) - cpu[pid]

    def report(self, calls: int) -> dict[str, Any]:
        after = self._redis_commands()
        skip = {"info", "client|setinfo", "client|setname", "hello"}
        out: dict[str, Any] = {
            "redis_commands_per_put_and_get": {
                k: round((v - self.commands.get(k, 0)) / calls, 2)
                for k, v in sorted(after.items())
                if v != self.commands.get(k, 0) and k not in skip
            }
        }
        for phase in ("put", "get"):
            wall = self.wall_s[phase] or 1e-9
            out[phase] = {
                "ms_per_call": round(wall / calls * 1000, 1),
                "machine_busy_cores": round(self.busy_s[phase] / wall, 2),
                "bed_cpu_cores": round(sum(self.cpu_s[phase].values()) / wall, 2),
                "cpu_ms_per_call": {n: round(s / calls * 1000, 1) for n, s in sorted(self.cpu_s[phase].items())},
                "node_requests_per_call": {k: round(v / calls, 2) for k, v in sorted(self.requests[phase].items())},
                "node_request_ms": {
                    k: round(self.request_s[phase][k] / v * 1000, 2) for k, v in sorted(self.requests[phase].items())
                },
            }
        return out


def install_probe() -> None:
    """Wrap the harness's cells, the stack's put and get, and the client's node requests with :class:`Probe`."""
    from backend.client.connection import NodeConnectionSet
    from backend.lmcache.stack import LMCacheStack
    from backend.protocol import Op
    from bench.harness import cells

    run_cell, put, get, request = cells.run_cell, LMCacheStack.put, LMCacheStack.get, NodeConnectionSet.request

    def probed_put(stack: Any, *args: Any, **kwargs: Any) -> Any:
        if Probe.active is None:
            return put(stack, *args, **kwargs)
        return Probe.active.timed("put", lambda: put(stack, *args, **kwargs))

    def probed_get(stack: Any, *args: Any, **kwargs: Any) -> Any:
        if Probe.active is None:
            return get(stack, *args, **kwargs)
        return Probe.active.timed("get", lambda: get(stack, *args, **kwargs))

    async def probed_request(conns: Any, op: int, meta: bytes, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await request(conns, op, meta, **kwargs)
        finally:
            if (probe := Probe.active) is not None:
                probe.requests[probe.phase][Op(op).name] += 1
                probe.request_s[probe.phase][Op(op).name] += time.perf_counter() - start

    def probed_cell(stacks: Any, base: Any, round_no: int, cell_no: int, batch: int, clients: int, calls: int) -> Any:
        Probe.active = Probe(_probe_spec)
        try:
            cell, keys = run_cell(stacks, base, round_no, cell_no, batch, clients, calls)
            cell["probe"] = Probe.active.report(calls * clients)
        finally:
            Probe.active = None
        print(f"[probe] {_probe_spec['name']} {json.dumps(cell['probe'])}", flush=True)
        return cell, keys

    cells.run_cell = probed_cell
    LMCacheStack.put = probed_put  # type: ignore[method-assign]
    LMCacheStack.get = probed_get  # type: ignore[method-assign]
    NodeConnectionSet.request = probed_request  # type: ignore[method-assign]


_probe_spec: dict[str, Any] = {}  # the backend the worker's current round measures


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"] and len(argv) >= 2:
        serve_worker(argv[1], probe="--probe" in argv[2:])
        return 0
    if argv[:1] == ["sink"] and len(argv) == 3:
        serve_sink(argv[1], int(argv[2]))
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
