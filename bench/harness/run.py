"""LMCache's storage backends side by side, each driven by LMCache's own code.

    python -m bench.harness.run --targets            # the project's targets: 4 and 32 MiB, batch 8, one client, 3 rounds
    python -m bench.harness.run                      # full sweep, 3 rounds (long)
    python -m bench.harness.run --quick              # 4 MiB chunks, batch 1 and 8, one client, 3 rounds
    python -m bench.harness.run --smoke              # tiny chunks, one round (the tests run --quick --smoke --rounds 2)
    python -m bench.harness.run --hosts              # across hosts of the bed: RTT 0/0.2/1 ms, 10 Gb/s (bench.hosts.harness)
    python -m bench.harness.run --lookups            # lookups only: 16/128/1,000 keys, hit/half/miss (bench.harness.lookups)
    python -m bench.harness.run --backends kvpool,resp --chunks 4MiB --batches 8 --clients 1 --rounds 5

For each backend (kvpool, LMCache's redis://, resp://, lm://, fs://, and Mooncake when
it is installed) the harness starts its server, builds LMCache's storage with
``CreateStorageBackends`` (``backend.lmcache.stack``: a LocalCPUBackend and a
RemoteBackend) and moves KV-shaped bf16 memory objects from LMCache's allocator:

* put and get GB/s and p50/p99 latency per call, for every chunk size x batch x
  client count; every chunk read back is compared byte for byte with what was
  written (a miss or a difference fails the run);
* ``batched_async_contains`` latency for 1,000 stored keys, and for Redis-backed
  stores the Redis commands (``INFO commandstats`` deltas) and round trips
  (``bench.harness.resp_proxy``) that one lookup costs (round 1 only);
* in every round, the machine's ceilings (``bench.harness.ceilings``): memcpy and one TCP
  stream over loopback.

Every server is started once, before round 1, and stopped after the last round, but
for two that cannot delete (``bench.harness.peers``): ``lm://`` restarts empty when the next
chunk size's cells would take it past 4 GiB, Mooncake before every chunk size.
Each round runs every backend's cells in turn; a cell's reported figures are the
medians over the rounds, and each round's own figures stay in the JSON
(``bench.harness.rounds``). kvpool's DRAM is twice the largest cell and is filled to capacity
before each chunk size (``bench.harness.full_pool``), so every measured put evicts, as in a
pool in service; the nodes' eviction counters prove it for every cell.

Concurrent clients are separate LMCache stacks (own connector, connections and event
loop) in this process, one driver thread each. Before its cells, each stack makes one
untimed put and get of a full batch (connections open, buffers touched); then every
call starts on a barrier and its time is the first start to the last finish, so byte
checks are never timed. Results go to ``docs/results/harness-<timestamp>.json`` (and
``.png`` when matplotlib is installed); ``bench.harness.report`` prints the table.

The plan is ``bench.harness.plan``'s, the cells and their byte checks ``bench.harness.cells``' (shared
with ``--lookups`` and ``--hosts``' worker, which import neither this module nor each other).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import redis
import torch

from bench.harness import report
from bench.harness.ceilings import memcpy_gbps, tcp_loopback_gbps
from bench.harness.cells import (
    PUT_TIMEOUT_S,
    ROUND_TRIP_SETTLE_S,
    allocate,
    base_bytes,
    build_stack,
    close_stack,
    command_calls,
    latency_ms,
    local_cpu_gib,
    run_cells,
)
from bench.harness.lookups import DEFAULT_ROUNDS, LOOKUP_BACKENDS, run_lookups
from bench.harness.peers import PEER_NAMES, Peer, make_peers
from bench.harness.plan import (
    CHUNK_SHAPES,
    LOOKUP_PUT_BATCH,
    LOOKUP_SHAPE,
    MIB,
    REAL_ROUNDS,
    SMOKE_ROUNDS,
    SMOKE_SHAPES,
    Plan,
    chunk_bytes,
    make_plan,
    parse_counts,
    parse_names,
    parse_rounds,
)
from bench.harness.provenance import machine, revision
from bench.harness.resp_proxy import CountingProxy
from bench.harness.rounds import combine_ceilings, combine_cells
from bench.paths import RESULTS


# -- lookups ----------------------------------------------------------------------------
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
    with (
        CountingProxy(peer.redis_port) as proxy,
        redis.Redis(port=peer.redis_port, password=peer.redis_password, socket_timeout=10) as info,
    ):
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


# -- the rounds -------------------------------------------------------------------------
def run_rounds(
    peers: Sequence[Peer], plan: Plan, bases: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start every peer, run each backend's cells in every round, stop every peer.

    Returns the backends' results, their cells combined over the rounds, and the
    ceilings measured at the start of each round. A backend that fails is left out of
    the later rounds; the others go on.
    """
    results: dict[str, Any] = {}
    ceilings: list[dict[str, float]] = []
    running = [peer for peer in peers if not peer.skip_reason]
    try:
        for peer in peers:
            results[peer.name] = start_peer(peer)
        for round_no in range(1, plan.rounds + 1):
            ceilings.append(measure_ceilings(plan))
            print(
                f"[harness] round {round_no}/{plan.rounds}: ceilings memcpy {ceilings[-1]['memcpy_gbps']:.2f} GB/s, "
                f"one TCP stream over loopback {ceilings[-1]['tcp_loopback_gbps']:.2f} GB/s",
                flush=True,
            )
            for peer in running:
                if results[peer.name]["status"] == "ok":
                    run_round(peer, plan, bases, round_no, results[peer.name])
    finally:
        for peer in running:
            stop_peer(peer)
    for backend in results.values():
        if "round_cells" in backend:
            backend["cells"] = combine_cells(backend.pop("round_cells"))
    return results, combine_ceilings(ceilings)


