"""LMCache's storage backends side by side, each driven by LMCache's own code.

    python -m bench.harness --targets            # the project's targets: 4 and 32 MiB, batch 8, one client, 3 rounds
    python -m bench.harness                      # full sweep, 3 rounds (long)
    python -m bench.harness --quick              # 4 MiB chunks, batch 1 and 8, one client, 3 rounds
    python -m bench.harness --smoke              # tiny chunks, one round (the tests run --quick --smoke --rounds 2)
    python -m bench.harness --hosts              # across hosts of the bed: RTT 0/0.2/1 ms, 10 Gb/s (bench.hosts_harness)
    python -m bench.harness --lookups            # lookups only: 16/128/1,000 keys, hit/half/miss (bench.lookups)
    python -m bench.harness --backends kvpool,resp --chunks 4MiB --batches 8 --clients 1 --rounds 5

For each backend (kvpool, LMCache's redis://, resp://, lm://, fs://, and Mooncake when
it is installed) the harness starts its server, builds LMCache's storage with
``CreateStorageBackends`` (``bench.lmcache_stack``: a LocalCPUBackend and a
RemoteBackend) and moves KV-shaped bf16 memory objects from LMCache's allocator:

* put and get GB/s and p50/p99 latency per call, for every chunk size x batch x
  client count; every chunk read back is compared byte for byte with what was
  written (a miss or a difference fails the run);
* ``batched_async_contains`` latency for 1,000 stored keys, and for Redis-backed
  stores the Redis commands (``INFO commandstats`` deltas) and round trips
  (``bench.resp_proxy``) that one lookup costs (round 1 only);
* in every round, the machine's ceilings (``bench.ceilings``): memcpy and one TCP
  stream over loopback.

Every server is started once, before round 1, and stopped after the last round, but
for two that cannot delete (``bench.peers``): ``lm://`` restarts empty when the next
chunk size's cells would take it past 4 GiB, Mooncake before every chunk size.
Each round runs every backend's cells in turn; a cell's reported figures are the
medians over the rounds, and each round's own figures stay in the JSON
(``bench.rounds``). kvpool's DRAM is twice the largest cell and is filled to capacity
before each chunk size (``bench.full_pool``), so every measured put evicts, as in a
pool in service; the nodes' eviction counters prove it for every cell.

Concurrent clients are separate LMCache stacks (own connector, connections and event
loop) in this process, one driver thread each. Before its cells, each stack makes one
untimed put and get of a full batch (connections open, buffers touched); then every
call starts on a barrier and its time is the first start to the last finish, so byte
checks are never timed. Results go to ``bench/results/harness-<timestamp>.json`` (and
``.png`` when matplotlib is installed); ``bench.report`` prints the table.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import redis
import torch

from backend.latency import quantile
from bench import report
from bench.ceilings import memcpy_gbps, tcp_loopback_gbps
from bench.lmcache_stack import LMCacheStack
from bench.peers import PEER_NAMES, Peer, make_peers
from bench.resp_proxy import CountingProxy
from bench.rounds import combine_ceilings, combine_cells

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
REAL_ROUNDS = 3  # medians of three interleaved rounds, as the targets are defined
SMOKE_ROUNDS = 1
DRAM_PER_CELL = 2  # kvpool's DRAM, in multiples of the largest cell: the cell fits, the fill still evicts
WARM_UP_CELL = 0  # cell number of the untimed warm-up keys (measured cells count from 1)

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
    rounds: int  # interleaved rounds; a cell's reported figures are medians over them
    cell_bytes: int  # bytes each cell moves per direction and round; its calls are sized from it
    min_calls: int
    max_calls: int
    lookup_keys: int
    lookup_repeats: int
    memcpy_bytes: int
    tcp_bytes: int

    def calls(self, chunk_bytes: int, batch: int, clients: int) -> int:
        """Batched calls per client in one round of a cell."""
        wanted = math.ceil(self.cell_bytes / (chunk_bytes * batch * clients))
        return max(self.min_calls, min(self.max_calls, wanted))

    def largest_cell_bytes(self) -> int:
        return max(
            chunk_bytes(shape) * batch * clients * self.calls(chunk_bytes(shape), batch, clients)
            for shape in self.shapes.values()
            for batch in self.batches
            for clients in self.clients
        )

    def stored_bytes(self, shape: tuple[int, int, int]) -> int:
        """What one round of a chunk size's cells stores, its warm-up included."""
        size = chunk_bytes(shape)
        cells = sum(size * b * c * self.calls(size, b, c) for b in self.batches for c in self.clients)
        return cells + size * max(self.batches) * max(self.clients)

    def kvpool_dram_bytes(self) -> int:
        """kvpool's DRAM: twice what one cell (or the lookup) stores, so its chunks fit in a full pool."""
        lookup_bytes = chunk_bytes(LOOKUP_SHAPE) * self.lookup_keys
        return DRAM_PER_CELL * math.ceil(max(self.largest_cell_bytes(), lookup_bytes) / MIB) * MIB


