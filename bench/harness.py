"""LMCache's storage backends side by side, each driven by LMCache's own code.

    python -m bench.harness                      # full sweep (minutes)
    python -m bench.harness --quick              # 4 MiB chunks, batch 1 and 8, one client: under 2 minutes
    python -m bench.harness --smoke              # tiny chunks, few rounds (the tests run --quick --smoke)
    python -m bench.harness --backends kvpool,redis

For each backend (kvpool, LMCache's redis://, resp://, lm://, fs://, and Mooncake when
it is installed) the harness starts its server, builds LMCache's storage with
``CreateStorageBackends`` (``bench.lmcache_stack``: a LocalCPUBackend and a
RemoteBackend) and moves KV-shaped bf16 memory objects from LMCache's allocator:

* put and get GB/s and p50/p99 latency per operation, for every chunk size x batch x
  client count; every chunk read back is compared byte for byte with what was
  written (a miss or a difference fails the run);
* ``batched_async_contains`` latency for 1,000 stored keys, and for Redis-backed
  stores the Redis commands (``INFO commandstats`` deltas) and round trips
  (``bench.resp_proxy``) that one lookup costs;
* in the same run, the machine's ceilings (``bench.ceilings``): memcpy and one TCP
  stream over loopback.

Concurrent clients are separate LMCache stacks (own connector, connections and event
loop) in this process, one driver thread each; every round starts on a barrier and
its time is the first start to the last finish, so byte checks are never timed.
Results go to ``bench/results/harness-<timestamp>.json`` (and ``.png`` when
matplotlib is installed); ``bench.report`` prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import math
import os
import platform
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import redis
import torch

from bench import report
from bench.ceilings import memcpy_gbps, tcp_loopback_gbps
from bench.lmcache_stack import LMCacheStack
from bench.peers import PEER_NAMES, Peer, make_peers
from bench.resp_proxy import CountingProxy

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MODEL = "kvpool-bench/model"
TOKENS = 256
MIB, GIB = 1 << 20, 1 << 30

# Chunk = [2, layers, 256 tokens, heads * head_size] bf16 = 1024 * layers * heads * head_size bytes.
CHUNK_SHAPES: dict[str, tuple[int, int, int]] = {
    "256KiB": (2, 1, 128),
    "4MiB": (4, 8, 128),
    "32MiB": (32, 8, 128),  # one 256-token chunk of an 8B model (32 layers, 8 KV heads of 128)
}
SMOKE_SHAPES: dict[str, tuple[int, int, int]] = {"16KiB": (1, 1, 16), "64KiB": (1, 2, 32)}
LOOKUP_SHAPE = (1, 1, 16)  # 16 KiB chunks: a lookup only sees keys
LOOKUP_PUT_BATCH = 50
STAMP_BYTES = 16
STAMP_MAGIC = b"kvpbench"

PUT_TIMEOUT_S = 120.0
BARRIER_TIMEOUT_S = 300.0
CLOSE_TIMEOUT_S = 3.0
ROUND_TRIP_SETTLE_S = 0.05  # lets a lookup's background work reach the proxy before counting stops


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    mode: str
    shapes: dict[str, tuple[int, int, int]]
    batches: tuple[int, ...]
    clients: tuple[int, ...]
    cell_bytes: int  # bytes each cell moves per direction; rounds are sized from it
    min_rounds: int
    max_rounds: int
    lookup_keys: int
    lookup_repeats: int
    memcpy_bytes: int
    tcp_bytes: int

    def rounds(self, chunk_bytes: int, batch: int, clients: int) -> int:
        wanted = math.ceil(self.cell_bytes / (chunk_bytes * batch * clients))
        return max(self.min_rounds, min(self.max_rounds, wanted))

    def largest_cell_bytes(self) -> int:
        return max(
            chunk_bytes(shape) * batch * clients * self.rounds(chunk_bytes(shape), batch, clients)
            for shape in self.shapes.values() for batch in self.batches for clients in self.clients
        )  # fmt: skip


def make_plan(quick: bool, smoke: bool) -> Plan:
    if smoke:
        shapes = {"16KiB": SMOKE_SHAPES["16KiB"]} if quick else SMOKE_SHAPES
        return Plan("quick" if quick else "full", shapes, (1, 8), (1,) if quick else (1, 4),
                    cell_bytes=MIB, min_rounds=2, max_rounds=8, lookup_keys=100, lookup_repeats=2,
                    memcpy_bytes=16 * MIB, tcp_bytes=64 * MIB)  # fmt: skip
    if quick:
        return Plan("quick", {"4MiB": CHUNK_SHAPES["4MiB"]}, (1, 8), (1,), cell_bytes=512 * MIB,
                    min_rounds=5, max_rounds=100, lookup_keys=1000, lookup_repeats=5,
                    memcpy_bytes=256 * MIB, tcp_bytes=GIB)  # fmt: skip
    return Plan("full", dict(CHUNK_SHAPES), (1, 8), (1, 4), cell_bytes=512 * MIB, min_rounds=2,
                max_rounds=100, lookup_keys=1000, lookup_repeats=5, memcpy_bytes=256 * MIB,
                tcp_bytes=GIB)  # fmt: skip


def chunk_bytes(shape: tuple[int, int, int]) -> int:
    layers, heads, head_size = shape
    return 2 * layers * TOKENS * heads * head_size * torch.bfloat16.itemsize


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_ms(samples_s: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "n": len(ms)}


# -- LMCache stacks ---------------------------------------------------------------------
def local_cpu_gib(chunk: int, batch: int) -> float:
    """LMCache's local buffer for one client: the batch being put plus the batch being read, and slack.

    ``allocate()`` waits for as long as this buffer is full, so it must hold all in flight.
    """
    return round((2 * batch * chunk * 1.25 + 64 * MIB) / GIB, 3)


def build_stack(peer: Peer, shape: tuple[int, int, int], gib: float, *, redis_port: int | None = None) -> LMCacheStack:
    layers, heads, head_size = shape
    return LMCacheStack(peer.lmcache_config(gib, redis_port=redis_port), model=MODEL, num_layers=layers,
                        hidden=(heads, head_size))  # fmt: skip


def allocate(stack: LMCacheStack) -> Any:
    """A memory object from LMCache's allocator, never waiting on a full buffer."""
    from lmcache.v1.memory_management import MemoryFormat

    obj = stack.local.allocate(stack.shape, stack.dtype, MemoryFormat.KV_2LTD, busy_loop=False)
    if obj is None:
        raise RuntimeError(f"LMCache's local buffer is full ({stack.config.max_local_cpu_size} GiB)")
    return obj