def measure_ceilings(plan: Plan) -> dict[str, float]:
    return {"memcpy_gbps": memcpy_gbps(plan.memcpy_bytes), "tcp_loopback_gbps": tcp_loopback_gbps(plan.tcp_bytes)}


def start_peer(peer: Peer) -> dict[str, Any]:
    """Start one peer; its result record (skipped, failed, or ready for the rounds)."""
    if peer.skip_reason:
        print(
            f"[harness] {peer.name}: skipped ({peer.skip_reason}); not installed here, and the harness "
            "does not install it",
            flush=True,
        )
        return {"status": "skipped", "reason": peer.skip_reason}
    out: dict[str, Any] = {"status": "ok", "ceiling": peer.ceiling, "round_cells": [], "fills": [], "errors": []}
    print(f"[harness] {peer.name}: starting", flush=True)
    started = time.monotonic()
    try:
        peer.start()
    except Exception as exc:
        traceback.print_exc()
        out["status"] = "failed"
        out["errors"].append(f"start: {exc!r}")
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def stop_peer(peer: Peer) -> None:
    try:
        peer.stop()
    except Exception as exc:  # one peer that stops badly must not leave the others running
        print(f"[harness] {peer.name}: stopping failed: {exc!r}", flush=True)


def run_round(peer: Peer, plan: Plan, bases: dict[str, torch.Tensor], round_no: int, out: dict[str, Any]) -> None:
    """One round of a backend: every cell, and in round 1 the lookup; an exception ends this backend, not the run."""
    started = time.monotonic()
    try:
        run_cells(peer, plan, bases, round_no, out)
        if round_no == 1:
            out["lookup"] = measure_lookup(peer, plan)
            print(report.lookup_line(peer.name, out["lookup"]), flush=True)
    except Exception as exc:
        traceback.print_exc()
        out["status"] = "failed"
        out["errors"].append(f"round {round_no}: {exc!r}")
    out["seconds"] = round(out["seconds"] + time.monotonic() - started, 1)


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
                found.append(
                    f"{where}: {cell['misses']} misses, {cell['mismatches']} chunks differ of {cell['chunks_read']}"
                )
        lookup = backend.get("lookup")
        if lookup is not None:
            for field in ("hit_prefix", "proxied_hit_prefix"):
                if field in lookup and lookup[field] != plan.lookup_keys:
                    found.append(f"{name}: lookup found {lookup[field]} of {plan.lookup_keys} stored keys ({field})")
    return found


