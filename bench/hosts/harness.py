"""The harness across hosts: the client, the servers and Redis each on a host of the bed (``bench.hosts.bed``).

    python -m bench.harness.run --hosts                       # RTT 0 / 0.2 / 1 ms, then 10 Gb/s; 4 and 32 MiB; 3 rounds
    python -m bench.harness.run --hosts --rtts 1 --no-rate --chunks 4MiB --rounds 1

For each network condition a fresh bed of five hosts is built:

| host | runs |
|---|---|
| ``client`` | the measuring LMCache engine (``bench.hosts.worker``: LMCache's own RemoteBackend) |
| ``redis`` | kvpool's Redis |
| ``node1``, ``node2`` | kvpool's nodes (DRAM in each host's own /dev/shm: the client cannot map it, reads go over TCP) |
| ``server`` | the peers' servers: ``lmcache.v1.server`` (``lm://``) and a redis-server (``resp://``, ``redis://``) |

Backends: ``kvpool`` (two nodes, one on each node host: kvpool's design, a pool
striped over hosts), ``kvpool-1node`` (one node: the same server count as each
peer), and LMCache's ``lm://``, ``resp://`` and ``redis://``. Both kvpool pools have the
same DRAM in total and are filled before each chunk size, so every measured put
evicts (``bench.harness.full_pool``).

Conditions: an added round trip of 0, 0.2 and 1 ms, made by a :class:`bench.hosts.bed.DelayProxy`
(half the RTT each way) in front of every service on every backend's links (kvpool:
Redis and every node; the peers: their server), no rate limit; then RTT 0 with a
``tbf`` of 10 Gb/s on every host's link and no proxy. In each condition, the ceilings
of the path are measured first: one raw TCP stream from the client to the server
host, straight and through a proxy of that condition's delay (the proxy's own ceiling).

Rounds are interleaved: every backend runs its cells once per round, in an order
that rotates from round to round; a cell's figures are the medians over the rounds
(``bench.harness.rounds``). The worker (``bench.hosts.worker``, on the client host) runs the
harness's own cells (``bench.harness.cells``): every chunk read back is compared byte for byte. Results go to
``docs/results/hosts-<timestamp>.json``; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness.plan import (
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
from bench.harness.provenance import machine, revision
from bench.hosts.bed import JsonLines
from bench.paths import RESULTS

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


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
    """``python -m bench.hosts.worker worker`` on the client host: one JSON command in, one JSON answer out."""

    def __init__(self, bed: Any, host: str, plan: Plan, probe: bool = False) -> None:
        plan_json = json.dumps({**asdict(plan), "shapes": {k: list(v) for k, v in plan.shapes.items()}})
        argv = [sys.executable, "-m", "bench.hosts.worker", "worker", plan_json, *(["--probe"] if probe else [])]
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
        from backend.launch.processes import ServerProcess

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
    sink = [sys.executable, "-m", "bench.hosts.worker", "sink", "0.0.0.0", str(STREAM_PORT)]
    from backend.launch.processes import ServerProcess

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
    from bench.harness.rounds import combine_cells
    from bench.hosts.bed import HostBed

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
    parser = argparse.ArgumentParser(prog="python -m bench.harness.run --hosts", description=__doc__.split("\n")[0])
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
    command = "python -m bench.harness.run " + " ".join(argv)
    print(
        f"[hosts] chunks {', '.join(plan.shapes)}; batch {plan.batches[0]}; {plan.rounds} round(s); backends "
        f"{', '.join(backends)}; kvpool DRAM {dram_bytes // MIB} MiB in all (kvpool: 2 nodes on 2 hosts, "
        "half each; kvpool-1node: 1 node), filled before each chunk size",
        flush=True,
    )
    started = time.monotonic()
    load_before = os.getloadavg()
    run: dict[str, Any] = {
        "harness": "bench.hosts.harness",
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