def close_stack(stack: LMCacheStack) -> None:
    """Close a stack with a bound on every step.

    LMCache's redis:// and resp:// connectors deadlock in ``close()``: it calls the
    blocking ``AsyncPQExecutor.shutdown`` on their own event loop, which then never
    runs again. For those, the same steps run here without the blocking call, and
    ``RemoteBackend.close`` is skipped.
    """
    conn = stack.connector()
    executor = getattr(conn, "pq_executor", None)
    if executor is not None:

        async def shutdown() -> None:
            await executor.shutdown_async(wait=True)
            client = getattr(conn, "client", None)  # resp://: the native client
            if client is not None:
                client.close()
            connection = getattr(conn, "connection", None)  # redis://: redis.asyncio.Redis
            if connection is not None:
                await connection.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), stack.loop).result(CLOSE_TIMEOUT_S)
        except Exception as exc:  # a slow or failing close must not stop the run
            print(f"[harness] closing {type(conn).__name__} did not finish cleanly: {exc!r}", flush=True)
        stack.remote.close = lambda: None  # already shut down above; LMCache's close would deadlock
    stack.close(CLOSE_TIMEOUT_S)


# -- byte checks ------------------------------------------------------------------------
def stamp_of(key_hash: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(struct.pack("<Q", key_hash) + STAMP_MAGIC), dtype=torch.uint8)


def byte_view(obj: Any) -> torch.Tensor:
    return obj.tensor.view(torch.uint8).reshape(-1)


def stamp(obj: Any, key_hash: int) -> None:
    """Mark both ends of a chunk with its key, so that a chunk read under the wrong key shows."""
    view = byte_view(obj)
    mark = stamp_of(key_hash)
    view[:STAMP_BYTES] = mark
    view[-STAMP_BYTES:] = mark


def identical(obj: Any, base: torch.Tensor, key_hash: int) -> bool:
    view = byte_view(obj)
    if view.numel() != base.numel():
        return False
    mark = stamp_of(key_hash)
    return bool(
        torch.equal(view[:STAMP_BYTES], mark)
        and torch.equal(view[-STAMP_BYTES:], mark)
        and torch.equal(view[STAMP_BYTES:-STAMP_BYTES], base[STAMP_BYTES:-STAMP_BYTES])
    )


def base_bytes(shape: tuple[int, int, int]) -> torch.Tensor:
    """Random bf16 KV data of a chunk, as bytes (seeded: the same in every run)."""
    layers, heads, head_size = shape
    gen = torch.Generator().manual_seed(sum(shape))
    kv = torch.randn((2, layers, TOKENS, heads * head_size), generator=gen).to(torch.bfloat16)
    return kv.view(torch.uint8).reshape(-1).clone()


