"""The lookup every request pays, side by side: ``python -m bench.harness.run --lookups``.

Each backend's ``batched_async_contains`` through LMCache's ``RemoteBackend`` (the same
stacks as the rest of the harness), over 16, 128 and 1,000 keys, for three cases:

* ``hit``: every key stored (the hit prefix is the whole list);
* ``half``: the first half stored, the rest never were (the prefix ends halfway);
* ``miss``: no key stored (a cold cache: the prefix is 0).

1,000 keys are stored once per backend (16 KiB chunks: a lookup only sees keys). Then
in every round each backend, in an order that rotates from round to round, runs
``REPEATS`` timed lookups per cell after one untimed one; a cell's figure is the median
over the rounds of each round's p50. Each round also times a Redis ``PING`` (redis-py,
from the same thread, to the kvpool peer's Redis) as the floor one round trip costs.

After the rounds, every backend that has a Redis (kvpool, ``resp://``, ``redis://``) runs
each cell once more through ``bench.harness.resp_proxy.CountingProxy``: Redis round trips, and
the commands Redis executed (``INFO commandstats`` deltas; a Lua script's own calls
count too). Every lookup's hit prefix is checked against what was stored: a wrong one
fails the run. Results go to ``docs/results/lookups-<timestamp>.json``.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from backend.lmcache.stack import LMCacheStack
from bench.harness.cells import (
    PUT_TIMEOUT_S,
    ROUND_TRIP_SETTLE_S,
    allocate,
    build_stack,
    close_stack,
    command_calls,
    latency_ms,
    local_cpu_gib,
)
from bench.harness.peers import Peer, make_peers
from bench.harness.plan import LOOKUP_PUT_BATCH, LOOKUP_SHAPE, MIB, chunk_bytes
from bench.harness.provenance import machine, revision
from bench.harness.resp_proxy import CountingProxy

__all__ = ["SIZES", "CASES", "LOOKUP_BACKENDS", "run_lookups"]

SIZES = (16, 128, 1000)
CASES = ("hit", "half", "miss")
LOOKUP_BACKENDS = ("kvpool", "resp", "redis", "lm", "fs")
REPEATS = 15  # timed lookups per cell and round
DEFAULT_ROUNDS = 5
PINGS = 50  # timed PINGs per round
STORED_BASE = 1 << 62  # key hashes of the stored keys
ABSENT_BASE = 1 << 61  # key hashes never stored
KVPOOL_DRAM = f"{64 * MIB // MIB}MiB"  # 1,000 x 16 KiB, with room to spare: nothing is evicted


def cell_keys(stored: Sequence[Any], absent: Sequence[Any], size: int, case: str) -> tuple[list[Any], int]:
    """The keys a cell looks up, and the hit prefix it must find."""
    if case == "hit":
        return list(stored[:size]), size
    if case == "half":
        half = size // 2
        return list(stored[:half]) + list(absent[: size - half]), half
    return list(absent[:size]), 0


class _Backend:
    """One peer, started, with its stack and its 1,000 stored keys."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.stack: LMCacheStack | None = None
        self.stored: list[Any] = []
        self.absent: list[Any] = []
        self.samples: dict[str, list[float]] = {}  # cell -> per-round p50 (ms)
        self.errors: list[str] = []

    def start(self) -> None:
        self.peer.start()
        self.stack = build_stack(self.peer, LOOKUP_SHAPE, local_cpu_gib(chunk_bytes(LOOKUP_SHAPE), LOOKUP_PUT_BATCH))
        self.stored = [self.stack.key(STORED_BASE | i) for i in range(max(SIZES))]
        self.absent = [self.stack.key(ABSENT_BASE | i) for i in range(max(SIZES))]
        objs = [allocate(self.stack) for _ in range(LOOKUP_PUT_BATCH)]
        try:
            for start in range(0, len(self.stored), LOOKUP_PUT_BATCH):
                batch = self.stored[start : start + LOOKUP_PUT_BATCH]
                self.stack.put(batch, objs[: len(batch)], timeout_s=PUT_TIMEOUT_S)
        finally:
            self.stack.release(objs)

    def round(self) -> None:
        """One round: every cell, one untimed lookup then ``REPEATS`` timed ones."""
        assert self.stack is not None
        for size in SIZES:
            for case in CASES:
                keys, expected = cell_keys(self.stored, self.absent, size, case)
                self.stack.contains_prefix(keys)
                times_s = []
                for _ in range(REPEATS):
                    start = time.perf_counter()
                    found = self.stack.contains_prefix(keys)
                    times_s.append(time.perf_counter() - start)
                    if found != expected:
                        self.errors.append(f"{self.peer.name} {case} {size}: hit prefix {found}, expected {expected}")
                self.samples.setdefault(f"{case}/{size}", []).append(latency_ms(times_s)["p50"])

    def count(self) -> dict[str, Any]:
        """Round trips and Redis commands of one lookup per cell, through the counting proxy."""
        port = self.peer.redis_port
        assert port is not None
        counted: dict[str, Any] = {}
        with (
            CountingProxy(port) as proxy,
            redis.Redis(port=port, password=self.peer.redis_password, socket_timeout=10) as info,
        ):
            stack = build_stack(
                self.peer, LOOKUP_SHAPE, local_cpu_gib(chunk_bytes(LOOKUP_SHAPE), 1), redis_port=proxy.port
            )
            try:
                stack.contains_prefix(self.stored[:1])  # connections open, node list read, script loaded
                for size in SIZES:
                    for case in CASES:
                        keys, expected = cell_keys(self.stored, self.absent, size, case)
                        time.sleep(ROUND_TRIP_SETTLE_S)
                        before_rt, before_cmd = proxy.counts()["round_trips"], command_calls(info)
                        found = stack.contains_prefix(keys)
                        time.sleep(ROUND_TRIP_SETTLE_S)
                        after_rt, after_cmd = proxy.counts()["round_trips"], command_calls(info)
                        commands = {name: after_cmd.get(name, 0) - before_cmd.get(name, 0) for name in after_cmd}
                        commands = {name: n for name, n in commands.items() if n and name != "info"}
                        counted[f"{case}/{size}"] = {
                            "round_trips": after_rt - before_rt,
                            "commands": commands,
                            "hit_prefix": found,
                        }
                        if found != expected:
                            self.errors.append(f"{self.peer.name} {case} {size} (proxied): hit prefix {found}")
            finally:
                close_stack(stack)
        return counted

    def stop(self) -> None:
        if self.stack is not None:
            close_stack(self.stack)
        self.peer.stop()


