"""The Redis side at scale: sweeping a dead node, admin verbs over a large index, lookups at 10^4 vs 10^6.

    python -m bench.scale.sweep                              # 100,000 chunks: every part, small
    python -m bench.scale.sweep --chunks 1000000             # the issue's figures (about 5 minutes)
    python -m bench.scale.sweep --parts admin --chunks 10000000

Three parts, each on a fresh redis-server of this machine with its default config; the
index is written directly (``redis-cli --pipe`` of HSETs with the values a node's commit
writes, ``Location.encode``), not through nodes, so that 10^7 entries take a minute
instead of hours. What reads and removes them is the real code.

* ``sweep``: a pool of N keys, each with a copy on a dead node (registered, its heartbeat
  gone) and half of them with a copy on a live ``kvpool node`` process, which is the
  pool's reaper (``--dead-node-grace-s``). Measured: how long its walk takes once the
  grace is over (its log: "swept the index in X s"), keys per second, and what Redis's
  other clients see meanwhile: a probe's PING every 2 ms (p50/p99/max, from another
  process), and Redis's own SLOWLOG (every command over 1 ms) and LATENCY monitor. Then
  1,000 random keys are read back: no dead field left, every live one kept.
* ``admin``: N keys of one live node; ``kvpool ls --prefix`` and ``kvpool evict
  --prefix`` of one model's 1,000 keys (both walk every key with SCAN), ``kvpool stats``
  and ``kvpool status`` (registry and nodes only): each one's wall time and peak RSS
  (``wait4``), and the slowest Redis command meanwhile (SLOWLOG over 1 ms).
* ``lookup``: two redis-servers, one with 10^4 keys and one with N, read in turns by the
  live lookup (``LiveLookup.lookup_live``, one EVALSHA of 1,000 keys): p50/p99 of
  random keys and of 1,000 keys stored together (a request's chunks are), and Redis's
  own time per call (``INFO commandstats``).

Targets (issue 34): a dead node of 10^6 chunks gone within 300 s, no Redis call over
10 ms; admin verbs' Redis calls under 10 ms at 10^7 keys, ``stats``/``status`` bounded;
lookup p50 at 10^6 within 1.2x of 10^4. Returns ``{part: {figure: value}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import redis

from backend.embedded import free_port
from backend.launch.nodes import NodeProcess
from backend.launch.redis_servers import RedisProcesses
from backend.metadata import Location, MetadataStore, NodeInfo
from bench.paths import REPO
from bench.scale.redis_memory import inprocess_keys
from kvpool import PoolConfig, SyncPoolClient

__all__ = ["SWEEP_TARGET_S", "CALL_TARGET_MS", "LOOKUP_RATIO_TARGET", "fill_index", "sweep", "admin", "lookup", "main"]

SWEEP_TARGET_S = 300.0
CALL_TARGET_MS = 10.0
LOOKUP_RATIO_TARGET = 1.2
NAMESPACE = "default"
CHUNK_BYTES = 2 * 1024 * 1024
PIPE_BATCH = 20_000  # commands per write to redis-cli --pipe
PROBE_INTERVAL_S = 0.002
SLOW_US = 1000  # SLOWLOG keeps every command slower than this
REDIS_NICE = -10
REHASH_WAIT_S = 900.0
LOOKUP_KEYS = 1000
LOOKUP_ROUNDS = 300
SMALL_INDEX = 10_000
GRACE_S = 1.0
SWEEP_WAIT_S = 1800.0
CHECK_SAMPLE = 1000
ADMIN_MODEL_KEYS = 1000

# A probe in its own process: PING every 2 ms, print the latencies (ms) as JSON when stdin closes.
_PROBE = """
import json, sys, threading, time, redis
r = redis.Redis(port=int(sys.argv[1]))
out, stop = [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    t = time.perf_counter(); r.ping(); out.append((time.perf_counter() - t) * 1000)
    time.sleep(float(sys.argv[2]))
print(json.dumps(out))
"""


def _resp(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def mass_insert(port: int, commands: Iterable[bytes]) -> int:
    """Send RESP ``commands`` through ``redis-cli --pipe``; how many replies came back (errors raise)."""
    proc = subprocess.Popen(["redis-cli", "-p", str(port), "--pipe"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    batch: list[bytes] = []
    for command in commands:
        batch.append(command)
        if len(batch) >= PIPE_BATCH:
            proc.stdin.write(b"".join(batch))
            batch = []
    proc.stdin.write(b"".join(batch))
    proc.stdin.close()
    text = proc.stdout.read().decode()
    proc.wait()
    found = re.search(r"errors: (\d+), replies: (\d+)", text)
    if proc.returncode or not found or found.group(1) != "0":
        raise RuntimeError(f"redis-cli --pipe failed: {text.strip()}")
    return int(found.group(2))


def fill_index(
    port: int, keys: Iterable[str], copies: list[tuple[int, int]], *, on: list[Callable[[int], bool]] | None = None
) -> int:
    """Write an index entry per key directly: copy ``j`` (slot, epoch) on the keys whose number ``on[j]``
    takes (default all); a key no copy takes is left out. Values are what a node's commit writes
    (``Location.encode``); the checksum is the key's number."""
    takers = on or [_always] * len(copies)
    prefix = f"kvp:{NAMESPACE}/".encode()
    heads = [(str(slot).encode(), Location("n", epoch, "dram", CHUNK_BYTES, 0).encode()[:-8]) for slot, epoch in copies]

    def commands() -> Iterator[bytes]:
        for i, key in enumerate(keys):
            fields: list[bytes] = []
            for (slot, head), takes in zip(heads, takers):
                if takes(i):
                    fields += [slot, head + i.to_bytes(8, "big")]
            if fields:
                yield _resp(b"HSET", prefix + key.encode(), *fields)

    return mass_insert(port, commands())


def _always(_: int) -> bool:
    return True


@dataclasses.dataclass
class _Redis:
    """A redis-server of this machine, default config but ``DEBUG`` allowed locally (to see a rehash end)."""

    port: int
    favoured: bool  # given CPU before this machine's other processes (``redis_favoured`` in results)
    _processes: RedisProcesses
    _dir: tempfile.TemporaryDirectory[str]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cleanup(self) -> None:
        self._processes.stop_all()
        self._dir.cleanup()


def redis_server() -> _Redis:
    """A fresh redis-server, given CPU before this machine's other processes where allowed (nice -10).

    On a host of its own Redis is not preempted by the bench, the node and the CLI it serves;
    on a shared machine of two cores it is, and a command it was preempted in reads as slow in
    SLOWLOG."""
    directory = tempfile.TemporaryDirectory(prefix="kvpool-scale-")
    processes = RedisProcesses(Path(directory.name))
    port = processes.start(free_port(), "--enable-debug-command", "local")
    try:
        os.setpriority(os.PRIO_PROCESS, processes.processes[port].pid, REDIS_NICE)
        favoured = True
    except OSError:
        favoured = False
    return _Redis(port, favoured, processes, directory)


def wait_rehashed(port: int, timeout_s: float = REHASH_WAIT_S) -> float:
    """Wait until Redis has moved its key table to the size the keys grew (or shrank) it to; seconds waited.

    When the keys pass a power of two Redis rehashes into a table twice the size a little at a
    time (a millisecond of every 100, and a bucket per command): about two minutes at 10^7 keys,
    during which every key read looks in both tables. Figures of a settled index wait for it."""
    started = time.monotonic()
    with redis.Redis(port=port) as r:
        while "rehashing target" in str(r.execute_command("DEBUG", "HTSTATS", "0")):
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"Redis still rehashing its key table after {timeout_s:.0f} s")
            time.sleep(1.0)
    return round(time.monotonic() - started, 1)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