# -- one cell: chunk size x batch x clients ----------------------------------------------
def key_hash(cell: int, client: int, round_no: int, slot: int) -> int:
    return (cell << 40) | (client << 32) | (round_no << 8) | slot


class _Rounds:
    """Per-round start/end times of every client, and what the byte checks found."""

    def __init__(self, clients: int, rounds: int) -> None:
        self.put = [[(0.0, 0.0)] * rounds for _ in range(clients)]
        self.get = [[(0.0, 0.0)] * rounds for _ in range(clients)]
        self.misses = [0] * clients
        self.mismatches = [0] * clients
        self.errors: list[str] = []

    @staticmethod
    def wall_s(times: list[list[tuple[float, float]]]) -> float:
        """Sum over rounds of first start to last finish."""
        return sum(max(c[r][1] for c in times) - min(c[r][0] for c in times) for r in range(len(times[0])))

    @staticmethod
    def op_s(times: list[list[tuple[float, float]]]) -> list[float]:
        return [end - start for client in times for start, end in client]


def run_cell(
    stacks: Sequence[LMCacheStack], base: torch.Tensor, cell: int, batch: int, clients: int, rounds: int
) -> tuple[dict[str, Any], list[Any]]:
    """Every client puts ``rounds`` batches, then reads them back; returns the figures and the keys used."""
    record = _Rounds(clients, rounds)
    barrier = threading.Barrier(clients, timeout=BARRIER_TIMEOUT_S)
    keys = [[[stacks[c].key(key_hash(cell, c, r, s)) for s in range(batch)] for r in range(rounds)]
            for c in range(clients)]  # fmt: skip

    def client(c: int) -> None:
        stack = stacks[c]
        objs: list[Any] = []
        try:
            for _ in range(batch):
                objs.append(allocate(stack))
                byte_view(objs[-1]).copy_(base)
            for r in range(rounds):
                for s, obj in enumerate(objs):
                    stamp(obj, key_hash(cell, c, r, s))
                barrier.wait()
                start = time.perf_counter()
                stack.put(keys[c][r], objs, timeout_s=PUT_TIMEOUT_S)
                record.put[c][r] = (start, time.perf_counter())
            for r in range(rounds):
                barrier.wait()
                start = time.perf_counter()
                got = stack.get(keys[c][r])
                record.get[c][r] = (start, time.perf_counter())
                try:
                    for s, obj in enumerate(got):
                        if obj is None:
                            record.misses[c] += 1
                        elif not identical(obj, base, key_hash(cell, c, r, s)):
                            record.mismatches[c] += 1
                finally:
                    stack.release(got)
        except Exception as exc:
            record.errors.append(f"client {c}: {exc!r}")
            barrier.abort()
        finally:
            stack.release(objs)

    threads = [threading.Thread(target=client, args=(c,), name=f"bench-client-{c}", daemon=True)
               for c in range(clients)]  # fmt: skip
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S * (2 * rounds + 1)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            record.errors.append(f"{thread.name} did not finish")
    moved = stacks[0].chunk_bytes * batch * clients * rounds
    result: dict[str, Any] = {
        "batch": batch,
        "clients": clients,
        "rounds": rounds,
        "chunks_read": batch * clients * rounds,
        "misses": sum(record.misses),
        "mismatches": sum(record.mismatches),
        "errors": record.errors,
    }
    if not record.errors:
        result["put_gbps"] = moved / record.wall_s(record.put) / 1e9
        result["get_gbps"] = moved / record.wall_s(record.get) / 1e9
        result["put_ms"] = latency_ms(record.op_s(record.put))
        result["get_ms"] = latency_ms(record.op_s(record.get))
    return result, [k for per_client in keys for per_round in per_client for k in per_round]


