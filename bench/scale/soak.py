"""A bounded soak: many clients, mixed put/get/contains, a working set larger than DRAM.

Starts its own redis-server and ``--nodes`` node processes, then runs ``--clients``
concurrent clients (asyncio tasks sharing a few PoolClients) for ``--duration``
seconds over a working set of ``--working-set`` times the pool's total DRAM, so the
nodes evict all the time. Every value is derived from its key and a version
number, so every hit is checked byte for byte (a miss is allowed; a wrong byte
never is). Prints ops, bytes, errors, hits and misses, and each node's resident
memory before and after, beside the bound it must stay under::

    python -m bench.scale.soak --duration 120 --clients 32 --nodes 2 --dram 64MiB

A put that met only busy nodes (DRAM full of puts in flight until its deadline:
``BusyError``) is not an error, LMCache skips such a put; but refusing everything
must not pass, so busy puts are counted and may be at most ``--max-busy`` of the puts.

Exits non-zero on any wrong byte, any error beyond ``--max-errors``, busy puts beyond
``--max-busy``, a node that died, or a node whose peak resident memory went past its bound. ``--json`` prints
the figures as one JSON line as well (the fault suite reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import struct
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from backend.client import Chunk, PoolClient
from backend.config import PoolConfig, parse_size
from backend.embedded import EmbeddedRedis
from backend.errors import BusyError, KVPoolError
from backend.launch.nodes import NodeProcess
from backend.node.store.tiers import PREFAULT_BUDGET_BYTES

START_TIMEOUT_S = 60.0
MIB = 1024 * 1024
# What a node may hold beyond its DRAM tier and pre-fault pool: the interpreter,
# its modules, connection and request state, allocator slack. A node that kept a
# reference to freed chunks, or allocated what a header declared, goes past it.
FIXED_OVERHEAD_BYTES = 128 * MIB
PATTERN_BYTES = 8 * MIB  # values are slices of this random pattern
VALUE_HEAD = struct.Struct("<QQ")  # key id, version: a value names what it should be
DEFAULT_MAX_BUSY = 0.01  # share of puts that may meet only busy nodes (skipped, as LMCache skips them)


class Values:
    """Deterministic values: key id and version in the head, then a slice of a fixed pattern."""

    def __init__(self, value_bytes: int, seed: int) -> None:
        self.value_bytes = value_bytes
        self.pattern = random.Random(seed).randbytes(PATTERN_BYTES)

    def _body(self, key_id: int, version: int) -> memoryview:
        span = self.value_bytes - VALUE_HEAD.size
        start = (key_id * 7919 + version * 104729) % (PATTERN_BYTES - span)
        return memoryview(self.pattern)[start : start + span]

    def make(self, key_id: int, version: int) -> bytes:
        return VALUE_HEAD.pack(key_id, version) + self._body(key_id, version)

    def check(self, key_id: int, data: Any, newest: int) -> bool:
        """True if ``data`` is exactly a version of this key that was written (1..newest)."""
        view = memoryview(data).cast("B")
        if len(view) != self.value_bytes:
            return False
        got_id, version = VALUE_HEAD.unpack(view[: VALUE_HEAD.size])
        return got_id == key_id and 1 <= version <= newest and view[VALUE_HEAD.size :] == self._body(key_id, version)


@dataclass
class Load:
    """What the clients did, summed over all of them."""

    ops: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    hits: int = 0
    misses: int = 0
    wrong: int = 0
    busy: int = 0  # puts refused as busy (skipped, not errors)


async def _client_loop(
    client: PoolClient,
    args: argparse.Namespace,
    values: Values,
    versions: list[int],
    load: Load,
    rng: random.Random,
    deadline: float,
    prefix: str,
) -> None:
    mix = [("put", args.put), ("get", args.get), ("contains", args.contains)]
    names, weights = [m[0] for m in mix], [m[1] for m in mix]
    while time.monotonic() < deadline:
        op = rng.choices(names, weights)[0]
        ids = rng.sample(range(len(versions)), args.batch)
        keys = [f"{prefix}-{i}" for i in ids]
        try:
            if op == "put":
                for i in ids:
                    versions[i] += 1
                chunks = [Chunk(key, values.make(i, versions[i])) for key, i in zip(keys, ids)]
                await client.put(chunks)
                load.bytes["put"] += args.batch * args.value_bytes
            elif op == "get":
                newest = [versions[i] for i in ids]  # read before the get: a hit may not be newer
                got = await client.get(keys)
                for i, top, fetched in zip(ids, newest, got):
                    if fetched is None:
                        load.misses += 1
                        continue
                    load.hits += 1
                    load.bytes["get"] += len(fetched.data)
                    if not values.check(i, fetched.data, max(top, versions[i])):
                        load.wrong += 1
                        print(f"[soak] WRONG BYTES for {prefix}-{i}", flush=True)
            else:
                await client.contains(keys)
            load.ops[op] += 1
        except BusyError:
            load.ops[op] += 1
            load.busy += 1
        except KVPoolError as exc:
            load.errors[f"{op}:{type(exc).__name__}"] += 1
            if sum(load.errors.values()) <= 5:
                print(f"[soak] {op} failed: {exc}", flush=True)


async def _run_load(url: str, args: argparse.Namespace, keys_total: int) -> Load:
    values = Values(args.value_bytes, args.seed)
    versions = [0] * keys_total
    load = Load()
    prefix = "soak-" + uuid.uuid4().hex[:8]
    clients = [PoolClient(PoolConfig.from_url(url)) for _ in range(args.pool_clients)]
    try:
        deadline = time.monotonic() + args.duration
        await asyncio.gather(
            *(
                _client_loop(
                    clients[n % len(clients)],
                    args,
                    values,
                    versions,
                    load,
                    random.Random(args.seed + n),
                    deadline,
                    prefix,
                )
                for n in range(args.clients)
            )
        )
    finally:
        for client in clients:
            await client.close()
    return load


async def _node_counters(url: str) -> dict[str, dict[str, Any]]:
    async with PoolClient(PoolConfig.from_url(url)) as client:
        return {node.node_id: (await client.node_stats(node))["counters"] for node in await client.nodes(refresh=True)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the pool, run the load, stop everything; returns the figures."""
    dram_bytes = parse_size(args.dram)
    keys_total = max(int(args.working_set * args.nodes * dram_bytes / args.value_bytes), args.batch * 2)
    bound = dram_bytes + min(PREFAULT_BUDGET_BYTES, dram_bytes // 4) + FIXED_OVERHEAD_BYTES
    namespace = "soak" + uuid.uuid4().hex[:8]
    nodes: list[NodeProcess] = []
    with EmbeddedRedis() as redis_server:
        try:
            for _ in range(args.nodes):
                node_args = [
                    "--redis",
                    redis_server.url,
                    "--namespace",
                    namespace,
                    "--dram",
                    args.dram,
                    "--shm-dir",
                    args.shm_dir,
                    "--prefault",
                    "off",
                ]
                nodes.append(NodeProcess(node_args).start(START_TIMEOUT_S))
            url = f"kvpool://127.0.0.1:{redis_server.port}/{namespace}?connect_timeout_s={args.timeout_s}&progress_timeout_s={args.timeout_s}"
            before = {n.node_id: n.memory() for n in nodes}
            print(
                f"[soak] {args.clients} clients for {args.duration:.0f} s on {args.nodes} nodes of {args.dram} DRAM; "
                f"working set {keys_total} keys x {args.value_bytes} B = "
                f"{keys_total * args.value_bytes / MIB:.0f} MiB ({args.working_set:g}x DRAM)",
                flush=True,
            )
            started = time.monotonic()
            load = asyncio.run(_run_load(url, args, keys_total))
            elapsed = time.monotonic() - started
            after = {n.node_id: n.memory() for n in nodes}
            alive = {n.node_id: n.alive() for n in nodes}
            counters = asyncio.run(_node_counters(url)) if all(alive.values()) else {}
        finally:
            for node in nodes:
                node.stop()
    per_node = {
        node_id: {
            "rss_before_bytes": before[node_id].get("VmRSS", 0),
            "rss_after_bytes": after[node_id].get("VmRSS", 0),
            "rss_peak_bytes": after[node_id].get("VmHWM", 0),
            "bound_bytes": before[node_id].get("VmRSS", 0) + bound,
            "alive": alive[node_id],
            "evictions": counters.get(node_id, {}).get("evictions", 0),
            "puts": counters.get(node_id, {}).get("puts", 0),
            "put_rejected_busy": counters.get(node_id, {}).get("put_rejected_busy", 0),
        }
        for node_id in before
    }
    ops = sum(load.ops.values())
    return {
        "duration_s": round(elapsed, 1),
        "clients": args.clients,
        "nodes": args.nodes,
        "dram": args.dram,
        "value_bytes": args.value_bytes,
        "working_set_keys": keys_total,
        "ops": dict(load.ops),
        "ops_total": ops,
        "ops_per_s": round(ops / elapsed, 1),
        "put_bytes": load.bytes["put"],
        "get_bytes": load.bytes["get"],
        "hits": load.hits,
        "misses": load.misses,
        "wrong_bytes": load.wrong,
        "busy_puts": load.busy,
        "errors": dict(load.errors),
        "errors_total": sum(load.errors.values()),
        "nodes_detail": per_node,
    }


def verdict(figures: dict[str, Any], max_errors: int, max_busy: float = DEFAULT_MAX_BUSY) -> list[str]:
    """Why the soak failed; empty if it passed."""
    problems = []
    if figures["wrong_bytes"]:
        problems.append(f"{figures['wrong_bytes']} hits returned wrong bytes")
    if figures["errors_total"] > max_errors:
        problems.append(f"{figures['errors_total']} errors (allowed {max_errors}): {figures['errors']}")
    puts, busy = figures["ops"].get("put", 0), figures.get("busy_puts", 0)
    if busy > max_busy * puts:
        problems.append(f"{busy} of {puts} puts refused as busy (allowed {max_busy:.0%})")
    for node_id, node in figures["nodes_detail"].items():
        if not node["alive"]:
            problems.append(f"node {node_id} died")
        if node["rss_peak_bytes"] > node["bound_bytes"]:
            problems.append(
                f"node {node_id} peak RSS {node['rss_peak_bytes'] / MIB:.0f} MiB "
                f"over its bound {node['bound_bytes'] / MIB:.0f} MiB"
            )
    return problems


def report(figures: dict[str, Any]) -> None:
    f = figures
    print(f"[soak] {f['ops_total']} ops in {f['duration_s']} s ({f['ops_per_s']} ops/s): {f['ops']}")
    print(
        f"[soak] put {f['put_bytes'] / MIB:.0f} MiB, got {f['get_bytes'] / MIB:.0f} MiB; "
        f"{f['hits']} hits, {f['misses']} misses, {f['wrong_bytes']} wrong; "
        f"errors {f['errors_total']} {f['errors'] or ''}; {f['busy_puts']} of {f['ops'].get('put', 0)} puts busy"
    )
    print("[soak] node            RSS before  RSS after  peak RSS  bound     evictions")
    for node_id, n in f["nodes_detail"].items():
        print(
            f"[soak] {node_id:<15} {n['rss_before_bytes'] / MIB:7.0f} MiB {n['rss_after_bytes'] / MIB:6.0f} MiB "
            f"{n['rss_peak_bytes'] / MIB:5.0f} MiB {n['bound_bytes'] / MIB:5.0f} MiB {n['evictions']:9d}"
            f"{'' if n['alive'] else '  DIED'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--pool-clients", type=int, default=4, help="PoolClients the clients share (default 4)")
    parser.add_argument("--nodes", type=int, default=2, help="node processes (default 2)")
    parser.add_argument("--dram", default="64MiB", help="DRAM tier of each node (default 64MiB)")
    parser.add_argument("--working-set", type=float, default=2.0, help="working set / total DRAM (default 2)")
    parser.add_argument("--value-bytes", type=int, default=256 * 1024, help="bytes per value (default 256 KiB)")
    parser.add_argument("--batch", type=int, default=4, help="keys per operation (default 4)")
    parser.add_argument("--put", type=float, default=3, help="weight of puts in the mix (default 3)")
    parser.add_argument("--get", type=float, default=5, help="weight of gets (default 5)")
    parser.add_argument("--contains", type=float, default=2, help="weight of contains (default 2)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=10.0,
        help="client connect and progress timeout, seconds (default 10: 2 cores)",
    )
    parser.add_argument("--shm-dir", default="off", help="nodes' --shm-dir (default off: TCP, as from another host)")
    parser.add_argument("--max-errors", type=int, default=0, help="errors allowed before exiting non-zero")
    parser.add_argument(
        "--max-busy",
        type=float,
        default=DEFAULT_MAX_BUSY,
        help="share of puts that may be refused as busy (default 0.01)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args(argv)
    if args.value_bytes <= VALUE_HEAD.size or args.value_bytes > PATTERN_BYTES // 2:
        parser.error(f"--value-bytes must be in {VALUE_HEAD.size + 1}..{PATTERN_BYTES // 2}")
    figures = run(args)
    report(figures)
    problems = verdict(figures, args.max_errors, args.max_busy)
    for problem in problems:
        print(f"[soak] FAIL: {problem}", flush=True)
    if not problems:
        print(
            "[soak] PASS: no wrong byte, errors and busy puts within the allowance, every node within its memory bound"
        )
    if args.json:
        print(json.dumps(figures), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