_OWN_COMMANDS = ("SLOWLOG", "LATENCY", "CONFIG", "INFO", "DEBUG", "MEMORY")  # the bench's, not the pool's


class _Probe:
    """A PING every 2 ms from another process, and Redis's SLOWLOG and LATENCY monitor, over a phase."""

    def __init__(self, port: int) -> None:
        self.port = port
        with redis.Redis(port=port) as r:
            r.config_set("slowlog-log-slower-than", SLOW_US)
            r.config_set("slowlog-max-len", 100_000)
            r.config_set("latency-monitor-threshold", 1)
            r.slowlog_reset()
            r.execute_command("LATENCY", "RESET")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, str(port), str(PROBE_INTERVAL_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def stop(self) -> dict[str, Any]:
        out, _ = self._proc.communicate(b"", timeout=60)
        pings = sorted(json.loads(out))
        with redis.Redis(port=self.port) as r:
            slow = r.slowlog_get(100_000)
            latest = r.execute_command("LATENCY", "LATEST")
        slow = [e for e in slow if not _text(e["command"]).upper().startswith(_OWN_COMMANDS)]
        slow_us = sorted(int(entry["duration"]) for entry in slow)
        return {
            "probe_pings": len(pings),
            "probe_ping_p50_ms": round(_q(pings, 0.5), 3),
            "probe_ping_p99_ms": round(_q(pings, 0.99), 3),
            "probe_ping_max_ms": round(pings[-1], 3) if pings else None,
            "redis_calls_over_1ms": len(slow_us),
            "redis_calls_over_10ms": sum(1 for us in slow_us if us > CALL_TARGET_MS * 1000),
            "redis_slowest_call_ms": round(slow_us[-1] / 1000, 3) if slow_us else 0.0,
            "redis_slowest_entries": [
                (round(int(e["duration"]) / 1000, 2), _text(e["command"])[:80])
                for e in sorted(slow, key=lambda e: -int(e["duration"]))[:5]
            ],
            "redis_slowest_commands": sorted(
                {_text(e["command"]).split(" ")[0][:40] for e in slow if int(e["duration"]) >= slow_us[-1] // 2}
            )
            if slow_us
            else [],
            "redis_latency_events": {str(row[0]): int(row[2]) for row in latest},  # event -> its slowest, ms
        }


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _node(redis_url: str, node_id: str, *extra: str) -> NodeProcess:
    args = ["--redis", redis_url, "--namespace", NAMESPACE, "--node-id", node_id, "--dram", "64MiB"]
    args += ["--nvme", "0", "--shm-dir", "off", "--prefault", "off", *extra]
    return NodeProcess(args, {**os.environ, "LMCACHE_TRACK_USAGE": "false"}).start()


async def _register(url: str, node_id: str, ttl_ms: int) -> tuple[int, int]:
    """Register ``node_id`` with a new epoch and a heartbeat of ``ttl_ms``; its (slot, epoch)."""
    store = MetadataStore(url, NAMESPACE)
    try:
        epoch = await store.registry.new_epoch()
        await store.registry.heartbeat(NodeInfo(node_id, "127.0.0.1", 1, epoch), ttl_ms=ttl_ms, changed=True)
        slot = store.connection.slots.slot_of(node_id)
        assert slot is not None
        return slot, epoch
    finally:
        await store.close()


def _next_slot_and_epoch(r: redis.Redis) -> tuple[int, int]:
    """The slot and epoch the next node to claim an id will get (nothing else claims meanwhile)."""
    return int(r.get(f"kvp:{{{NAMESPACE}}}:slotseq") or 0) + 1, int(r.get(f"kvp:{{{NAMESPACE}}}:epoch") or 0) + 1


def sweep(chunks: int = 100_000, *, pool: int = 0, grace_s: float = GRACE_S) -> dict[str, Any]:
    """A dead node's ``chunks`` copies spread over a pool of ``pool`` keys (default: as many), half of them
    also on the live node that sweeps them (module docstring)."""
    pool = max(pool, chunks)
    spread = pool // chunks
    server = redis_server()
    node: NodeProcess | None = None
    try:
        r = redis.Redis(port=server.port)
        dead_slot, _ = asyncio.run(_register(server.url, "dead-node", ttl_ms=1))  # its beat lapses at once
        live_slot, live_epoch = _next_slot_and_epoch(r)
        keys = list(inprocess_keys(pool))
        started = time.perf_counter()

        def dead_on(i: int) -> bool:
            return i % spread == 0

        def live_on(i: int) -> bool:
            return i % spread != 0 or i % 2 == 0  # every key keeps an entry

        fill_index(server.port, keys, [(dead_slot, 1), (live_slot, live_epoch)], on=[dead_on, live_on])
        fill_s = time.perf_counter() - started
        rehash_s = wait_rehashed(server.port)
        used = int(r.info("memory")["used_memory"])
        probe = _Probe(server.port)
        started = time.monotonic()
        node = _node(server.url, "a-reaper", "--dead-node-grace-s", str(grace_s))
        assert _slots(r)["a-reaper"] == live_slot, "another node claimed first: the live copies name another slot"
        with SyncPoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{server.port}/{NAMESPACE}")) as client:
            me = next(n for n in client.nodes() if n.node_id == "a-reaper")
            assert me.epoch == live_epoch
            deadline = time.monotonic() + SWEEP_WAIT_S
            while client.node_stats(me)["counters"].get("collected_index_fields", 0) < chunks:
                if time.monotonic() > deadline or not node.alive():
                    raise RuntimeError(f"the sweep did not end within {SWEEP_WAIT_S} s")
                time.sleep(0.5)
            total_s = time.monotonic() - started
            counters = client.node_stats(me)["counters"]
        seen = probe.stop()
        walk = re.findall(r"swept the index in ([\d.]+) s", node.log)
        sample = random.Random(1).sample(range(pool), min(CHECK_SAMPLE, pool))
        left = [r.hgetall(f"kvp:{NAMESPACE}/{keys[i]}") for i in sample]
        dead_left = sum(1 for fields in left if str(dead_slot).encode() in fields)
        live_kept = sum(1 for i, fields in zip(sample, left) if (str(live_slot).encode() in fields) == live_on(i))
        walk_s = float(walk[-1]) if walk else float("nan")
        return {
            "chunks": chunks,
            "redis_favoured": server.favoured,
            "dead_fields": chunks,
            "pool_keys": pool,
            "fill_s": round(fill_s, 1),
            "rehash_wait_s": rehash_s,
            "redis_used_memory_mib": round(used / 2**20, 1),
            "grace_s": grace_s,
            "sweep_walk_s": walk_s,
            "dead_gone_after_start_s": round(total_s, 1),
            "keys_per_s": round(pool / walk_s) if walk_s > 0 else None,  # a small pool is swept within the log's 0.1 s
            "fields_removed": counters.get("collected_index_fields", 0),
            "sample_dead_fields_left": dead_left,
            "sample_live_fields_kept": f"{live_kept}/{len(sample)}",
            **seen,
        }
    finally:
        if node is not None:
            node.stop()
        server.cleanup()


def _wait_first_walk(port: int, node_id: str) -> float:
    """Seconds until ``node_id``'s collector finished its first walk over the index."""
    started = time.monotonic()
    with SyncPoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{port}/{NAMESPACE}")) as client:
        node = next(n for n in client.nodes() if n.node_id == node_id)
        while client.node_stats(node)["counters"].get("collector_sweeps", 0) < 1:
            if time.monotonic() - started > SWEEP_WAIT_S:
                raise RuntimeError(f"node {node_id}'s first walk did not end within {SWEEP_WAIT_S} s")
            time.sleep(0.5)
    return round(time.monotonic() - started, 1)


def _slots(r: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(f"kvp:{{{NAMESPACE}}}:slots").items()}


def _cli_run(port: int, *args: str) -> tuple[float, float, str]:
    """``kvpool ARGS`` as a subprocess: (wall s, its peak RSS in MiB, stdout).

    The peak is the process's own ``VmHWM``, read every 20 ms while it runs (``wait4``'s
    ``ru_maxrss`` would count this bench's own memory: Linux carries it over a fork)."""
    url = f"kvpool://127.0.0.1:{port}/{NAMESPACE}?shm=off"
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", *args, "--url", url], stdout=out, stderr=subprocess.DEVNULL, env=env
        )
        peak_kib = 0
        while proc.poll() is None:
            peak_kib = max(peak_kib, _hwm_kib(proc.pid))
            time.sleep(0.02)
        wall = time.perf_counter() - started
        out.seek(0)
        text = out.read().decode()
    if proc.returncode not in (0, 3):  # 3: check found problems
        raise RuntimeError(f"kvpool {' '.join(args)} exited {proc.returncode}")
    return wall, round(peak_kib / 1024, 1), text


def _hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def admin(chunks: int = 100_000) -> dict[str, Any]:
    """``ls``/``evict`` by prefix, ``stats`` and ``status`` over an index of ``chunks`` keys (module docstring)."""
    server = redis_server()
    node: NodeProcess | None = None
    try:
        r = redis.Redis(port=server.port)
        slot, epoch = _next_slot_and_epoch(r)
        others = inprocess_keys(chunks - ADMIN_MODEL_KEYS)
        model = [f"other-org/model-7b@8@{i % 8}@{i:x}@bfloat16" for i in range(ADMIN_MODEL_KEYS)]
        started = time.perf_counter()
        fill_index(server.port, (k for part in (others, model) for k in part), [(slot, epoch)])
        fill_s = time.perf_counter() - started
        rehash_s = wait_rehashed(server.port)
        node = _node(server.url, "a-node")
        assert _slots(r)["a-node"] == slot
        # A node that takes over collecting walks the whole index once; the verbs run beside it in its
        # steady state (a page a heartbeat), as in a pool that has been up a while.
        walk_s = _wait_first_walk(server.port, "a-node")
        out: dict[str, Any] = {"chunks": chunks, "fill_s": round(fill_s, 1), "redis_favoured": server.favoured}
        out.update(rehash_wait_s=rehash_s, reaper_first_walk_s=walk_s)
        out["redis_used_memory_mib"] = round(int(r.info("memory")["used_memory"]) / 2**20, 1)
        verbs = {
            "ls_prefix": ("ls", "--prefix", "other-org/", "--json"),
            "stats": ("stats", "--json"),
            "status": ("status", "--json"),
            "evict_prefix": ("evict", "--prefix", "other-org/", "--json"),
        }
        for name, args in verbs.items():
            probe = _Probe(server.port)
            wall, rss, text = _cli_run(server.port, *args)
            seen = probe.stop()
            out[name] = {
                "wall_s": round(wall, 2),
                "cli_peak_rss_mib": rss,
                "redis_slowest_call_ms": seen["redis_slowest_call_ms"],
                "redis_calls_over_10ms": seen["redis_calls_over_10ms"],
                "probe_ping_max_ms": seen["probe_ping_max_ms"],
                "redis_slowest_commands": seen["redis_slowest_commands"],
                "redis_slowest_entries": seen["redis_slowest_entries"],
            }
            if name == "ls_prefix":
                out[name]["rows"] = len(text.splitlines())
            if name == "evict_prefix":
                out[name]["evicted"] = json.loads(text)["evicted"]
        out["keys_left"] = int(r.dbsize())
        return out
    finally:
        if node is not None:
            node.stop()
        server.cleanup()


async def _timed_lookups(urls: list[str], keysets: list[list[str]], live: dict[str, int]) -> list[dict[str, float]]:
    stores = [MetadataStore(url, NAMESPACE, timeout_s=10.0) for url in urls]
    rng = random.Random(2)
    times: list[dict[str, list[float]]] = [{"random": [], "together": []} for _ in urls]
    try:
        for store in stores:
            await store.registry.nodes()  # the view's slots
            await store.lookup.lookup_live(keysets[0][:10], live, prefix=False, copies=False)  # the script loaded
        for _ in range(LOOKUP_ROUNDS):
            for i, (store, keys) in enumerate(zip(stores, keysets)):
                start = rng.randrange(0, len(keys) - LOOKUP_KEYS)
                for how, asked in (
                    ("random", rng.sample(keys, LOOKUP_KEYS)),
                    ("together", keys[start : start + LOOKUP_KEYS]),
                ):
                    t = time.perf_counter()
                    found = await store.lookup.lookup_live(asked, live, prefix=True, copies=False)
                    times[i][how].append((time.perf_counter() - t) * 1000)
                    assert found.prefix == LOOKUP_KEYS
    finally:
        for store in stores:
            await store.close()
    out = []
    for per in times:
        row: dict[str, float] = {}
        for how, values in per.items():
            values.sort()
            row[f"{how}_p50_ms"] = round(statistics.median(values), 3)
            row[f"{how}_p99_ms"] = round(_q(values, 0.99), 3)
        out.append(row)
    return out


def lookup(chunks: int = 1_000_000, small: int = SMALL_INDEX) -> dict[str, Any]:
    """The live lookup of 1,000 keys against ``small`` keys in Redis and against ``chunks`` (module docstring)."""
    servers = [redis_server(), redis_server()]
    try:
        keysets = []
        for server, count in zip(servers, (small, chunks)):
            slot, epoch = asyncio.run(_register(server.url, "a-node", ttl_ms=3_600_000))
            assert (slot, epoch) == (1, 1)  # one view, {"a-node": 1}, reads both servers
            keys = list(inprocess_keys(count))
            fill_index(server.port, keys, [(slot, epoch)])
            keysets.append(keys)
        for server in servers:
            wait_rehashed(server.port)
        before = [_evalsha_us(s.port) for s in servers]
        rows = asyncio.run(_timed_lookups([s.url for s in servers], keysets, {"a-node": 1}))
        redis_us = [
            (_evalsha_us(s.port)[0] - b[0]) / max(1, _evalsha_us(s.port)[1] - b[1]) for s, b in zip(servers, before)
        ]
    finally:
        for server in servers:
            server.cleanup()
    small_row, large_row = rows
    return {
        "keys_asked": LOOKUP_KEYS,
        "rounds": LOOKUP_ROUNDS,
        f"at_{small}": {**small_row, "redis_us_per_call": round(redis_us[0])},
        f"at_{chunks}": {**large_row, "redis_us_per_call": round(redis_us[1])},
        "ratio_random_p50": round(large_row["random_p50_ms"] / small_row["random_p50_ms"], 2),
        "ratio_together_p50": round(large_row["together_p50_ms"] / small_row["together_p50_ms"], 2),
        "ratio_redis_time": round(redis_us[1] / redis_us[0], 2),
    }


def _evalsha_us(port: int) -> tuple[int, int]:
    with redis.Redis(port=port) as r:
        stats = r.info("commandstats").get("cmdstat_evalsha", {"usec": 0, "calls": 0})
    return int(stats["usec"]), int(stats["calls"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000, help="index size N (default 100000)")
    parser.add_argument("--parts", default="sweep,admin,lookup", help="which parts (default all)")
    parser.add_argument("--grace-s", type=float, default=GRACE_S, help="the reaper's --dead-node-grace-s")
    parser.add_argument("--pool", type=int, default=0, help="sweep: keys in the pool (default --chunks)")
    parser.add_argument("--small", type=int, default=SMALL_INDEX, help="lookup: the smaller index (default 10000)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    results: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    if "sweep" in parts:
        results["sweep"] = sweep(args.chunks, pool=args.pool, grace_s=args.grace_s)
        s = results["sweep"]
        print(
            f"sweep of a dead node's {s['dead_fields']:,} fields in {s['pool_keys']:,} keys: walk {s['sweep_walk_s']} s "
            f"(target <= {SWEEP_TARGET_S:.0f} s), "
            f"{s['keys_per_s']} keys/s; slowest Redis call {s['redis_slowest_call_ms']} ms (target < {CALL_TARGET_MS:.0f}), "
            f"{s['redis_calls_over_10ms']} over 10 ms; probe PING p99 {s['probe_ping_p99_ms']} ms, max {s['probe_ping_max_ms']} ms"
        )
    if "admin" in parts:
        results["admin"] = admin(args.chunks)
        for verb in ("ls_prefix", "evict_prefix", "stats", "status"):
            v = results["admin"][verb]
            print(
                f"{verb:<13} at {args.chunks:,} keys: {v['wall_s']} s, CLI peak RSS {v['cli_peak_rss_mib']} MiB, "
                f"slowest Redis call {v['redis_slowest_call_ms']} ms (target < {CALL_TARGET_MS:.0f})"
            )
    if "lookup" in parts:
        results["lookup"] = lookup(args.chunks, args.small)
        lk = results["lookup"]
        print(
            f"lookup of 1,000 keys at {args.small:,} vs {args.chunks:,} keys: p50 ratio {lk['ratio_together_p50']} "
            f"(stored together), {lk['ratio_random_p50']} (random); Redis time ratio {lk['ratio_redis_time']} "
            f"(target <= {LOOKUP_RATIO_TARGET})"
        )
    results["load_after"] = os.getloadavg()[0]
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
