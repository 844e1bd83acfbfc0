"""The harness across hosts: the client, the servers and Redis each on a host of the bed (``bench.hosts``).

    python -m bench.harness --hosts                       # RTT 0 / 0.2 / 1 ms, then 10 Gb/s; 4 and 32 MiB; 3 rounds
    python -m bench.harness --hosts --rtts 1 --no-rate --chunks 4MiB --rounds 1

For each network condition a fresh bed of five hosts is built:

| host | runs |
|---|---|
| ``client`` | the measuring LMCache engine (``python -m bench.hosts_harness worker``: LMCache's own RemoteBackend) |
| ``redis`` | kvpool's Redis |
| ``node1``, ``node2`` | kvpool's nodes (DRAM in each host's own /dev/shm: the client cannot map it, reads go over TCP) |
| ``server`` | the peers' servers: ``lmcache.v1.server`` (``lm://``) and a redis-server (``resp://``, ``redis://``) |

Backends: ``kvpool`` (two nodes, one on each node host: kvpool's design, a pool
striped over hosts), ``kvpool-1node`` (one node: the same server count as each
peer), and LMCache's ``lm://``, ``resp://`` and ``redis://``. Both kvpool pools have the
same DRAM in total and are filled before each chunk size, so every measured put
evicts (``bench.full_pool``).

Conditions: an added round trip of 0, 0.2 and 1 ms, made by a :class:`bench.hosts.DelayProxy`
(half the RTT each way) in front of every service on every backend's links (kvpool:
Redis and every node; the peers: their server), no rate limit; then RTT 0 with a
``tbf`` of 10 Gb/s on every host's link and no proxy. In each condition, the ceilings
of the path are measured first: one raw TCP stream from the client to the server
host, straight and through a proxy of that condition's delay (the proxy's own ceiling).

Rounds are interleaved: every backend runs its cells once per round, in an order
that rotates from round to round; a cell's figures are the medians over the rounds
(``bench.rounds``). The worker runs the harness's own cells (``bench.harness``):
every chunk read back is compared byte for byte. Results go to
``bench/results/hosts-<timestamp>.json``; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.hosts import JsonLines
from bench.plan import (
    CHUNK_SHAPES,
    GIB,
    MIB,
    REAL_ROUNDS,
    SMOKE_SHAPES,
    Plan,
    make_plan,
    parse_names,
    parse_rounds,
)
from bench.provenance import machine, revision

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

RESULTS = Path(__file__).resolve().parent / "results"

HOSTS = ("client", "redis", "node1", "node2", "server")
BACKENDS = ("kvpool", "kvpool-1node", "lm", "resp", "redis")
PEERS = ("lm", "resp")  # the targets compare kvpool with the best of these
RTTS_MS = (0.0, 0.2, 1.0)
RATE_GBIT = 10.0
KVPOOL_REDIS_PORT = 6379
PEER_REDIS_PORT = 6390
LM_PORT = 6500
NODE_PORT = 7000
ONE_NODE_PORT = 7002  # kvpool-1node's node, on node1 beside kvpool's
LM_SERVER_MAX_BYTES = 4 << 30  # lm:// cannot delete: restarted empty before it would hold more
STREAM_PORT = 9000
STREAM_BYTES = 512 * MIB
SMOKE_STREAM_BYTES = 32 * MIB
STREAM_BUFFER_BYTES = 4 * MIB
WORKER_START_TIMEOUT_S = 120.0
ROUND_TIMEOUT_S = 900.0
SHM_SLACK_BYTES = GIB


@dataclass(frozen=True)
class Condition:
    """One network condition: an added round trip through the delay proxies, or a rate without them."""

    name: str
    rtt_ms: float | None  # None: no proxy on any link
    rate_gbit: float | None  # None: no tbf

    @property
    def delay_ms(self) -> float | None:
        return None if self.rtt_ms is None else self.rtt_ms / 2


def conditions(rtts_ms: Sequence[float], rate: bool) -> list[Condition]:
    found = [Condition(f"rtt {rtt:g} ms", rtt, None) for rtt in rtts_ms]
    if rate:
        found.append(Condition(f"{RATE_GBIT:g} Gb/s", None, RATE_GBIT))
    return found


def hosts_plan(smoke: bool, chunks: Sequence[str] | None, rounds: int | None) -> Plan:
    """The harness's plan for these cells: batch 8, one client; cells sized to keep a run within minutes."""
    if smoke:
        plan = make_plan(smoke=True, quick=True, batches=[8], clients=[1], rounds=1)
    else:
        plan = replace(
            make_plan(targets=True, rounds=REAL_ROUNDS),
            cell_bytes=256 * MIB,
            min_calls=3,
            memcpy_bytes=0,
            tcp_bytes=0,
        )
    known = SMOKE_SHAPES if smoke else CHUNK_SHAPES
    if chunks:
        unknown = [c for c in chunks if c not in known]
        if unknown:
            raise ValueError(f"--chunks: unknown size(s) {unknown}; choose from {','.join(known)}")
        plan = replace(plan, shapes={c: known[c] for c in chunks})
    if rounds is not None:
        plan = replace(plan, rounds=rounds)
    return plan


