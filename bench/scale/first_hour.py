"""A node's first hour: are the first puts and gets into a fresh node as fast as later ones?

    python -m bench.scale.first_hour                      # --prefault off and on, 3 fresh nodes each
    python -m bench.scale.first_hour --prefault on --nodes 1 --json out.json

Each fresh node is ``kvpool up --dram DRAM --nvme 0 --prefault MODE``. Through LMCache's
own connector (``backend.lmcache.stack``: LMCache's LocalCPUBackend + RemoteBackend with the
kvpool plugin), it gets ROUNDS rounds of 8 x 32 MiB puts and then gets of the same keys,
each round on the same-host path and on the TCP path (``shm=off``), one chunk per call;
every byte read back is compared. Timing starts once the client is ready to put (its
stage made, as the connector does when it starts). With DRAM at 1 GiB the first two rounds fill the
arena for the first time and the third reuses its regions, as in service.

Then, on another fresh node of the same mode, the first 100 same-host puts of 4 MiB are
timed one by one: their p50 and p99.

Nodes of the two modes alternate (off, on, off, on, ...) so a busy minute of a shared
machine lands on both alike; figures are medians over the nodes. Printed per mode: each
round's GB/s, the median first-round GB/s over the median third-round GB/s (target:
within 20 %, i.e. >= 0.80), and the put p99 over p50 (target: <= 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import torch

from backend.launch.processes import ServerProcess
from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config
from bench.harness.peers import KVPOOL_URL_RE, LMCACHE_BLOCKING_TIMEOUT_S

MODEL = "kvpool-bench/first-hour"
CHUNK_SHAPE = (32, 8, 128)  # layers, heads, head size: 2 x 32 x 256 tokens x 1024 x bf16 = 32 MiB
SMALL_SHAPE = (8, 8, 64)  # 4 MiB
CHUNKS = 8
LATENCY_PUTS = 100
PATHS = ("shm", "tcp")
TARGET_RATIO = 0.8
TARGET_TAIL = 2.0


class FreshPool:
    """``kvpool up`` with its own Redis and one DRAM node, and LMCache stacks on both paths."""

    def __init__(self, dram: str, prefault: str) -> None:
        command = [sys.executable, "-m", "backend.cli", "up", "--dram", dram, "--nvme", "0", "--prefault", prefault]
        self.server = ServerProcess("kvpool up", command, KVPOOL_URL_RE)
        self.url = ""
        self.started_s = 0.0

    def __enter__(self) -> FreshPool:
        start = time.perf_counter()
        self.url = self.server.start().wait_ready().group(1)
        self.started_s = time.perf_counter() - start
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(signal.SIGINT)

    def stack(self, path: str, shape: tuple[int, int, int], local_cpu_gib: float) -> LMCacheStack:
        parts = urlsplit(self.url)
        if path == "tcp":
            parts = parts._replace(query="&".join(q for q in (parts.query, "shm=off") if q))
        config = kvpool_lmcache_config(urlunsplit(parts), local_cpu_gib=local_cpu_gib)
        config["blocking_timeout_secs"] = LMCACHE_BLOCKING_TIMEOUT_S
        layers, heads, head_size = shape
        stack = LMCacheStack(config, model=MODEL, num_layers=layers, hidden=(heads, head_size))
        # The connector makes its stage for a same-host node when it starts (an engine's first put comes
        # later); wait for that here, so that round 1 measures the node and not the client's start.
        asyncio.run_coroutine_threadsafe(stack.connector().client.prepare_puts(), stack.loop).result(30)
        # An engine's LMCache buffer is pinned memory on a GPU host, resident from its start: warm it here
        # too, so that round 1 does not time the engine's own page faults (LMCache allocates a buffer
        # from it for every put and get).
        stack.warm_local_buffer()
        return stack

    def prefault_line(self) -> str:
        return next((line.strip() for line in self.server.lines if line.startswith("DRAM arena:")), "")


def _put_one(stack: LMCacheStack, key: Any, obj: Any) -> float:
    start = time.perf_counter()
    stack.put([key], [obj])
    return time.perf_counter() - start


def rounds_on_a_fresh_node(dram: str, prefault: str, rounds: int) -> dict[str, Any]:
    """ROUNDS rounds of 8 x 32 MiB puts then gets, on each path; GB/s per round and path."""
    with FreshPool(dram, prefault) as pool:
        stacks = {path: pool.stack(path, CHUNK_SHAPE, 1.0) for path in PATHS}
        try:
            objs = {path: [stacks[path].make_object(i) for i in range(CHUNKS)] for path in PATHS}
            chunk_bytes = stacks["shm"].chunk_bytes
            per_round: list[dict[str, float]] = []
            mismatches = misses = 0
            for round_no in range(rounds):
                figures: dict[str, float] = {}
                for p, path in enumerate(PATHS):
                    stack = stacks[path]
                    keys = [stack.key((round_no * len(PATHS) + p) * 1000 + i) for i in range(CHUNKS)]
                    put_s = sum(_put_one(stack, key, obj) for key, obj in zip(keys, objs[path]))
                    get_s = 0.0
                    for i, key in enumerate(keys):
                        start = time.perf_counter()
                        (got,) = stack.get([key])
                        get_s += time.perf_counter() - start
                        if got is None:  # not stored: a put that failed (its error is logged)
                            misses += 1
                            continue
                        if not torch.equal(got.tensor.view(torch.uint8), objs[path][i].tensor.view(torch.uint8)):
                            mismatches += 1
                        stack.release([got])
                    figures[f"{path}_put_gbps"] = CHUNKS * chunk_bytes / put_s / 1e9
                    figures[f"{path}_get_gbps"] = CHUNKS * chunk_bytes / get_s / 1e9
                per_round.append(figures)
            for path in PATHS:
                stacks[path].release(objs[path])
        finally:
            for stack in stacks.values():
                stack.close()
        return {
            "start_s": round(pool.started_s, 2),
            "prefault": pool.prefault_line(),
            "rounds": per_round,
            "misses": misses,
            "mismatches": mismatches,
        }


def first_puts_on_a_fresh_node(dram: str, prefault: str) -> dict[str, float]:
    """The first LATENCY_PUTS same-host puts of 4 MiB into a fresh node, timed one by one (ms)."""
    with FreshPool(dram, prefault) as pool:
        stack = pool.stack("shm", SMALL_SHAPE, 0.25)
        try:
            obj = stack.make_object(0)
            times_ms = [_put_one(stack, stack.key(i), obj) * 1000 for i in range(LATENCY_PUTS)]
            stack.release([obj])
        finally:
            stack.close()
    return {"p50_ms": _quantile(times_ms, 0.50), "p99_ms": _quantile(times_ms, 0.99)}


def _quantile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(nodes: list[dict[str, Any]], latencies: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over the nodes: each round's GB/s, first over third round, put p99 over p50."""
    rounds = len(nodes[0]["rounds"])
    fields = list(nodes[0]["rounds"][0])
    per_round = [{f: statistics.median(n["rounds"][r][f] for n in nodes) for f in fields} for r in range(rounds)]
    p50 = statistics.median(lat["p50_ms"] for lat in latencies)
    p99 = statistics.median(lat["p99_ms"] for lat in latencies)
    return {
        "per_round": per_round,
        "first_over_last": {f: per_round[0][f] / per_round[-1][f] for f in fields},
        "put_p50_ms": p50,
        "put_p99_ms": p99,
        "put_p99_over_p50": p99 / p50,
        "start_s": [n["start_s"] for n in nodes],
        "prefault": [n["prefault"] for n in nodes if n["prefault"]],
        "misses": sum(n["misses"] for n in nodes),
        "mismatches": sum(n["mismatches"] for n in nodes),
    }