def ping_ms(port: int, password: str | None) -> float:
    """p50 of ``PINGS`` Redis PINGs over one open connection (redis-py, this thread)."""
    with redis.Redis(port=port, password=password, socket_timeout=10) as client:
        client.ping()
        times_s = []
        for _ in range(PINGS):
            start = time.perf_counter()
            client.ping()
            times_s.append(time.perf_counter() - start)
    return latency_ms(times_s)["p50"]


def run_lookups(names: Sequence[str], rounds: int, out_dir: Path, command: str) -> int:
    """Run the lookup rounds for ``names``; print the table, write the JSON; 1 if anything failed."""
    peers = make_peers(names, kvpool_dram=KVPOOL_DRAM, fs_parent=None, mooncake_bytes=64 * MIB)
    backends = [_Backend(peer) for peer in peers if not peer.skip_reason]
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    pings: list[float] = []
    counts: dict[str, Any] = {}
    failures: list[str] = []
    print(
        f"[lookups] {rounds} rounds of {REPEATS} lookups per cell; sizes {SIZES}; cases {CASES}; "
        f"backends {', '.join(b.peer.name for b in backends)}",
        flush=True,
    )
    started: list[_Backend] = []
    try:
        for backend in backends:
            print(f"[lookups] {backend.peer.name}: starting, storing {max(SIZES)} keys", flush=True)
            backend.start()
            started.append(backend)
        ping_peer = next((b.peer for b in backends if b.peer.redis_port is not None), None)
        for round_no in range(rounds):
            if ping_peer is not None and ping_peer.redis_port is not None:
                pings.append(ping_ms(ping_peer.redis_port, ping_peer.redis_password))
            order = backends[round_no % len(backends) :] + backends[: round_no % len(backends)]
            for backend in order:
                backend.round()
            print(f"[lookups] round {round_no + 1}/{rounds} done", flush=True)
        for backend in backends:
            if backend.peer.redis_port is not None:
                counts[backend.peer.name] = backend.count()
    finally:
        for backend in started:
            try:
                backend.stop()
            except Exception as exc:  # one backend that stops badly must not leave the others running
                print(f"[lookups] {backend.peer.name}: stopping failed: {exc!r}", flush=True)
    for backend in backends:
        failures += backend.errors
    run = {
        "harness": "bench.harness.run --lookups",
        "started": stamp,
        "command": command,
        "rounds": rounds,
        "repeats": REPEATS,
        "machine": machine(),
        "revision": revision(),
        "ping_p50_ms": statistics.median(pings) if pings else None,
        "ping_round_p50s_ms": pings,
        "p50_ms": {b.peer.name: {cell: statistics.median(v) for cell, v in b.samples.items()} for b in backends},
        "round_p50s_ms": {b.peer.name: b.samples for b in backends},
        "redis_costs": counts,
        "skipped": {peer.name: peer.skip_reason for peer in peers if peer.skip_reason},
        "failures": failures,
        "ok": not failures,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"lookups-{stamp}.json"
    path.write_text(json.dumps(run, indent=2) + "\n")
    print()
    print(render(run))
    print(f"\n[lookups] results: {path}")
    if failures:
        print("[lookups] FAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0


def render(run: dict[str, Any]) -> str:
    """The table: p50 ms per backend and cell, kvpool against resp://, and kvpool's Redis cost."""
    names = list(run["p50_ms"])
    ping = run["ping_p50_ms"]
    lines = [
        f"lookup p50 ms (median of {run['rounds']} rounds x {run['repeats']} lookups); Redis PING p50 "
        + (f"{ping:.3f} ms" if ping is not None else "not measured")
    ]
    header = ["case", "keys", *names, "kvpool/resp", "kvpool rt/cmds", "resp rt/cmds"]
    rows = [header]
    for case in CASES:
        for size in SIZES:
            cell = f"{case}/{size}"
            row = [case, str(size)]
            row += [f"{run['p50_ms'][n][cell]:.3f}" if cell in run["p50_ms"][n] else "-" for n in names]
            kv, resp = run["p50_ms"].get("kvpool", {}).get(cell), run["p50_ms"].get("resp", {}).get(cell)
            row.append(f"{kv / resp:.2f}" if kv is not None and resp else "-")
            for name in ("kvpool", "resp"):
                cost = run["redis_costs"].get(name, {}).get(cell)
                row.append(f"{cost['round_trips']}/{sum(cost['commands'].values())}" if cost else "-")
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    for name, cells in run["redis_costs"].items():
        sample = cells.get("miss/128")
        if sample:
            lines.append(f"{name} miss/128 commands: {sample['commands']}")
    return "\n".join(lines)
