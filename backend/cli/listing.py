"""The read-only verbs: ``status``, ``nodes``, ``ls``, ``stats``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from backend import admin
from backend.cli.exits import EXIT_ERROR, EXIT_OK
from backend.cli.options import add_admin_options, run_with_client
from backend.cli.output import print_json, table, tiers_text
from backend.client import PoolClient
from backend.config import format_size
from backend.errors import ConfigError


def add_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = verbs.add_parser(
        "status", help="one screen: Redis, nodes, capacity, objects, hit rate; exits 1 with no live node"
    )
    add_admin_options(status)

    nodes = verbs.add_parser("nodes", help="table of nodes: address, epoch, uptime, tiers, request rate")
    add_admin_options(nodes)

    ls = verbs.add_parser("ls", help="list cached chunks with node, tier, size and epoch (streams; SCAN)")
    add_admin_options(ls)
    ls.add_argument("--model", help="only keys of this model (LMCache key prefix MODEL@)")
    ls.add_argument("--prefix", help="only keys starting with this text")
    ls.add_argument("--limit", type=int, default=None, help="stop after this many keys")

    stats = verbs.add_parser("stats", help="counters and p50/p99 latency per op, summed over nodes")
    add_admin_options(stats)


def cmd_status(args: argparse.Namespace) -> int:
    status = run_with_client(args, admin.pool_status)
    if args.json:
        print_json(status.to_json())
        return _no_live_node(status)
    recent = status.recent
    hit_rate = "n/a" if status.hit_rate is None else f"{status.hit_rate * 100:.1f}%"
    recent_rate = "n/a" if recent.hit_rate is None else f"{recent.hit_rate * 100:.1f}%"
    print(f"Redis       {status.redis_url} reachable ({status.rtt_ms:.2f} ms)")
    if status.redis_memory is not None and status.redis_memory.full:
        print(f"            Redis is full: {status.redis_memory.describe()}: puts are refused until it has room")
    print(f"Namespace   {status.namespace}")
    print(f"Nodes       {status.alive} alive, {status.dead} dead, {status.draining} draining")
    print(
        f"Capacity    {format_size(status.used_bytes)} used of {format_size(status.capacity_bytes)} "
        f"({format_size(status.free_bytes)} free)"
    )
    for name, tier in status.tiers.items():
        print(
            f"  {name:<9} {format_size(tier.used_bytes)} / {format_size(tier.capacity_bytes)}, {tier.objects} objects"
        )
    print(f"Objects     {status.objects}")
    print(
        f"Hit rate    {recent_rate} over the last {recent.window_s / 60:.1f} min "
        f"({recent.hits} of {recent.gets} node gets); {hit_rate} since start"
    )
    for row in status.node_list:
        state = "alive" if row.alive else "DEAD"
        state += ", draining" if row.draining else ""
        print(
            f"  {row.node_id:<24} {row.address:<22} {state:<16} epoch {row.epoch:<4} "
            f"{format_size(row.used_bytes)} / {format_size(row.capacity_bytes)}, {row.objects} objects"
        )
    if status.draining:
        print("A draining node takes no writes: `kvpool drain NODE` finishes its drain, `kvpool undrain NODE` ends it.")
    return _no_live_node(status)


def _no_live_node(status: admin.PoolStatus) -> int:
    """`kvpool status` fails with no live node in its namespace, saying which namespaces have some."""
    if status.alive or status.elsewhere is None:
        return EXIT_OK
    where = f"namespaces with live nodes: {status.elsewhere.describe()}"
    print(f"kvpool: error: no live node in namespace {status.namespace!r}; {where}", file=sys.stderr)
    return EXIT_ERROR


def cmd_nodes(args: argparse.Namespace) -> int:
    rows = run_with_client(args, admin.node_rows)
    if args.json:
        print_json([r.to_json() for r in rows])
        return 0
    table(
        None,
        ["node", "host", "address", "cluster", "epoch", "state", "uptime", "tiers", "req/s", "heartbeat"],
        [
            [
                r.node_id,
                r.host or "-",
                r.address,
                r.cluster or "-",
                r.epoch,
                ("alive" if r.alive else "DEAD") + (", draining" if r.draining else ""),
                f"{r.uptime_s:.0f} s",
                tiers_text(r.tiers),
                "-" if r.requests_per_s is None else f"{r.requests_per_s:.1f}",
                "-" if r.last_heartbeat_s is None else f"{r.last_heartbeat_s:.1f} s ago",
            ]
            for r in rows
        ],
    )
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit <= 0:
        raise ConfigError("--limit", "must be a positive number")

    async def stream(client: PoolClient) -> int:
        count = 0
        async for row in admin.iter_keys(client, model=args.model, prefix=args.prefix, limit=args.limit):
            count += 1
            if args.json:
                print(json.dumps(row), flush=False)
            else:
                print(
                    f"{row['key']}  {row['node_id']}  {row['host'] or '-'}  {row['tier']}  {format_size(row['nbytes'])}  "
                    f"epoch {row['epoch']}"
                )
        sys.stdout.flush()
        return count

    count = run_with_client(args, stream)
    if not args.json:
        print(f"({count} copies)", file=sys.stderr)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    stats = run_with_client(args, admin.pool_stats)
    if args.json:
        print_json(stats.to_json())
        return 0
    table(f"counters ({stats.nodes} nodes)", ["counter", "value"], [[k, v] for k, v in stats.counters.items()])
    table(
        "service time per op",
        ["op", "count", "p50 ms", "p99 ms"],
        [[op, v.count, v.p50_ms, v.p99_ms] for op, v in stats.latency.items()],
    )
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "status": cmd_status,
    "nodes": cmd_nodes,
    "ls": cmd_ls,
    "stats": cmd_stats,
}