def make_plan(
    *,
    quick: bool = False,
    smoke: bool = False,
    targets: bool = False,
    chunks: Sequence[str] | None = None,
    batches: Sequence[int] | None = None,
    clients: Sequence[int] | None = None,
    rounds: int | None = None,
) -> Plan:
    """The mode's plan, with any of its chunk sizes, batches, clients and rounds replaced."""
    if smoke:
        shapes = {"16KiB": SMOKE_SHAPES["16KiB"]} if quick else SMOKE_SHAPES
        plan = Plan(
            "quick" if quick else "full",
            shapes,
            (1, 8),
            (1,) if quick else (1, 4),
            SMOKE_ROUNDS,
            cell_bytes=MIB,
            min_calls=2,
            max_calls=4,
            lookup_keys=100,
            lookup_repeats=2,
            memcpy_bytes=16 * MIB,
            tcp_bytes=64 * MIB,
        )
    elif targets:  # the cells the targets are defined on (bench.report); 32 MiB still has 6 calls behind a p99
        plan = Plan(
            "targets",
            {n: CHUNK_SHAPES[n] for n in report.TARGET_CHUNKS},
            (report.TARGET_BATCH,),
            (report.TARGET_CLIENTS,),
            REAL_ROUNDS,
            cell_bytes=GIB,
            min_calls=6,
            max_calls=100,
            lookup_keys=1000,
            lookup_repeats=5,
            memcpy_bytes=256 * MIB,
            tcp_bytes=GIB,
        )
    elif quick:
        plan = Plan(
            "quick",
            {"4MiB": CHUNK_SHAPES["4MiB"]},
            (1, 8),
            (1,),
            REAL_ROUNDS,
            cell_bytes=512 * MIB,
            min_calls=5,
            max_calls=100,
            lookup_keys=1000,
            lookup_repeats=5,
            memcpy_bytes=256 * MIB,
            tcp_bytes=GIB,
        )
    else:
        plan = Plan(
            "full",
            dict(CHUNK_SHAPES),
            (1, 8),
            (1, 4),
            REAL_ROUNDS,
            cell_bytes=512 * MIB,
            min_calls=2,
            max_calls=100,
            lookup_keys=1000,
            lookup_repeats=5,
            memcpy_bytes=256 * MIB,
            tcp_bytes=GIB,
        )
    known = SMOKE_SHAPES if smoke else CHUNK_SHAPES
    if chunks is not None:
        unknown = [c for c in chunks if c not in known]
        if unknown or not chunks:
            raise ValueError(f"--chunks: unknown size(s) {unknown}; choose from {','.join(known)}")
        plan = replace(plan, shapes={c: known[c] for c in chunks})
    if batches is not None:
        plan = replace(plan, batches=tuple(batches))
    if clients is not None:
        plan = replace(plan, clients=tuple(clients))
    if rounds is not None:
        plan = replace(plan, rounds=rounds)
    return plan


def chunk_bytes(shape: tuple[int, int, int]) -> int:
    layers, heads, head_size = shape
    return 2 * layers * TOKENS * heads * head_size * torch.bfloat16.itemsize


