"""Scale-out on one host: pools of 1, 2, 4 and 8 nodes with the same working set.

    python -m bench.scale.pool                                  # 1,2,4,8 nodes x 64 MiB, 256 MiB working set
    python -m bench.scale.pool --sizes 1,8 --working-set 64MiB

For each pool size: a fresh redis-server and that many ``kvpool node`` processes
(DRAM only, no shared-memory arena, so reads go over TCP as from another host).
K client tasks on one :class:`PoolClient` put the working set, then get it back;
every byte read is compared with what was written (outside the timed part). The
table gives put and get GB/s, the hit rate (the working set is larger than one
node, so the hit rate shows capacity adding up), the Redis commands per key looked
up and per key put (``INFO commandstats`` deltas over the phase, the nodes'
heartbeats included), and each figure as a ratio to the 1-node pool.

On the largest pool it then measures membership changes:

* join: a new node starts; its share of the next batch of writes beside its share
  of the pool's free space (what placement weighs by);
* kill: ``kill -9`` of one node: hits lost beside the keys only it held, for the
  ``replicas=1`` working set and for a ``replicas=2`` set;
* drain: ``kvpool drain`` of another node, then its stop: hits of the working set
  before and after.

and what the registry costs Redis as the fleet grows: per client and second while
membership is unchanged (the client asks for nodes as a serving engine does; its
commands counted by ``bench.harness.resp_proxy``), per client and membership change, a full
read of the registry, and per node and second (heartbeats, ``INFO commandstats``
with no client); then the Redis commands per second those rates mean for 10,000
engines and 1,000 nodes at the default intervals (``--fleet-engines``,
``--fleet-nodes``, ``--changes-per-node-day``). ``--registry-only`` measures just
that, on a pool of the largest size.

Finally ``redis-benchmark`` (pipelined) gives this machine's Redis ops/s for the two
commands that dominate: HGETALL of an index entry (a lookup) and the commit Lua
script (a put). Results go to ``docs/results/scale-<timestamp>.json``.

``--report`` runs the scale report instead (``bench/scale/report.py``): a node of
``--chunks`` chunks (default 1,000,000; ``--quick``: 200,000) measured against every
budget of issue #34, one summary table at the end, the figures in
``docs/results/scale-report-<timestamp>.json``; ``--parts`` picks some of
node,nvme,disk,redis,sweep.

    python -m bench.scale.pool --report                         # a node of 1,000,000 chunks
    python -m bench.scale.pool --report --quick --parts node,nvme
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from backend.admin import drain
from backend.config import format_size, parse_size
from backend.embedded import EmbeddedRedis
from backend.errors import KVPoolError
from backend.launch.nodes import NodeProcess
from backend.metadata import COMMIT_LUA, Location, MetadataStore
from bench.harness.resp_proxy import CountingProxy
from bench.paths import RESULTS
from bench.scale import report as scale_report
from kvpool import Chunk, PoolClient, PoolConfig

NODE_START_TIMEOUT_S = 60.0
JOIN_KEYS = 4000  # small writes after a join: enough that the joiner's share is read to +-4%
JOIN_VALUE_BYTES = 1024
REPLICATED_SHARE = 8  # the replicas=2 set of the kill experiment: 1/8 of the working set's keys
REDIS_BENCH_REQUESTS = 200_000
REGISTRY_IDLE_S = 5.0  # how long the registry's idle cost is counted
ENGINE_ASKS_S = 0.01  # a serving engine asks for the nodes this often (every lookup and get does)
# An index value as a node writes it for a 256 KiB DRAM copy (records.Location.encode); its checksum
# has no zero byte, so the value passes through redis-benchmark's command line.
ENTRY = Location("n0", 1, "dram", 262144, int.from_bytes(b"kvpool!!", "big")).encode()


class Pool:
    """A redis-server and ``kvpool node`` processes on this host, stopped by their own pids."""

    def __init__(self, namespace: str = "scale") -> None:
        self.namespace = namespace
        self.redis = EmbeddedRedis().start()
        self.nodes: dict[str, NodeProcess] = {}

    @property
    def url(self) -> str:
        return f"kvpool://127.0.0.1:{self.redis.port}/{self.namespace}?shm=off"

    def start_nodes(self, dram: str, node_ids: Sequence[str]) -> None:
        """Start the nodes together, then wait for each to say it is ready."""
        started = []
        for node_id in node_ids:
            args = [
                "--redis",
                self.redis.url,
                "--namespace",
                self.namespace,
                "--dram",
                dram,
                "--nvme",
                "0",
                "--shm-dir",
                "off",
                "--prefault",
                "off",
                "--node-id",
                node_id,
            ]
            started.append(NodeProcess(args).spawn())
        for node_id, process in zip(node_ids, started):
            process.wait_ready(NODE_START_TIMEOUT_S)
            self.nodes[node_id] = process

    def stop_node(self, node_id: str, sig: int = signal.SIGTERM) -> None:
        process = self.nodes.pop(node_id)
        if sig == signal.SIGKILL:
            process.kill()
        else:
            process.stop(sig)

    def commandstats(self) -> Counter[str]:
        """Calls per Redis command since the server started."""
        with redis.Redis(port=self.redis.port) as r:
            stats = r.info("commandstats")
        return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})

    def rss_mib(self) -> float:
        """Mean resident memory of the node processes (MiB), from /proc."""
        sizes = []
        for process in self.nodes.values():
            sizes.append(process.memory()["VmRSS"] / (1024 * 1024))
        return sum(sizes) / len(sizes)

    def registry_entry_bytes(self) -> float:
        """Mean size of one node's registry entry: what every client re-reads each second."""
        with redis.Redis(port=self.redis.port) as r:
            entries = r.hgetall(f"kvp:{{{self.namespace}}}:nodes")
        return sum(len(v) for v in entries.values()) / max(1, len(entries))

    def close(self) -> None:
        for node_id in list(self.nodes):
            self.stop_node(node_id)
        self.redis.cleanup()