# -- lookups ----------------------------------------------------------------------------
def command_calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def measure_lookup(peer: Peer, plan: Plan) -> dict[str, Any]:
    """``batched_async_contains`` over ``plan.lookup_keys`` stored keys: latency, Redis commands, round trips."""
    gib = local_cpu_gib(chunk_bytes(LOOKUP_SHAPE), LOOKUP_PUT_BATCH)
    stack = build_stack(peer, LOOKUP_SHAPE, gib)
    keys = [stack.key((1 << 62) | i) for i in range(plan.lookup_keys)]
    result: dict[str, Any] = {"keys": len(keys)}
    try:
        objs = [allocate(stack) for _ in range(LOOKUP_PUT_BATCH)]
        try:
            for start in range(0, len(keys), LOOKUP_PUT_BATCH):
                batch = keys[start : start + LOOKUP_PUT_BATCH]
                stack.put(batch, objs[: len(batch)], timeout_s=PUT_TIMEOUT_S)
        finally:
            stack.release(objs)
        stack.contains_prefix(keys)  # warm: connections open, caches filled
        times_s, hits = [], []
        for _ in range(plan.lookup_repeats):
            start = time.perf_counter()
            hits.append(stack.contains_prefix(keys))
            times_s.append(time.perf_counter() - start)
        result["hit_prefix"] = min(hits)
        result["ms"] = latency_ms(times_s)
        if peer.redis_port is not None:
            result.update(count_round_trips(peer, keys))
    finally:
        peer.clear(stack, keys)
        close_stack(stack)
    return result


def count_round_trips(peer: Peer, keys: Sequence[Any]) -> dict[str, Any]:
    """One lookup through a counting proxy: Redis round trips (proxy) and commands (INFO commandstats)."""
    assert peer.redis_port is not None
    # One connection for both INFOs, opened first, so that only INFO itself is ours (and left out).
    with CountingProxy(peer.redis_port) as proxy, redis.Redis(port=peer.redis_port, socket_timeout=10) as info:
        command_calls(info)
        gib = local_cpu_gib(chunk_bytes(LOOKUP_SHAPE), 1)
        stack = build_stack(peer, LOOKUP_SHAPE, gib, redis_port=proxy.port)
        try:
            stack.contains_prefix(keys[:1])  # warm: connections open, the node list fetched
            before_rt, before_cmd = proxy.counts(), command_calls(info)
            hits = stack.contains_prefix(keys)
            time.sleep(ROUND_TRIP_SETTLE_S)
            after_rt, after_cmd = proxy.counts(), command_calls(info)
        finally:
            close_stack(stack)
    commands = {name: after_cmd[name] - before_cmd.get(name, 0) for name in after_cmd}
    commands = {name: n for name, n in sorted(commands.items()) if n and name != "info"}
    return {
        "proxied_hit_prefix": hits,
        "redis_round_trips": after_rt["round_trips"] - before_rt["round_trips"],
        "redis_connections": after_rt["connections"],
        "redis_commands": sum(commands.values()),
        "redis_commands_by_name": commands,
    }


# -- one backend ------------------------------------------------------------------------
def run_backend(peer: Peer, plan: Plan, bases: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every cell of the plan, then the lookup; an exception ends this backend, not the run."""
    out: dict[str, Any] = {"status": "ok", "ceiling": peer.ceiling, "cells": [], "errors": []}
    started = time.monotonic()
    try:
        peer.start()
        _run_cells(peer, plan, bases, out["cells"])
        out["lookup"] = measure_lookup(peer, plan)
        print(report.lookup_line(peer.name, out["lookup"]), flush=True)
    except Exception as exc:
        traceback.print_exc()
        out["status"] = "failed"
        out["errors"].append(repr(exc))
    finally:
        peer.stop()
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def _run_cells(peer: Peer, plan: Plan, bases: dict[str, torch.Tensor], cells: list[dict[str, Any]]) -> None:
    cell_no = 0
    for size, shape in plan.shapes.items():
        peer.new_chunk_size()
        gib = local_cpu_gib(chunk_bytes(shape), max(plan.batches))
        stacks: list[LMCacheStack] = []
        try:
            for _ in range(max(plan.clients)):
                stacks.append(build_stack(peer, shape, gib))
            for batch in plan.batches:
                for clients in plan.clients:
                    cell_no += 1
                    rounds = plan.rounds(chunk_bytes(shape), batch, clients)
                    cell, keys = run_cell(stacks[:clients], bases[size], cell_no, batch, clients, rounds)
                    cell = {"chunk": size, "chunk_bytes": chunk_bytes(shape),
                            "shape": [2, shape[0], TOKENS, shape[1] * shape[2]], **cell}  # fmt: skip
                    cells.append(cell)
                    print(report.cell_line(peer.name, cell), flush=True)
                    peer.clear(stacks[0], keys)
        finally:
            for stack in stacks:
                close_stack(stack)


def failures(results: dict[str, Any], plan: Plan) -> list[str]:
    """Everything that makes the run fail: errors, misses, byte differences, lookups that missed."""
    found = []
    for name, backend in results.items():
        if backend["status"] == "skipped":
            continue
        found += [f"{name}: {e}" for e in backend.get("errors", [])]
        for cell in backend.get("cells", []):
            where = f"{name} {cell['chunk']} batch {cell['batch']} x{cell['clients']}"
            found += [f"{where}: {e}" for e in cell["errors"]]
            if cell["misses"] or cell["mismatches"]:
                found.append(f"{where}: {cell['misses']} misses, {cell['mismatches']} chunks differ "
                             f"of {cell['chunks_read']}")  # fmt: skip
        lookup = backend.get("lookup")
        if lookup is not None:
            for field in ("hit_prefix", "proxied_hit_prefix"):
                if field in lookup and lookup[field] != plan.lookup_keys:
                    found.append(f"{name}: lookup found {lookup[field]} of {plan.lookup_keys} stored keys ({field})")
    return found


def machine() -> dict[str, Any]:
    import lmcache

    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lmcache": getattr(lmcache, "__version__", "?"),
    }


def revision() -> dict[str, Any]:
    """The commit measured, and whether kvpool's code (backend/) differed from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=5).stdout.strip()  # fmt: skip
        changed = subprocess.run(["git", "status", "--porcelain", "--", "backend"], cwd=REPO, capture_output=True,
                                 text=True, timeout=5).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"commit": commit, "backend_modified": bool(changed)} if commit else {}