def latency_ms(samples_s: Sequence[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {"p50": quantile(ms, 0.5), "p99": quantile(ms, 0.99), "n": len(ms)}


# -- LMCache stacks ---------------------------------------------------------------------
def local_cpu_gib(chunk: int, batch: int) -> float:
    """LMCache's local buffer for one client: the batch being put plus the batch being read, and slack.

    ``allocate()`` waits for as long as this buffer is full, so it must hold all in flight.
    """
    return round((2 * batch * chunk * 1.25 + 64 * MIB) / GIB, 3)


def build_stack(peer: Peer, shape: tuple[int, int, int], gib: float, *, redis_port: int | None = None) -> LMCacheStack:
    layers, heads, head_size = shape
    return LMCacheStack(
        peer.lmcache_config(gib, redis_port=redis_port), model=MODEL, num_layers=layers, hidden=(heads, head_size)
    )


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
# A chunk's key hash holds (round, cell, client, call, slot): every key of a run is new,
# so no store can answer a put with "already there".
KEY_FIELDS_BITS = (("round", 8), ("cell", 16), ("client", 8), ("call", 12), ("slot", 12))


def key_hash(round_no: int, cell: int, client: int, call: int, slot: int) -> int:
    value = 0
    for (name, bits), field in zip(KEY_FIELDS_BITS, (round_no, cell, client, call, slot), strict=True):
        if not 0 <= field < 1 << bits:
            raise ValueError(f"key field {name}={field} does not fit in {bits} bits")
        value = (value << bits) | field
    return value


class _Calls:
    """Per-call start/end times of every client, and what the byte checks found."""

    def __init__(self, clients: int, calls: int) -> None:
        self.put = [[(0.0, 0.0)] * calls for _ in range(clients)]
        self.get = [[(0.0, 0.0)] * calls for _ in range(clients)]
        self.misses = [0] * clients
        self.mismatches = [0] * clients
        self.errors: list[str] = []

    @staticmethod
    def wall_s(times: list[list[tuple[float, float]]]) -> float:
        """Sum over calls of first start to last finish."""
        return sum(max(c[i][1] for c in times) - min(c[i][0] for c in times) for i in range(len(times[0])))

    @staticmethod
    def op_s(times: list[list[tuple[float, float]]]) -> list[float]:
        return [end - start for client in times for start, end in client]


def run_cell(
    stacks: Sequence[LMCacheStack],
    base: torch.Tensor,
    round_no: int,
    cell: int,
    batch: int,
    clients: int,
    calls: int,
) -> tuple[dict[str, Any], list[Any]]:
    """Every client puts ``calls`` batches, then reads them back; returns the figures and the keys used."""
    record = _Calls(clients, calls)
    barrier = threading.Barrier(clients, timeout=BARRIER_TIMEOUT_S)
    hashes = [[[key_hash(round_no, cell, c, i, s) for s in range(batch)] for i in range(calls)] for c in range(clients)]
    keys = [[[stacks[c].key(h) for h in per_call] for per_call in hashes[c]] for c in range(clients)]

    def client(c: int) -> None:
        stack = stacks[c]
        objs: list[Any] = []
        try:
            for _ in range(batch):
                objs.append(allocate(stack))
                byte_view(objs[-1]).copy_(base)
            for i in range(calls):
                for obj, h in zip(objs, hashes[c][i], strict=True):
                    stamp(obj, h)
                barrier.wait()
                start = time.perf_counter()
                stack.put(keys[c][i], objs, timeout_s=PUT_TIMEOUT_S)
                record.put[c][i] = (start, time.perf_counter())
            for i in range(calls):
                barrier.wait()
                start = time.perf_counter()
                got = stack.get(keys[c][i])
                record.get[c][i] = (start, time.perf_counter())
                try:
                    for obj, h in zip(got, hashes[c][i], strict=True):
                        if obj is None:
                            record.misses[c] += 1
                        elif not identical(obj, base, h):
                            record.mismatches[c] += 1
                finally:
                    stack.release(got)
        except Exception as exc:
            record.errors.append(f"client {c}: {exc!r}")
            barrier.abort()
        finally:
            stack.release(objs)

    threads = [
        threading.Thread(target=client, args=(c,), name=f"bench-client-{c}", daemon=True) for c in range(clients)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S * (2 * calls + 1)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            record.errors.append(f"{thread.name} did not finish")
    moved = stacks[0].chunk_bytes * batch * clients * calls
    result: dict[str, Any] = {
        "batch": batch,
        "clients": clients,
        "calls": calls,
        "chunks_read": batch * clients * calls,
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
        _run_cells(peer, plan, bases, round_no, out)
        if round_no == 1:
            out["lookup"] = measure_lookup(peer, plan)
            print(report.lookup_line(peer.name, out["lookup"]), flush=True)
    except Exception as exc:
        traceback.print_exc()
        out["status"] = "failed"
        out["errors"].append(f"round {round_no}: {exc!r}")
    out["seconds"] = round(out["seconds"] + time.monotonic() - started, 1)


def _run_cells(peer: Peer, plan: Plan, bases: dict[str, torch.Tensor], round_no: int, out: dict[str, Any]) -> None:
    cell_no = 0
    for size, shape in plan.shapes.items():
        peer.new_chunk_size(plan.stored_bytes(shape))
        fill = peer.fill(chunk_bytes(shape))
        if fill is not None:
            out["fills"].append({"round": round_no, "chunk": size, **fill})
            print(report.fill_line(peer.name, out["fills"][-1]), flush=True)
        gib = local_cpu_gib(chunk_bytes(shape), max(plan.batches))
        stacks: list[LMCacheStack] = []
        try:
            for _ in range(max(plan.clients)):
                stacks.append(build_stack(peer, shape, gib))
            peer.clear(stacks[0], warm_up(stacks, round_no, max(plan.batches)))
            for batch in plan.batches:
                for clients in plan.clients:
                    cell_no += 1
                    calls = plan.calls(chunk_bytes(shape), batch, clients)
                    evicted_before = peer.evictions()
                    cell, keys = run_cell(stacks[:clients], bases[size], round_no, cell_no, batch, clients, calls)
                    cell = {
                        "round": round_no,
                        "chunk": size,
                        "chunk_bytes": chunk_bytes(shape),
                        "shape": [2, shape[0], TOKENS, shape[1] * shape[2]],
                        **cell,
                    }
                    record_evictions(cell, evicted_before, peer.evictions())
                    out["round_cells"].append(cell)
                    print(report.cell_line(peer.name, cell), flush=True)
                    peer.clear(stacks[0], keys)
        finally:
            for stack in stacks:
                close_stack(stack)


def warm_up(stacks: Sequence[LMCacheStack], round_no: int, batch: int) -> list[Any]:
    """One untimed put and get of a full batch per stack; returns the keys it stored.

    A fresh stack's first call opens connections and maps or touches buffers, which a
    serving engine pays once, not per batch; the measured calls come after it.
    """
    keys: list[Any] = []
    for c, stack in enumerate(stacks):
        batch_keys = [stack.key(key_hash(round_no, WARM_UP_CELL, c, 0, s)) for s in range(batch)]
        objs: list[Any] = []
        try:
            for _ in batch_keys:
                objs.append(allocate(stack))
            stack.put(batch_keys, objs, timeout_s=PUT_TIMEOUT_S)
        finally:
            stack.release(objs)
        stack.release(stack.get(batch_keys))
        keys += batch_keys
    return keys


def record_evictions(cell: dict[str, Any], before: int | None, after: int | None) -> None:
    """Note the evictions during a cell's puts (its gets evict nothing); fewer than its puts fail the run.

    ``None``: the store does not count evictions (every peer but kvpool), nothing to note.
    """
    if before is None or after is None:
        return
    evictions = after - before
    cell["evictions"] = evictions
    cell["chunks_put"] = cell["batch"] * cell["clients"] * cell["calls"]
    if evictions < cell["chunks_put"]:
        cell["errors"].append(
            f"the pool evicted {evictions} chunks during {cell['chunks_put']} measured puts: "
            "it was not full, so some puts did not pay for an eviction"
        )


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
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "backend"], cwd=REPO, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"commit": commit, "backend_modified": bool(changed)} if commit else {}


def parse_backends(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {unknown}; choose from {','.join(PEER_NAMES)}")
    return list(dict.fromkeys(names))


def parse_names(text: str) -> list[str]:
    """Comma-separated names, in order, without repeats (chunk sizes are checked against the mode's)."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list, e.g. 4MiB,32MiB")
    return names


def parse_counts(text: str) -> list[int]:
    """Comma-separated positive integers, in order, without repeats."""
    try:
        counts = list(dict.fromkeys(int(n) for n in text.split(",") if n.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,8") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,8")
    return counts


def parse_rounds(text: str) -> int:
    rounds = parse_counts(text)
    most = (1 << dict(KEY_FIELDS_BITS)["round"]) - 1
    if len(rounds) != 1 or rounds[0] > most:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one number of rounds, at most {most}")
    return rounds[0]


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
        help="across hosts of the bed (bench.hosts_harness, as root): client, servers and Redis on separate "
        "hosts, RTT 0/0.2/1 ms and 10 Gb/s; its own flags: python -m bench.harness --hosts --help",
    )
    parser.add_argument(
        "--lookups",
        action="store_true",
        help="lookups only (bench.lookups): 16, 128 and 1,000 keys; hit, half and miss; "
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
        from bench.lookups import LOOKUP_BACKENDS

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
        from bench.hosts_harness import main as hosts_main

        return hosts_main(argv)
    args, plan = parse_args(argv)
    # Before LMCache is imported: its per-stack deprecation warnings would drown the table.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    # kvpool's connector reports failed puts and gets as warnings; show them with their source.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    command = "python -m bench.harness" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    if args.lookups:
        from bench.lookups import DEFAULT_ROUNDS, run_lookups

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
        "harness": "bench.harness",
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