def render(mode: str, summary: dict[str, Any]) -> str:
    fields = list(summary["per_round"][0])
    lines = [
        f"--prefault {mode}: GB/s, median over the nodes (8 x 32 MiB per round and path)",
        "  round  " + "  ".join(f"{f.removesuffix('_gbps'):>8}" for f in fields),
    ]
    for r, figures in enumerate(summary["per_round"], 1):
        lines.append(f"  {r:>5}  " + "  ".join(f"{figures[f]:8.2f}" for f in fields))
    lines.append(
        "  r1/r"
        + str(len(summary["per_round"]))
        + "  "
        + "  ".join(f"{summary['first_over_last'][f]:8.2f}" for f in fields)
        + f"   (target >= {TARGET_RATIO})"
    )
    lines.append(
        f"  first {LATENCY_PUTS} same-host puts of 4 MiB: p50 {summary['put_p50_ms']:.1f} ms, p99 "
        f"{summary['put_p99_ms']:.1f} ms, p99/p50 {summary['put_p99_over_p50']:.2f} (target <= {TARGET_TAIL})"
    )
    lines.append(
        f"  node start (ready) s: {summary['start_s']}; chunks not stored (a put failed): "
        f"{summary['misses']}; wrong bytes: {summary['mismatches']}"
    )
    lines.extend(f"  {line}" for line in summary["prefault"][:1])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefault", default="off,on", help="modes to compare, in order (default off,on)")
    parser.add_argument("--nodes", type=int, default=3, help="fresh nodes per mode (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per node (default 3)")
    parser.add_argument("--dram", default="1GiB", help="DRAM of each node (default 1GiB)")
    parser.add_argument("--json", help="also write every node's figures here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.prefault.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes) or args.nodes < 1 or args.rounds < 2:
        parser.error("--prefault takes on/off (comma-separated); --nodes >= 1 and --rounds >= 2")
    nodes: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    latencies: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for n in range(args.nodes):  # the modes alternate, node by node
        for mode in modes:
            nodes[mode].append(rounds_on_a_fresh_node(args.dram, mode, args.rounds))
            latencies[mode].append(first_puts_on_a_fresh_node(args.dram, mode))
            print(
                f"node {n + 1}/{args.nodes} --prefault {mode}: {json.dumps(nodes[mode][-1]['rounds'])} "
                f"first puts {json.dumps(latencies[mode][-1])}",
                file=sys.stderr,
                flush=True,
            )
    summaries = {mode: summarize(nodes[mode], latencies[mode]) for mode in modes}
    print(f"bench.scale.first_hour: --dram {args.dram}, {args.nodes} fresh nodes per mode, {args.rounds} rounds each\n")
    print("\n\n".join(render(mode, summaries[mode]) for mode in modes))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"summaries": summaries, "nodes": nodes, "latencies": latencies}, out, indent=1)
    return 1 if any(s["mismatches"] for s in summaries.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