# -- the parent: beds, services, the worker ----------------------------------------------------------------
class Worker(JsonLines):
    """``python -m bench.hosts_harness worker`` on the client host: one JSON command in, one JSON answer out."""

    def __init__(self, bed: Any, host: str, plan: Plan, probe: bool = False) -> None:
        plan_json = json.dumps({**asdict(plan), "shapes": {k: list(v) for k, v in plan.shapes.items()}})
        argv = [sys.executable, "-m", "bench.hosts_harness", "worker", plan_json, *(["--probe"] if probe else [])]
        super().__init__(bed.popen(host, argv), echo=True, close_wait_s=30.0)
        self.receive(WORKER_START_TIMEOUT_S)

    def call(self, op: str, timeout_s: float = ROUND_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        return super().call(op, timeout_s, **args)


class Services:
    """Every backend's servers on their hosts, for one condition; and what the worker needs to reach each."""

    def __init__(self, bed: Any, condition: Condition, backends: Sequence[str], dram_bytes: int) -> None:
        self.bed, self.condition, self.backends = bed, condition, backends
        delay = condition.delay_ms
        self.specs: dict[str, dict[str, Any]] = {}
        if {"kvpool", "kvpool-1node"} & set(backends):
            redis = bed.start_redis("redis", KVPOOL_REDIS_PORT, delay_ms=delay)
            url = f"kvpool://{redis.address}:{redis.port}"
            if "kvpool" in backends:  # two nodes, one per host, half the DRAM each
                half = f"{dram_bytes // 2 // MIB}MiB"
                for host in ("node1", "node2"):
                    bed.start_node(host, redis.url, namespace="kvpool", dram=half, port=NODE_PORT, delay_ms=delay)
                self.specs["kvpool"] = {"kind": "kvpool", "url": f"{url}/kvpool", "nodes": 2}
            if "kvpool-1node" in backends:
                whole = f"{dram_bytes // MIB}MiB"
                bed.start_node("node1", redis.url, namespace="kvpool1", dram=whole, port=ONE_NODE_PORT, delay_ms=delay)
                self.specs["kvpool-1node"] = {"kind": "kvpool", "url": f"{url}/kvpool1", "nodes": 1}
        if {"resp", "redis"} & set(backends):
            redis = bed.start_redis("server", PEER_REDIS_PORT, delay_ms=delay)
            for scheme in ("resp", "redis"):
                if scheme in backends:
                    self.specs[scheme] = {
                        "kind": "redis",
                        "scheme": scheme,
                        "address": redis.address,
                        "port": redis.port,
                    }
        self.lm: Any = None
        self.lm_port: int | None = None  # the delay proxy's port in front of it
        self.lm_stored_bytes = 0
        if "lm" in backends:
            self._start_lm()

    def _start_lm(self) -> None:
        from bench.processes import ServerProcess

        host = self.bed.hosts["server"]
        delay = self.condition.delay_ms
        # Every address of the host: the proxy (if any) reaches it on the loopback, the client on the host's.
        argv = [sys.executable, "-m", "lmcache.v1.server", "0.0.0.0", str(LM_PORT), "cpu"]
        self.lm = ServerProcess("lmcache.v1.server on server", self.bed.command("server", argv))
        self.lm.start(env={**os.environ, "LMCACHE_TRACK_USAGE": "false"})
        self.bed.processes.append(self.lm)
        if not self.bed.wait_port("server", LM_PORT, 60):
            raise RuntimeError(f"lmcache.v1.server did not listen:\n{self.lm.tail()}")
        if delay is not None and self.lm_port is None:  # one proxy, kept across restarts of the server
            self.lm_port = self.bed.expose("server", LM_PORT, delay)
        self.specs["lm"] = {"kind": "lm", "address": host.address, "port": self.lm_port or LM_PORT}
        self.lm_stored_bytes = 0

    def before_round(self, name: str, stores_bytes: int) -> None:
        """lm:// cannot delete: restart it empty when this round would take it past what it may hold."""
        if name != "lm":
            return
        if self.lm_stored_bytes and self.lm_stored_bytes + stores_bytes > LM_SERVER_MAX_BYTES:
            self.lm.stop()
            self._start_lm()
        self.lm_stored_bytes += stores_bytes


def stream_ceilings(bed: Any, worker: Worker, condition: Condition, nbytes: int) -> dict[str, float]:
    """One raw TCP stream client -> server host: straight (through any tbf), and through a delay proxy."""
    host = bed.hosts["server"]
    sink = [sys.executable, "-m", "bench.hosts_harness", "sink", "0.0.0.0", str(STREAM_PORT)]
    from bench.processes import ServerProcess

    server = ServerProcess("stream sink on server", bed.command("server", sink))
    server.start()
    bed.processes.append(server)
    if not bed.wait_port("server", STREAM_PORT, 30):
        raise RuntimeError(f"the stream sink did not listen:\n{server.tail()}")
    found = {"stream_gbps": worker.call("stream", address=host.address, port=STREAM_PORT, bytes=nbytes)["gbps"]}
    if condition.delay_ms is not None:
        public = bed.expose("server", STREAM_PORT, condition.delay_ms, public_port=STREAM_PORT + 1)
        found["proxied_stream_gbps"] = worker.call("stream", address=host.address, port=public, bytes=nbytes)["gbps"]
        found["proxied_rtt_ms"] = worker.call("ping", address=host.address, port=public)["rtt_ms"]
    found["rtt_ms"] = worker.call("ping", address=host.address, port=STREAM_PORT)["rtt_ms"]
    server.stop()
    return found


def run_condition(
    condition: Condition, plan: Plan, backends: Sequence[str], dram_bytes: int, smoke: bool, probe: bool = False
) -> dict:
    from bench.hosts import HostBed
    from bench.rounds import combine_cells

    print(f"[hosts] {condition.name}: building the bed ({', '.join(HOSTS)})", flush=True)
    shm = f"{max(4 * GIB, dram_bytes + SHM_SLACK_BYTES) // MIB}m"
    out: dict[str, Any] = {"condition": asdict(condition), "backends": {}}
    started = time.monotonic()
    with HostBed(HOSTS, shm_size=shm) as bed:
        if condition.rate_gbit is not None:
            for host in HOSTS:
                bed.set_rate(host, condition.rate_gbit)
        services = Services(bed, condition, backends, dram_bytes)
        worker = Worker(bed, "client", plan, probe)
        try:
            out["ceilings"] = stream_ceilings(bed, worker, condition, SMOKE_STREAM_BYTES if smoke else STREAM_BYTES)
            print(f"[hosts] {condition.name}: ceilings {_fmt_ceilings(out['ceilings'])}", flush=True)
            records = {name: {"status": "ok", "round_cells": [], "fills": [], "errors": []} for name in backends}
            for round_no in range(1, plan.rounds + 1):
                shift = (round_no - 1) % len(backends)
                for name in [*backends[shift:], *backends[:shift]]:
                    record = records[name]
                    if record["status"] != "ok":
                        continue
                    services.before_round(name, sum(plan.stored_bytes(s) for s in plan.shapes.values()))
                    spec = {"name": name, **services.specs[name]}
                    answer = worker.call("round", peer=spec, round=round_no)
                    record["round_cells"] += answer["round_cells"]
                    record["fills"] += answer["fills"]
                    record["errors"] += answer["errors"]
                    if answer["errors"]:
                        record["status"] = "failed"
        finally:
            worker.close()
    for name, record in records.items():
        record["cells"] = combine_cells(record.pop("round_cells")) if record["round_cells"] else []
        if name.startswith("kvpool"):
            record["nodes"] = services.specs[name]["nodes"]
        out["backends"][name] = record
    out["seconds"] = round(time.monotonic() - started, 1)
    out["ratios"] = ratios(out, plan)
    return out


# -- figures -----------------------------------------------------------------------------------------------
def _cell(out: dict[str, Any], backend: str, chunk: str) -> dict[str, Any] | None:
    record = out["backends"].get(backend)
    if record is None:
        return None
    return next((c for c in record["cells"] if c["chunk"] == chunk and "get_gbps" in c), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def ratios(out: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    """Per chunk size and kvpool pool: get and put over the best of lm://, resp://, and over redis://."""
    rows = []
    for chunk in plan.shapes:
        for pool in ("kvpool", "kvpool-1node"):
            mine = _cell(out, pool, chunk)
            if mine is None:
                continue
            row: dict[str, Any] = {"chunk": chunk, "pool": pool}
            for op in ("get", "put"):
                peers = [(c[f"{op}_gbps"], n) for n in PEERS if (c := _cell(out, n, chunk))]
                best, best_name = max(peers) if peers else (None, None)
                redis = _cell(out, "redis", chunk)
                row[f"{op}_vs_best_peer"] = _ratio(mine[f"{op}_gbps"], best)
                row[f"{op}_best_peer"] = best_name
                row[f"{op}_vs_redis"] = _ratio(mine[f"{op}_gbps"], redis[f"{op}_gbps"] if redis else None)
            rate = out["condition"]["rate_gbit"]
            if rate is not None:
                row["get_vs_link"] = mine["get_gbps"] / (rate / 8)
            rows.append(row)
    return rows


def _fmt_ceilings(ceilings: dict[str, float]) -> str:
    parts = [f"raw TCP stream {ceilings['stream_gbps']:.2f} GB/s (RTT {ceilings['rtt_ms']:.2f} ms)"]
    if "proxied_stream_gbps" in ceilings:
        parts.append(
            f"through the delay proxy {ceilings['proxied_stream_gbps']:.2f} GB/s (RTT {ceilings['proxied_rtt_ms']:.2f} ms)"
        )
    return "; ".join(parts)


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(run: dict[str, Any]) -> str:
    """The tables: per condition and chunk size, each backend's GB/s and p50 ms, then kvpool's ratios."""
    lines = [
        "| condition | chunk | backend | nodes | get GB/s | put GB/s | get p50 ms | put p50 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for out in run["conditions"]:
        name = out["condition"]["name"]
        for chunk in run["plan"]["shapes"]:
            for backend, record in out["backends"].items():
                cell = _cell(out, backend, chunk)
                if cell is None:
                    lines.append(f"| {name} | {chunk} | {backend} | | {record['status']} | | | |")
                    continue
                nodes = str(record.get("nodes", 1))
                lines.append(
                    f"| {name} | {chunk} | {backend} | {nodes} | {_f(cell['get_gbps'])} | {_f(cell['put_gbps'])} | "
                    f"{_f(cell['get_ms']['p50'], 1)} | {_f(cell['put_ms']['p50'], 1)} |"
                )
    lines += [
        "",
        "| condition | chunk | pool | get / best peer | put / best peer | get / redis:// | put / redis:// | get / link |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for out in run["conditions"]:
        name = out["condition"]["name"]
        for r in out["ratios"]:
            lines.append(
                f"| {name} | {r['chunk']} | {r['pool']} | {_f(r['get_vs_best_peer'])} ({r['get_best_peer']}) | "
                f"{_f(r['put_vs_best_peer'])} ({r['put_best_peer']}) | {_f(r['get_vs_redis'])} | "
                f"{_f(r['put_vs_redis'])} | {_f(r.get('get_vs_link'))} |"
            )
    lines += ["", "Ceilings of the path (client -> server host, one raw TCP stream):"]
    for out in run["conditions"]:
        lines.append(f"  {out['condition']['name']}: {_fmt_ceilings(out['ceilings'])}")
    return "\n".join(lines)


def failures(run: dict[str, Any]) -> list[str]:
    found = []
    for out in run["conditions"]:
        where = out["condition"]["name"]
        for name, record in out["backends"].items():
            found += [f"{where} {name}: {e}" for e in record["errors"]]
            for cell in record["cells"]:
                if cell["misses"] or cell["mismatches"] or cell["errors"]:
                    found.append(
                        f"{where} {name} {cell['chunk']}: {cell['misses']} misses, {cell['mismatches']} differ, "
                        f"errors {cell['errors']}"
                    )
    return found


def targets(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, as measured by the 2-node pool (kvpool)."""
    found = []
    for out in run["conditions"]:
        cond = out["condition"]
        for r in out["ratios"]:
            if r["pool"] != "kvpool":
                continue
            if cond["rtt_ms"] == 1.0:
                want_get = 1.3 if r["chunk"] == "4MiB" else 1.0
                found.append(_target(f"get at 1 ms RTT, {r['chunk']}", r["get_vs_best_peer"], want_get))
                found.append(_target(f"put at 1 ms RTT, {r['chunk']}", r["put_vs_best_peer"], 1.3))
            if cond["rate_gbit"] is not None and "get_vs_link" in r:
                found.append(_target(f"get at {cond['rate_gbit']:g} Gb/s, {r['chunk']}", r["get_vs_link"], 0.9))
    return found


def _target(what: str, value: float | None, want: float) -> dict[str, Any]:
    return {"target": what, "measured": value, "wanted": want, "met": value is not None and value >= want}


# -- the worker (on the client host) -----------------------------------------------------------------------
def _worker_peer(spec: dict[str, Any]) -> Any:
    """The harness's peer for a service on another host (started by the parent: start and stop do nothing)."""
    from bench.full_pool import FullPool
    from bench.peers import KVPoolPeer, LMServerPeer, RedisPeer, SharedRedis

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
    from bench import cells

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
    from bench.cells import base_bytes

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
    if "bench.hosts" in text and "delay" in argv:
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
        from bench.cells import command_calls

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
    from backend.client.connection import NodePool
    from backend.protocol import Op
    from bench import cells
    from bench.lmcache_stack import LMCacheStack

    run_cell, put, get, request = cells.run_cell, LMCacheStack.put, LMCacheStack.get, NodePool.request

    def probed_put(stack: Any, *args: Any, **kwargs: Any) -> Any:
        if Probe.active is None:
            return put(stack, *args, **kwargs)
        return Probe.active.timed("put", lambda: put(stack, *args, **kwargs))

    def probed_get(stack: Any, *args: Any, **kwargs: Any) -> Any:
        if Probe.active is None:
            return get(stack, *args, **kwargs)
        return Probe.active.timed("get", lambda: get(stack, *args, **kwargs))

    async def probed_request(pool: Any, op: int, meta: bytes, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await request(pool, op, meta, **kwargs)
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
    NodePool.request = probed_request  # type: ignore[method-assign]


_probe_spec: dict[str, Any] = {}  # the backend the worker's current round measures


# -- the command -------------------------------------------------------------------------------------------
def parse_rtts(text: str) -> list[float]:
    try:
        rtts = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated milliseconds, e.g. 0,0.2,1") from None
    if not rtts or min(rtts) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected milliseconds >= 0, e.g. 0,0.2,1")
    return rtts


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        serve_worker(argv[1], probe="--probe" in argv[2:])
        return 0
    if argv[:1] == ["sink"]:
        serve_sink(argv[1], int(argv[2]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.harness --hosts", description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", action="store_true", help="(this mode)")
    parser.add_argument("--rtts", type=parse_rtts, default=list(RTTS_MS), help="added RTTs in ms (default 0,0.2,1)")
    parser.add_argument("--no-rate", action="store_true", help=f"skip the {RATE_GBIT:g} Gb/s condition")
    parser.add_argument("--chunks", type=parse_names, help="chunk sizes (default 4MiB,32MiB; with --smoke 16KiB)")
    parser.add_argument("--rounds", type=parse_rounds, help="interleaved rounds (default 3; 1 with --smoke)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    parser.add_argument("--smoke", action="store_true", help="tiny chunks, one round (for tests)")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="per cell: CPU per bed process, Redis commands and node requests per put and get (diagnostic)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results directory (default {RESULTS})")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        parser.error(f"--backends: unknown {unknown}; choose from {','.join(BACKENDS)}")
    try:
        plan = hosts_plan(args.smoke, args.chunks, args.rounds)
    except ValueError as exc:
        parser.error(str(exc))
    dram_bytes = plan.kvpool_dram_bytes()
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    command = "python -m bench.harness " + " ".join(argv)
    print(
        f"[hosts] chunks {', '.join(plan.shapes)}; batch {plan.batches[0]}; {plan.rounds} round(s); backends "
        f"{', '.join(backends)}; kvpool DRAM {dram_bytes // MIB} MiB in all (kvpool: 2 nodes on 2 hosts, "
        "half each; kvpool-1node: 1 node), filled before each chunk size",
        flush=True,
    )
    started = time.monotonic()
    load_before = os.getloadavg()
    run: dict[str, Any] = {
        "harness": "bench.hosts_harness",
        "started": stamp,
        "command": command,
        "plan": {**asdict(plan), "kvpool_dram_bytes": dram_bytes, "smoke": args.smoke},
        "machine": machine(),
        "revision": revision(),
        "hosts": list(HOSTS),
        "conditions": [],
    }
    broken = []
    for condition in conditions(args.rtts, not args.no_rate):
        try:
            run["conditions"].append(run_condition(condition, plan, backends, dram_bytes, args.smoke, args.probe))
        except Exception as exc:  # one condition that cannot run must not lose the others' figures
            traceback.print_exc()
            broken.append(f"{condition.name}: {exc!r}")
    run["seconds"] = round(time.monotonic() - started, 1)
    run["load_average"] = {"before": load_before, "after": os.getloadavg()}
    run["targets"] = targets(run)
    run["failures"] = broken + failures(run)
    run["ok"] = not run["failures"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"hosts-{stamp}.json"
    path.write_text(json.dumps(run, indent=2) + "\n")
    print()
    print(render(run))
    for t in run["targets"]:
        print(
            f"[hosts] target {t['target']}: {_f(t['measured'])} (want >= {t['wanted']}) {'met' if t['met'] else 'MISSED'}"
        )
    print(f"[hosts] {run['seconds']:.0f} s; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"[hosts] results: {path}")
    if run["failures"]:
        print("[hosts] FAILED:\n  " + "\n  ".join(run["failures"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