def parse_backends(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {unknown}; choose from {','.join(PEER_NAMES)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Plan]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--targets",
        action="store_true",
        help=f"the measurement the targets are defined on: chunks {','.join(report.TARGET_CHUNKS)}, "
        f"batch {report.TARGET_BATCH}, {report.TARGET_CLIENTS} client, {REAL_ROUNDS} rounds",
    )
    parser.add_argument("--quick", action="store_true", help="4 MiB chunks, batch 1 and 8, one client")
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="across hosts of the bed (bench.hosts.harness, as root): client, servers and Redis on separate "
        "hosts, RTT 0/0.2/1 ms and 10 Gb/s; its own flags: python -m bench.harness.run --hosts --help",
    )
    parser.add_argument(
        "--lookups",
        action="store_true",
        help="lookups only (bench.harness.lookups): 16, 128 and 1,000 keys; hit, half and miss; "
        "round trips, commands and a Redis PING (default backends kvpool,resp,redis,lm,fs)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help=f"tiny chunks ({','.join(SMOKE_SHAPES)}), {SMOKE_ROUNDS} round (for tests)"
    )
    parser.add_argument(
        "--chunks",
        type=parse_names,
        help=f"chunk sizes, a subset of {','.join(CHUNK_SHAPES)} (with --smoke: of {','.join(SMOKE_SHAPES)})",
    )
    parser.add_argument("--batches", type=parse_counts, help="chunks per call, e.g. 1,8")
    parser.add_argument("--clients", type=parse_counts, help="concurrent clients, e.g. 1,4")
    parser.add_argument(
        "--rounds",
        type=parse_rounds,
        help=f"interleaved rounds; figures are medians over them (default {REAL_ROUNDS}, "
        f"{SMOKE_ROUNDS} with --smoke, 5 with --lookups)",
    )
    parser.add_argument(
        "--backends",
        type=parse_backends,
        default=None,
        help=f"comma-separated subset of {','.join(PEER_NAMES)} (default: all; with --lookups: "
        "kvpool,resp,redis,lm,fs)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results directory (default {RESULTS})")
    parser.add_argument("--fs-dir", default=None, help="parent directory of the fs:// store (default: the temp dir)")
    args = parser.parse_args(argv)
    if args.lookups:
        fixed = [f"--{n}" for n in ("targets", "quick", "smoke", "chunks", "batches", "clients") if getattr(args, n)]
        if fixed:
            parser.error(f"--lookups measures lookups only; drop {' '.join(fixed)}")
    if args.backends is None:
        args.backends = list(LOOKUP_BACKENDS) if args.lookups else list(PEER_NAMES)
    if args.targets:
        fixed = [f"--{n}" for n in ("quick", "smoke", "chunks", "batches", "clients") if getattr(args, n)]
        if fixed:
            parser.error(f"--targets fixes chunks, batch and clients; drop {' '.join(fixed)}")
        if args.rounds is not None and args.rounds < REAL_ROUNDS:
            parser.error(f"--targets needs at least {REAL_ROUNDS} rounds (the targets are medians of {REAL_ROUNDS})")
    try:
        plan = make_plan(
            quick=args.quick,
            smoke=args.smoke,
            targets=args.targets,
            chunks=args.chunks,
            batches=args.batches,
            clients=args.clients,
            rounds=args.rounds,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return args, plan


def main(argv: list[str] | None = None) -> int:
    if "--hosts" in (argv if argv is not None else sys.argv[1:]):
        from bench.hosts.harness import main as hosts_main

        return hosts_main(argv)
    args, plan = parse_args(argv)
    # Before LMCache is imported: its per-stack deprecation warnings would drown the table.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    # kvpool's connector reports failed puts and gets as warnings; show them with their source.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    command = "python -m bench.harness.run" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    if args.lookups:
        return run_lookups(args.backends, args.rounds or DEFAULT_ROUNDS, args.out, command)
    dram_bytes = plan.kvpool_dram_bytes()
    peers = make_peers(
        args.backends, kvpool_dram=f"{dram_bytes // MIB}MiB", fs_parent=args.fs_dir, mooncake_bytes=dram_bytes
    )
    print(
        f"[harness] {plan.mode}{' smoke' if args.smoke else ''}: chunks {', '.join(plan.shapes)}; batch "
        f"{', '.join(map(str, plan.batches))}; clients {', '.join(map(str, plan.clients))}; {plan.rounds} "
        f"round(s); backends {', '.join(args.backends)}; kvpool DRAM {dram_bytes // MIB} MiB, filled before "
        "each chunk size",
        flush=True,
    )
    bases = {size: base_bytes(shape) for size, shape in plan.shapes.items()}

    results, ceilings = run_rounds(peers, plan, bases)
    report.add_ratios(results, ceilings)
    problems = failures(results, plan)
    run = {
        "harness": "bench.harness.run",
        "started": stamp,
        "command": command,
        "plan": {**asdict(plan), "smoke": args.smoke, "kvpool_dram_bytes": dram_bytes},
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
    print(
        f"[harness] plot: {png_path}"
        if png_path
        else "[harness] plot: skipped (matplotlib is not installed; pip install -e '.[bench]')"
    )
    if problems:
        print("[harness] FAILED:\n  " + "\n  ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