def parse_backends(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {unknown}; choose from {','.join(PEER_NAMES)}")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 MiB chunks, batch 1 and 8, one client")
    parser.add_argument("--smoke", action="store_true", help="tiny chunks and few rounds (for tests)")
    parser.add_argument("--backends", type=parse_backends, default=list(PEER_NAMES),
                        help=f"comma-separated subset of {','.join(PEER_NAMES)} (default: all)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results directory (default {RESULTS})")
    parser.add_argument("--fs-dir", default=None, help="parent directory of the fs:// store (default: the temp dir)")
    args = parser.parse_args(argv)
    # Before LMCache is imported: its per-stack deprecation warnings would drown the table.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    # kvpool's connector reports failed puts and gets as warnings; show them with their source.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    plan = make_plan(args.quick, args.smoke)
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    command = "python -m bench.harness" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    largest = plan.largest_cell_bytes()
    kvpool_dram_gib = max(2, math.ceil(1.5 * largest / GIB))
    peers = make_peers(args.backends, kvpool_dram=f"{kvpool_dram_gib}GiB", fs_parent=args.fs_dir,
                       mooncake_bytes=kvpool_dram_gib * GIB)  # fmt: skip
    print(f"[harness] {plan.mode}{' smoke' if args.smoke else ''}: chunks {', '.join(plan.shapes)}; batch "
          f"{', '.join(map(str, plan.batches))}; clients {', '.join(map(str, plan.clients))}; "
          f"backends {', '.join(args.backends)}", flush=True)  # fmt: skip

    ceilings = {"memcpy_gbps": memcpy_gbps(plan.memcpy_bytes), "tcp_loopback_gbps": tcp_loopback_gbps(plan.tcp_bytes)}
    print(f"[harness] ceilings: memcpy {ceilings['memcpy_gbps']:.2f} GB/s, "
          f"one TCP stream over loopback {ceilings['tcp_loopback_gbps']:.2f} GB/s", flush=True)  # fmt: skip
    bases = {size: base_bytes(shape) for size, shape in plan.shapes.items()}

    results: dict[str, Any] = {}
    for peer in peers:
        if peer.skip_reason:
            results[peer.name] = {"status": "skipped", "reason": peer.skip_reason}
            print(f"[harness] {peer.name}: skipped ({peer.skip_reason}); not installed here, and the harness "
                  "does not install it", flush=True)  # fmt: skip
            continue
        print(f"[harness] {peer.name}: starting", flush=True)
        results[peer.name] = run_backend(peer, plan, bases)

    report.add_ratios(results, ceilings)
    problems = failures(results, plan)
    run = {
        "harness": "bench.harness",
        "started": stamp,
        "command": command,
        "plan": {**asdict(plan), "smoke": args.smoke},
        "machine": machine(),
        "revision": revision(),
        "ceilings": ceilings,
        "backends": results,
        "targets": report.targets(results, ceilings),
        "failures": problems,
        "ok": not problems,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"harness-{stamp}.json"
    json_path.write_text(json.dumps(run, indent=2) + "\n")
    print()
    print(report.render(run))
    png_path = report.plot(run, args.out / f"harness-{stamp}.png")
    print(f"\n[harness] results: {json_path}")
    print(f"[harness] plot: {png_path}" if png_path else "[harness] plot: skipped (matplotlib is not installed; "
          "pip install -e '.[bench]')")  # fmt: skip
    if problems:
        print("[harness] FAILED:\n  " + "\n  ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