def _working_set(total_bytes: int, chunk_bytes: int) -> list[Chunk]:
    return [Chunk(f"ws@{i}", os.urandom(chunk_bytes)) for i in range(total_bytes // chunk_bytes)]


async def _put_all(client: PoolClient, chunks: Sequence[Chunk], tasks: int, batch: int) -> int:
    """Put ``chunks`` from ``tasks`` concurrent tasks in batches; returns how many failed."""

    async def worker(part: Sequence[Chunk]) -> int:
        failed = 0
        for start in range(0, len(part), batch):
            try:
                await client.put(part[start : start + batch])
            except Exception:  # a full pool refuses some writes; counted, not fatal
                failed += len(part[start : start + batch])
        return failed

    return sum(await asyncio.gather(*(worker(chunks[k::tasks]) for k in range(tasks))))


async def _get_all(client: PoolClient, keys: Sequence[str], tasks: int, batch: int) -> list[Any]:
    """Get ``keys`` from ``tasks`` concurrent tasks; results in key order (None for a miss)."""
    out: list[Any] = [None] * len(keys)

    async def worker(k: int) -> None:
        indexes = list(range(k, len(keys), tasks))
        for start in range(0, len(indexes), batch):
            part = indexes[start : start + batch]
            for index, got in zip(part, await client.get([keys[i] for i in part])):
                out[index] = got

    await asyncio.gather(*(worker(k) for k in range(tasks)))
    return out


def _hits(chunks: Sequence[Chunk], got: Sequence[Any]) -> int:
    """Hits, after checking every hit byte for byte (a wrong byte stops the run)."""
    for chunk, fetched in zip(chunks, got):
        if fetched is not None and bytes(fetched.data) != bytes(chunk.data):
            raise SystemExit(f"wrong bytes read for {chunk.key}")
    return sum(1 for g in got if g is not None)


async def _holders(client: PoolClient, keys: Sequence[str]) -> list[set[str]]:
    return [{loc.node_id for loc in entry} for entry in await client.index.lookup(keys)]


async def _evictions(client: PoolClient) -> int:
    """Chunks the live nodes have evicted since they started (DRAM full, no NVMe tier)."""
    nodes = await client.nodes(refresh=True)
    total = 0
    for node in nodes:
        with contextlib.suppress(KVPoolError):  # a node just killed is listed until its heartbeat expires
            total += int((await client.node_stats(node))["counters"].get("evictions", 0))
    return total


async def measure_size(n: int, args: argparse.Namespace, chunks: Sequence[Chunk]) -> tuple[dict[str, Any], Pool]:
    """One pool of ``n`` nodes: put then get the working set. The pool is left running."""
    pool = Pool()
    pool.start_nodes(args.node_dram, [f"n{i}" for i in range(n)])
    keys = [c.key for c in chunks]
    total = sum(len(c.data) for c in chunks)
    idle_rss_mib = pool.rss_mib()
    async with PoolClient(PoolConfig.from_url(pool.url)) as client:
        await client.nodes(refresh=True)
        put_s: list[float] = []
        get_s: list[float] = []
        put_cmds: Counter[str] = Counter()
        get_cmds: Counter[str] = Counter()
        for _ in range(args.rounds):  # later rounds overwrite the same keys
            before = pool.commandstats()
            start = time.perf_counter()
            failed = await _put_all(client, chunks, args.tasks, args.batch)
            put_s.append(time.perf_counter() - start)
            mid = pool.commandstats()
            start = time.perf_counter()
            got = await _get_all(client, keys, args.tasks, args.batch)
            get_s.append(time.perf_counter() - start)
            after = pool.commandstats()
            put_cmds += mid - before
            get_cmds += after - mid
            hits = _hits(chunks, got)
            del got
        holders = await _holders(client, keys)
        evicted = await _evictions(client)
    looked_up = len(keys) * args.rounds
    row = {
        "nodes": n,
        "capacity_bytes": n * parse_size(args.node_dram),
        "working_set_bytes": total,
        "put_s": put_s,
        "get_s": get_s,
        "put_gbps": total / statistics.median(put_s) / 1e9,
        "get_gbps": hits * args.chunk_bytes / statistics.median(get_s) / 1e9,  # bytes actually moved
        "put_failed": failed,
        "hit_rate": hits / len(chunks),
        "evictions": evicted,
        "node_rss_idle_mib": idle_rss_mib,
        "node_rss_full_mib": pool.rss_mib(),
        "registry_entry_bytes": pool.registry_entry_bytes(),
        "redis_cmds_per_get_key": sum(get_cmds.values()) / looked_up,
        "hgetall_per_get_key": get_cmds["hgetall"] / looked_up,
        "redis_cmds_per_put_key": sum(put_cmds.values()) / looked_up,
        "evalsha_per_put_key": put_cmds["evalsha"] / looked_up,
        "get_phase_commands": dict(get_cmds),
        "put_phase_commands": dict(put_cmds),
        "keys_per_node": dict(Counter(node for held in holders for node in held)),
    }
    return row, pool


async def registry_cost(pool: Pool) -> dict[str, Any]:
    """Redis commands the registry costs: per client idle second, per change, per full read, per node second."""
    result: dict[str, Any] = {"nodes": len(pool.nodes)}
    with CountingProxy(pool.redis.port) as proxy:
        url = f"kvpool://127.0.0.1:{proxy.port}/{pool.namespace}?shm=off"
        async with PoolClient(PoolConfig.from_url(url)) as client:

            def sent() -> int:
                return int(proxy.counts()["requests"])

            await client.nodes(refresh=True)
            before, start = sent(), time.monotonic()
            while time.monotonic() - start < REGISTRY_IDLE_S:
                await client.nodes()  # refreshed in the background at most every second
                await asyncio.sleep(ENGINE_ASKS_S)
            result["client_idle_cmds_per_s"] = (sent() - before) / (time.monotonic() - start)
            before = sent()
            await client.nodes(refresh=True)
            result["full_read_cmds"] = sent() - before
            store = MetadataStore(pool.redis.url, pool.namespace)
            try:
                node_id = next(iter(pool.nodes))
                await client.registry.refresh()
                await store.registry.set_draining(node_id, True)  # one membership change
                before = sent()
                await client.registry.refresh()
                result["change_cmds"] = sent() - before
                await store.registry.set_draining(node_id, False)
            finally:
                await store.close()
    stats_before, start = pool.commandstats(), time.monotonic()
    await asyncio.sleep(REGISTRY_IDLE_S)  # the nodes alone: their heartbeats
    beats = pool.commandstats() - stats_before
    result["node_cmds_per_s"] = sum(beats.values()) / (time.monotonic() - start) / len(pool.nodes)
    result["node_commands"] = dict(beats)
    result["registry_entry_bytes"] = pool.registry_entry_bytes()
    return result


def fleet(cost: dict[str, Any], engines: int, nodes: int, changes_per_node_day: float) -> dict[str, float]:
    """Redis commands per second for ``engines`` clients and ``nodes`` nodes, from the measured rates.

    A full read costs 2 + (nodes) commands (the registry hash, the draining set, one
    heartbeat key per node): what every client paid every second before the version key.
    """
    changes_per_s = nodes * changes_per_node_day / 86_400
    full_read = 2 + nodes
    return {
        "engines_idle_cmds_per_s": engines * cost["client_idle_cmds_per_s"],
        "nodes_cmds_per_s": nodes * cost["node_cmds_per_s"],
        "changes_per_s": changes_per_s,
        "engines_change_cmds_per_s": engines * changes_per_s * cost["change_cmds"],
        "before_version_key_cmds_per_s": engines * full_read,
        "before_version_key_bytes_per_s": engines * nodes * cost["registry_entry_bytes"],
    }


def _print_fleet(cost: dict[str, Any], scaled: dict[str, float], engines: int, nodes: int) -> None:
    total = scaled["engines_idle_cmds_per_s"] + scaled["nodes_cmds_per_s"] + scaled["engines_change_cmds_per_s"]
    print(
        f"registry, measured on {cost['nodes']} nodes: a client {cost['client_idle_cmds_per_s']:.2f} commands/s "
        f"while nothing changes, {cost['change_cmds']} per membership change, {cost['full_read_cmds']} per full "
        f"read; a node {cost['node_cmds_per_s']:.2f} commands/s (heartbeats)"
    )
    print(
        f"registry at {engines:,} engines and {nodes:,} nodes: {scaled['engines_idle_cmds_per_s']:,.0f} (engines) + "
        f"{scaled['nodes_cmds_per_s']:,.0f} (nodes) + {scaled['engines_change_cmds_per_s']:,.0f} (changes, "
        f"{scaled['changes_per_s']:.3f}/s) = {total:,.0f} commands/s; before the version key every engine read "
        f"the whole registry each second: {scaled['before_version_key_cmds_per_s']:,.0f} commands/s and "
        f"{scaled['before_version_key_bytes_per_s'] / 1e9:.1f} GB/s of registry entries"
    )


async def membership(pool: Pool, args: argparse.Namespace, chunks: Sequence[Chunk]) -> dict[str, Any]:
    """Join, kill and drain on a running pool whose working set was put with replicas=1."""
    keys = [c.key for c in chunks]
    out: dict[str, Any] = {}
    async with (
        PoolClient(PoolConfig.from_url(pool.url)) as client,
        PoolClient(PoolConfig.from_url(pool.url + "&replicas=2")) as client2,
    ):
        # Join: the new node's share of the next writes vs its share of free space.
        pool.start_nodes(args.node_dram, ["joiner"])
        view = await client.nodes(refresh=True)
        free = {n.node_id: n.free_bytes for n in view}
        fresh = [Chunk(f"join@{i}", os.urandom(JOIN_VALUE_BYTES)) for i in range(args.join_keys)]
        await client.put(fresh)
        share = Counter(node for held in await _holders(client, [c.key for c in fresh]) for node in held)
        out["join"] = {
            "joiner_write_share": share["joiner"] / args.join_keys,
            "joiner_free_share": free.get("joiner", 0) / sum(free.values()),
            "joiner_capacity_share": 1 / len(view),
        }
        replicated = [Chunk(f"r2@{i}", os.urandom(args.chunk_bytes)) for i in range(len(chunks) // REPLICATED_SHARE)]
        await _put_all(client2, replicated, args.tasks, args.batch)

        # Kill n2 (SIGKILL): only keys it alone held are lost.
        hits_before = _hits(chunks, await _get_all(client, keys, args.tasks, args.batch))
        holders = await _holders(client, keys)
        alone = {k for k, held in zip(keys, holders) if held == {"n2"}}
        pool.stop_node("n2", signal.SIGKILL)
        got = await _get_all(client, keys, args.tasks, args.batch)
        lost = {k for k, g, held in zip(keys, got, holders) if g is None and held}
        hits_killed = _hits(chunks, got)
        del got
        got2 = await _get_all(client2, [c.key for c in replicated], args.tasks, args.batch)
        out["kill"] = {
            "node": "n2",
            "replicas_1": {
                "hits_before": hits_before,
                "hits_after": hits_killed,
                "lost": len(lost),
                "held_only_by_killed": len(alone),
                "lost_exactly_those": lost == alone,
            },
            "replicas_2": {"keys": len(replicated), "hits_after": _hits(replicated, got2)},
        }
        # Drain n1, then stop it: the working set's hits should not change.
        hits_before = hits_killed
        only_there = sum(1 for held in await _holders(client, keys) if held == {"n1"})
        evicted = await _evictions(client)
        report = await drain(client, "n1")
        evicted = await _evictions(client) - evicted
        pool.stop_node("n1")
        await client.nodes(refresh=True)
        hits_after = _hits(chunks, await _get_all(client, keys, args.tasks, args.batch))
        out["drain"] = {
            "node": "n1",
            "working_set_keys_only_there": only_there,
            "moved": report.moved,
            "already_elsewhere": report.already_elsewhere,
            "unreadable": report.unreadable,
            "evictions_during_drain": evicted,
            "hits_before": hits_before,
            "hits_after": hits_after,
        }
    return out


def redis_benchmark() -> dict[str, float] | None:
    """This machine's pipelined Redis ops/s for an index lookup and a commit (None without redis-benchmark)."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    server = EmbeddedRedis().start()
    try:
        with redis.Redis(port=server.port) as r:
            sha = r.script_load(COMMIT_LUA)
            r.hset("kvp:b/one", "1", ENTRY)
        base = [binary, "-p", str(server.port), "-q", "-n", str(REDIS_BENCH_REQUESTS), "-P", "16", "-c", "8"]
        out: dict[str, float] = {}
        commands = {
            "hgetall": ["HGETALL", "kvp:b/one"],
            # a fresh random key per call, as puts of new chunks are
            "commit_lua": ["-r", "1000000", "EVALSHA", sha, "1", "kvp:b/__rand_int__", "1", ENTRY],
        }
        for name, command in commands.items():
            # (its output echoes the command, binary value included)
            text = subprocess.run(base + command, capture_output=True, timeout=120).stdout.decode(errors="replace")
            match = re.findall(r"([\d.]+) requests per second", text)
            out[f"{name}_ops_per_s"] = float(match[-1]) if match else float("nan")
        return out
    finally:
        server.cleanup()


def _print_table(rows: Sequence[dict[str, Any]]) -> None:
    base = rows[0]
    print(
        f"{'nodes':>5} {'capacity':>9} {'put GB/s':>9} {'get GB/s':>9} {'hit rate':>8} "
        f"{'cmds/lookup':>11} {'HGETALL/key':>11} {'cmds/put':>8}  ratio put/get/hits to {base['nodes']} node"
    )
    for row in rows:
        ratios = [row[f] / base[f] if base[f] else float("nan") for f in ("put_gbps", "get_gbps", "hit_rate")]
        print(
            f"{row['nodes']:>5} {format_size(row['capacity_bytes']):>9} {row['put_gbps']:>9.3f} "
            f"{row['get_gbps']:>9.3f} {row['hit_rate']:>8.3f} {row['redis_cmds_per_get_key']:>11.2f} "
            f"{row['hgetall_per_get_key']:>11.2f} {row['redis_cmds_per_put_key']:>8.2f}  "
            f"{ratios[0]:.2f} / {ratios[1]:.2f} / {ratios[2]:.2f}"
        )


def _report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--report``: the arguments checked (each part's fewest chunks named), then the report."""
    if args.quick and args.chunks is not None:
        parser.error("--quick is --chunks 200000: give one of them")
    chunks = scale_report.QUICK_CHUNKS if args.quick else args.chunks or scale_report.DEFAULT_CHUNKS
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in parts if part not in scale_report.PARTS]
    if unknown or not parts:
        parser.error(f"--parts {args.parts!r}: choose from {','.join(scale_report.PARTS)}")
    for part in parts:
        if chunks < scale_report.min_chunks(part):
            parser.error(
                f"--chunks {chunks:,} is too few for the {part} part: it needs at least "
                f"{scale_report.min_chunks(part):,}"
            )
    return scale_report.report(chunks, parts, args.results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2,4,8", help="pool sizes in nodes (default 1,2,4,8)")
    parser.add_argument("--node-dram", default="64MiB", help="DRAM tier of each node (default 64MiB)")
    parser.add_argument("--working-set", default="256MiB", help="bytes put then read back (default 256MiB)")
    parser.add_argument("--chunk", default="256KiB", help="value size (default 256KiB)")
    parser.add_argument("--tasks", type=int, default=4, help="concurrent client tasks (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="chunks per put/get call (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="put+get rounds per pool; GB/s is the median (default 3)")
    parser.add_argument(
        "--join-keys", type=int, default=JOIN_KEYS, help=f"1 KiB writes after the join (default {JOIN_KEYS})"
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory for the JSON (default docs/results)")
    parser.add_argument("--no-redis-benchmark", action="store_true", help="skip the redis-benchmark figures")
    parser.add_argument("--registry-only", action="store_true", help="only the registry's cost, on the largest pool")
    parser.add_argument("--fleet-engines", type=int, default=10_000, help="engines to extrapolate to (10,000)")
    parser.add_argument("--fleet-nodes", type=int, default=1_000, help="nodes to extrapolate to (1,000)")
    parser.add_argument(
        "--changes-per-node-day",
        type=float,
        default=24.0,
        help="membership changes per node and day to extrapolate with (default 24)",
    )
    report = parser.add_argument_group("the scale report (issue #34)")
    report.add_argument("--report", action="store_true", help="run the scale report instead of the scale-out bench")
    report.add_argument(
        "--chunks", type=int, default=None, help=f"chunks a node holds (default {scale_report.DEFAULT_CHUNKS:,})"
    )
    report.add_argument("--quick", action="store_true", help=f"{scale_report.QUICK_CHUNKS:,} chunks")
    report.add_argument(
        "--parts", default=",".join(scale_report.PARTS), help=f"some of {','.join(scale_report.PARTS)} (default all)"
    )
    args = parser.parse_args()
    if args.report:
        return _report(parser, args)
    if args.chunks is not None or args.quick or args.parts != ",".join(scale_report.PARTS):
        parser.error("--chunks, --quick and --parts go with --report")
    args.chunk_bytes = parse_size(args.chunk)
    sizes = [int(s) for s in args.sizes.split(",")]
    chunks = _working_set(parse_size(args.working_set), args.chunk_bytes)
    print(
        f"scale-out on one host ({os.cpu_count()} CPUs): {len(chunks)} x {args.chunk} working set, "
        f"{args.node_dram} DRAM per node, {args.tasks} client tasks x batch {args.batch}",
        flush=True,
    )

    rows: list[dict[str, Any]] = []
    events: dict[str, Any] = {}
    registry: dict[str, Any] = {}
    if args.registry_only:
        sizes, args.no_redis_benchmark = [max(sizes)], True
    for n in sizes:
        if args.registry_only:
            pool = Pool()
            pool.start_nodes(args.node_dram, [f"n{i}" for i in range(n)])
            try:
                registry = asyncio.run(registry_cost(pool))
            finally:
                pool.close()
            continue
        row, pool = asyncio.run(measure_size(n, args, chunks))
        rows.append(row)
        print(
            f"  {n} node(s): put {row['put_gbps']:.3f} GB/s, get {row['get_gbps']:.3f} GB/s, "
            f"hit rate {row['hit_rate']:.3f}",
            flush=True,
        )
        try:
            if n == max(sizes):
                registry = asyncio.run(registry_cost(pool))
            if n == max(sizes) and n >= 3:
                events = asyncio.run(membership(pool, args, chunks))
        finally:
            pool.close()
    bench = None if args.no_redis_benchmark else redis_benchmark()

    scaled = fleet(registry, args.fleet_engines, args.fleet_nodes, args.changes_per_node_day) if registry else {}
    print()
    if rows:
        _print_table(rows)
    if registry:
        _print_fleet(registry, scaled, args.fleet_engines, args.fleet_nodes)
    if events:
        join, drained, killed = events["join"], events["drain"], events["kill"]
        print(
            f"join: the new node took {join['joiner_write_share']:.3f} of the next {args.join_keys} writes "
            f"(its free-space share {join['joiner_free_share']:.3f}, capacity share "
            f"{join['joiner_capacity_share']:.3f})"
        )
        one, two = killed["replicas_1"], killed["replicas_2"]
        print(
            f"kill -9 {killed['node']}: replicas=1 hits {one['hits_before']} -> {one['hits_after']} "
            f"({one['lost']} lost; {one['held_only_by_killed']} were held only there); "
            f"replicas=2: {two['hits_after']} of {two['keys']} hit"
        )
        print(
            f"drain {drained['node']}: {drained['moved']} chunks moved ({drained['working_set_keys_only_there']} "
            f"of the working set), {drained['already_elsewhere']} had a copy elsewhere; hits "
            f"{drained['hits_before']} -> {drained['hits_after']} after stopping it"
        )
    if bench:
        print(
            f"redis-benchmark (-P 16 -c 8): HGETALL {bench['hgetall_ops_per_s']:,.0f}/s, "
            f"commit Lua {bench['commit_lua_ops_per_s']:,.0f}/s"
        )

    args.results.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H%M%S")
    record = {
        "date": stamp,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "args": vars(args) | {"results": str(args.results)},
        "rows": rows,
        "membership": events,
        "registry": registry,
        "fleet": scaled,
        "redis_benchmark": bench,
    }
    path = args.results / f"scale-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
