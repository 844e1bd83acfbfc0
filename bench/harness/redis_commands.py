"""What the metadata Redis does per lookup and per commit: one server vs a 3-master cluster.

    python -m bench.harness.redis_commands                # 1000 keys, 30 timed lookups each
    python -m bench.harness.redis_commands --keys 200 --rounds 50

Starts a redis-server and a 3-master Redis Cluster, commits ``--keys`` index entries
through :class:`MetadataStore` (as a node does after a put), looks them all up in one
batch (as a client's ``contains``/``get`` does), and prints the Redis commands each
step cost (from ``INFO commandstats``, summed over every server) and the lookup's
latency (p50/p99 over ``--rounds``). No nodes: this is the metadata layer alone.

Then it times ``PoolClient.contains`` while the redis-server is stopped (SIGSTOP) and
after it is killed: each call must return misses, not raise, within ``progress_timeout_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

from backend.embedded import EmbeddedRedis
from backend.latency import quantile
from backend.launch.redis_servers import RedisProcesses, cli
from backend.metadata import Location, MetadataStore
from kvpool import PoolConfig, SyncPoolClient


def _commandstats(ports: list[int]) -> Counter[str]:
    calls: Counter[str] = Counter()
    for port in ports:
        for line in cli(port, "INFO", "commandstats").splitlines():
            if line.startswith("cmdstat_"):
                name, _, fields = line.partition(":")
                calls[name[len("cmdstat_") :]] += int(fields.split(",")[0].split("=")[1])
    calls.pop("info", None)  # this function's own
    return calls


async def _measure(url: str, ports: list[int], keys: int, rounds: int) -> dict[str, object]:
    store = MetadataStore(url, "bench")
    names = [f"model@{i}" for i in range(keys)]
    try:
        await store.index.commit([(k, Location("n1", 1, "dram", 4096, i)) for i, k in enumerate(names[:10])])  # warm up
        before = _commandstats(ports)
        await store.index.commit([(k, Location("n1", 1, "dram", 4096, i)) for i, k in enumerate(names)])
        commit = _commandstats(ports) - before  # the Lua scripts' own HGETALL/HSET count too
        before = _commandstats(ports)
        entries = await store.index.lookup(names)
        lookup = _commandstats(ports) - before
        assert all(entries), "a committed key was not found"
        times_ms = []
        for _ in range(rounds):
            start = time.perf_counter()
            await store.index.lookup(names)
            times_ms.append((time.perf_counter() - start) * 1000)
        per_server = [len(cli(p, "--scan", "--pattern", "kvp:bench/*").split()) for p in ports]
    finally:
        await store.close()
    times_ms.sort()
    return {
        "commit": dict(commit),
        "lookup": dict(lookup),
        "p50_ms": quantile(times_ms, 0.5),
        "p99_ms": quantile(times_ms, 0.99),
        "keys_per_server": per_server,
    }


def _outage(timeout_s: float, calls: int = 5) -> dict[str, tuple[float, float]]:
    """min and max ms of ``contains`` while Redis is paused, then killed."""
    keys = [f"k{i}" for i in range(10)]
    spans: dict[str, tuple[float, float]] = {}
    with EmbeddedRedis() as redis:
        config = PoolConfig.from_url(f"kvpool://127.0.0.1:{redis.port}/outage?progress_timeout_s={timeout_s}")
        with SyncPoolClient(config) as client:
            client.contains(keys)  # connected while Redis was up
            process = redis.process
            assert process is not None
            stages = (
                ("paused", lambda: process.send_signal(signal.SIGSTOP)),
                ("killed", lambda: (process.send_signal(signal.SIGCONT), redis.kill())),
            )
            for name, act in stages:
                act()
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    assert client.contains(keys) == [False] * len(keys)
                    times.append((time.perf_counter() - start) * 1000)
                spans[name] = (min(times), max(times))
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000, help="index entries per batch (default 1000)")
    parser.add_argument("--rounds", type=int, default=30, help="timed lookups (default 30)")
    parser.add_argument(
        "--timeout-s", type=float, default=0.5, help="client progress_timeout_s for the outage (default 0.5)"
    )
    args = parser.parse_args()
    with EmbeddedRedis() as single, tempfile.TemporaryDirectory(prefix="kvpool-cluster-") as root:
        servers = RedisProcesses(Path(root))
        try:
            ports = servers.start_cluster(3)
            results = {
                "one redis-server": asyncio.run(_measure(single.url, [single.port], args.keys, args.rounds)),
                "3-master cluster": asyncio.run(
                    _measure(f"redis+cluster://127.0.0.1:{ports[0]}", ports, args.keys, args.rounds)
                ),
            }
        finally:
            servers.stop_all()
    print(f"{args.keys} keys per batch, {args.rounds} timed lookups")
    for name, r in results.items():
        print(f"\n{name}: index keys per server {r['keys_per_server']}")
        print(f"  commit commands: {r['commit']}")
        print(f"  lookup commands: {r['lookup']}")
        print(f"  lookup latency: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms")
    print(f"\nRedis outage, contains of 10 keys with progress_timeout_s={args.timeout_s} (all misses, no exception):")
    for name, (low, high) in _outage(args.timeout_s).items():
        print(f"  redis-server {name}: {low:.0f}-{high:.0f} ms")


if __name__ == "__main__":
    main()
