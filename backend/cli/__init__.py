"""The ``kvpool`` admin CLI: parses, calls the library, prints. Nothing imports it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from backend import admin
from backend.client import PoolClient
from backend.config import (
    ENV_DEBUG,
    ENV_URL,
    NODE_OPTIONS,
    NODE_RENAMED,
    NODE_VERB_DEFAULTS,
    REDIS_HELP,
    NodeConfig,
    PoolConfig,
    env_flag,
    format_size,
    node_options,
    parse_size,
    pool_config_of_redis,
    without_inline_secrets,
)
from backend.doctor import TROUBLESHOOTING, Finding, check_node_host, check_pool, reach, selftest
from backend.doctor import render as render_findings
from backend.doctor.selftest import DEFAULT_CHUNK_BYTES as SELFTEST_CHUNK_BYTES
from backend.doctor.selftest import DEFAULT_CHUNKS as SELFTEST_CHUNKS
from backend.embedded import EmbeddedRedis, remove_orphaned_dirs
from backend.errors import ConfigError, KVPoolError, MetadataError
from backend.lmcache.config import (
    PLUGIN_FORM,
    REMOTE_URL_FORM,
    SECRET_SOURCES,
    lmcache_config,
    lmcache_mp_adapter,
    lmcache_mp_server_args,
    render_env,
    render_mp_command,
    render_yaml,
)
from backend.node.server import PoolNode
from backend.protocol import TierReport
from backend.redis_topology import mask_url
from backend.version import __version__

__all__ = ["main", "build_parser"]

logger = logging.getLogger("kvpool")

# Exit codes (docs/cli.md). A ConfigError is a usage error: the flags, URL, config file or
# environment ask for something invalid, and it is raised before anything is changed.
EXIT_OK = 0
EXIT_ERROR = 1  # a kvpool error: Redis or a node unreachable, a failed operation
EXIT_USAGE = 2
EXIT_PROBLEMS = 3  # `kvpool check` found problems (fixed or not): a cron job can alert on it
EXIT_BROKEN_PIPE = 141  # stdout closed early (`kvpool ls | head`): 128 + SIGPIPE, as cat or grep exit
EXIT_TERMINATED = 143  # SIGTERM while a node started (128 + SIGTERM): it gave back what it had taken

T = TypeVar("T")


# `kvpool up`'s private Redis: its password, when the node was given none, is made here (docs/configuration.md).
GENERATED_PASSWORD_BYTES = 32
GENERATED_PASSWORD_FILE = "redis-password"

SERVER_VERBS = ("up", "node")  # long-running: they log their progress at INFO
FORMATS = {"inproc": ("yaml", "env"), "mp": ("args", "json")}  # lmcache-config --format, per --mode
RECOVERY_BAR_STEPS = 1000  # the recovery bar moves by tenths of a percent of the shard directories
RECOVERY_BAR_S = 0.2  # how often it is redrawn


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="Run and manage a kvpool KV-cache pool.")
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    # Not required here: main() names an unknown flag before it says a verb is missing.
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")

    up = verbs.add_parser("up", help="run a pool in the foreground: a private redis-server plus one node")
    up.add_argument("--redis", metavar="URL", help="use this Redis instead of starting a private one")
    _node_options(up, "up")

    node = verbs.add_parser("node", help="run a node that joins an existing pool")
    node.add_argument("--redis", metavar="URL", help=REDIS_HELP)
    _node_options(node, "node")

    status = verbs.add_parser(
        "status", help="one screen: Redis, nodes, capacity, objects, hit rate; exits 1 with no live node"
    )
    _admin_options(status)

    nodes = verbs.add_parser("nodes", help="table of nodes: address, epoch, uptime, tiers, request rate")
    _admin_options(nodes)

    ls = verbs.add_parser("ls", help="list cached chunks with node, tier, size and epoch (streams; SCAN)")
    _admin_options(ls)
    ls.add_argument("--model", help="only keys of this model (LMCache key prefix MODEL@)")
    ls.add_argument("--prefix", help="only keys starting with this text")
    ls.add_argument("--limit", type=int, default=None, help="stop after this many keys")

    stats = verbs.add_parser("stats", help="counters and p50/p99 latency per op, summed over nodes")
    _admin_options(stats)

    evict = verbs.add_parser("evict", help="remove chunks everywhere: KEY..., or --model / --prefix")
    _admin_options(evict)
    evict.add_argument("keys", nargs="*", metavar="KEY")
    evict.add_argument("--model", help="every key of this model")
    evict.add_argument("--prefix", help="every key starting with this text")

    drain = verbs.add_parser(
        "drain", help="move a node's chunks to other nodes, then leave it draining (until it stops or `undrain`)"
    )
    _admin_options(drain)
    drain.add_argument("node_id", metavar="NODE")
    drain.add_argument("--to", metavar="NODE", help="move everything to this node (default: normal placement)")
    drain.add_argument(
        "--batch",
        type=int,
        default=admin.DRAIN_BATCH_ITEMS,
        help=f"chunks moved per step (default {admin.DRAIN_BATCH_ITEMS})",
    )

    undrain = verbs.add_parser("undrain", help="end a drain: the node takes writes again")
    _admin_options(undrain)
    undrain.add_argument("node_id", metavar="NODE")

    flush = verbs.add_parser("flush", help="wipe every chunk of a namespace (asks on a terminal unless --yes)")
    _admin_options(flush)
    flush.add_argument("--namespace", required=True, help="the namespace to wipe (must be given explicitly)")
    flush.add_argument("--yes", action="store_true", help="do not ask")

    check = verbs.add_parser("check", help="fsck: index vs bytes, checksums, dead nodes; --fix repairs")
    _admin_options(check)
    check.add_argument("--fix", action="store_true", help="repair what was found and say what changed")
    check.add_argument("--deep", action="store_true", help="verify the checksum of every chunk (default: a sample)")

    doctor = verbs.add_parser(
        "doctor",
        help="find what is wrong and name its cause (docs/troubleshooting.md): an engine's LMCache config, "
        "the pool as a client sees it, or a node's host",
    )
    mode = doctor.add_mutually_exclusive_group()
    mode.add_argument(
        "--lmcache-config",
        type=Path,
        metavar="FILE",
        help="check an engine's LMCache YAML end to end as LMCache loads it: plugin or remote_url, the pool, "
        "one round trip (needs LMCache installed)",
    )
    mode.add_argument(
        "--url",
        metavar="kvpool://...",
        help="check the pool as a client sees it: Redis, credentials, namespace, every node (default: $KVPOOL_URL)",
    )
    mode.add_argument(
        "--node",
        action="store_true",
        help="check this host for a node given the flags below, as `kvpool node` takes them: secrets, Redis, "
        "shared memory, NVMe directory, advertised address (needs no LMCache)",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--redis", metavar="URL", help="with --node: " + REDIS_HELP)
    _node_options(doctor, "node")

    selftest = verbs.add_parser(
        "selftest", help="put, look up, get and delete a few chunks through the pool; each step ok or FAIL, and why"
    )
    selftest.add_argument("url", nargs="?", metavar="URL", help="pool URL (default: $KVPOOL_URL)")
    selftest.add_argument("--json", action="store_true", help="machine-readable output")
    selftest.add_argument(
        "--chunks", type=int, default=SELFTEST_CHUNKS, help=f"how many chunks (default {SELFTEST_CHUNKS})"
    )
    selftest.add_argument(
        "--chunk-size",
        default=f"{SELFTEST_CHUNK_BYTES // 1024}KiB",
        metavar="SIZE",
        help=f"bytes per chunk, e.g. 1MiB (default {SELFTEST_CHUNK_BYTES // 1024}KiB)",
    )

    cfg = verbs.add_parser("lmcache-config", help="print the LMCache config that enables kvpool")
    _url_option(cfg)
    cfg.add_argument(
        "--mode",
        choices=("inproc", "mp"),
        default="inproc",
        help="inproc: LMCache inside the engine (remote storage plugin, default); "
        "mp: LMCache multiprocess server (L2 adapter)",
    )
    cfg.add_argument(
        "--format",
        choices=FORMATS["inproc"] + FORMATS["mp"],
        default=None,
        help="inproc: yaml (default) or env (LMCACHE_* variables); "
        "mp: args (`lmcache server` command, default) or json (the --l2-adapter value)",
    )
    cfg.add_argument(
        "--form",
        choices=(PLUGIN_FORM, REMOTE_URL_FORM),
        default=None,
        help="inproc: how LMCache finds kvpool: plugin (remote_storage_plugins + extra_config, "
        "default) or remote_url (one external:// URL, also as LMCACHE_REMOTE_URL); never both",
    )
    cfg.add_argument(
        "--offline",
        action="store_true",
        help="print without checking the pool (by default the URL must reach Redis with its credentials and a "
        "live node in its namespace)",
    )
    cfg.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size in tokens (default 256)")
    cfg.add_argument(
        "--local-cpu-gib",
        type=float,
        default=5.0,
        help="LMCache local CPU buffer; in mp mode the server's L1 size (default 5.0)",
    )
    return parser


def _admin_options(parser: argparse.ArgumentParser) -> None:
    _url_option(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _url_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", metavar="kvpool://...", help="pool URL (default: $KVPOOL_URL)")


def _node_options(parser: argparse.ArgumentParser, verb: str) -> None:
    """The flags of NodeConfig's options (backend.config.NODE_OPTIONS), for ``kvpool up`` or ``kvpool node``.

    Every flag defaults to None (not given): the value is chosen, parsed and checked by
    ``node_options``, so a flag, its YAML key and its variable cannot disagree.
    """
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML file of these options (flags win)")
    shown = NODE_VERB_DEFAULTS[verb]
    for option in NODE_OPTIONS:
        if not option.flag or option.name == "redis":  # --redis: added per verb, its help differs
            continue
        default = shown.get(option.name)
        if option.name == "nvme_dir":
            default = f"default {default}" if default else "default: no NVMe tier"
        parser.add_argument(
            option.flag_name, metavar=option.metavar, choices=option.choices, help=option.help.format(default=default)
        )
    for rename in NODE_RENAMED:  # the old flags in milliseconds: still taken, not shown
        parser.add_argument("--" + rename.old.replace("_", "-"), help=argparse.SUPPRESS)


def _node_settings(args: argparse.Namespace, verb: str = "") -> dict[str, Any]:
    """The node options of ``kvpool up``/``kvpool node`` (or of ``verb``'s node): flags, else environment, else
    --config, else defaults."""
    flags = {option.name: getattr(args, option.name, None) for option in NODE_OPTIONS if option.flag}
    flags |= {rename.old: getattr(args, rename.old, None) for rename in NODE_RENAMED}
    defaults = NODE_VERB_DEFAULTS[verb or args.verb]
    return node_options(flags, config_file=args.config, environ=args.environ, defaults=defaults)


def _pool_url(node: PoolNode, redis_url: str, namespace: str) -> tuple[str, list[str]]:
    """The pool URL for engines, with no secret in it, and what they must be given apart from it.

    A secret this node read from a file is named by that file (``token_file=``,
    ``redis_password_file=``: an engine on this host can read it too); one from the
    environment or the ``--redis`` URL is left to the engine's environment.
    """
    token_file = node.config.token_file if node.config.token else ""
    password_file = node.config.redis_password_file
    config = pool_config_of_redis(redis_url, namespace)
    apart = []
    if node.config.token and not token_file:
        apart.append("KVPOOL_TOKEN (this node's token)")
    if (node.config.redis_password or config.redis_password) and not password_file:
        apart.append("KVPOOL_REDIS_PASSWORD (the Redis password this node uses)")
    config = dataclasses.replace(config, token_file=token_file, redis_password_file=password_file, redis_password="")
    return config.to_url(), apart


def _stop_on_signals(node: PoolNode) -> None:
    """SIGTERM and SIGINT (Ctrl-C) stop ``node`` cleanly from now on."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.request_stop)


async def _start(node: PoolNode) -> None:
    """Start ``node``. A SIGTERM meanwhile (a service manager stopping it during a long prefault) abandons
    the start as Ctrl-C does: the node gives back what it took (its arena file in /dev/shm with the rest,
    ``backend/node/startup.py``) and the process exits 143. Once started, SIGTERM and SIGINT stop the node
    cleanly (:func:`_stop_on_signals`)."""
    loop = asyncio.get_running_loop()
    starting = asyncio.current_task()
    assert starting is not None
    terminated: list[bool] = []

    def on_sigterm() -> None:
        if not terminated:  # a second SIGTERM does not cut the giving back short
            terminated.append(True)
            starting.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        await node.start()
    except asyncio.CancelledError:
        loop.remove_signal_handler(signal.SIGTERM)
        if not terminated:
            raise
        print("kvpool: stopped by SIGTERM while starting; what the node had taken is given back", file=sys.stderr)
        raise SystemExit(EXIT_TERMINATED) from None
    except BaseException:
        loop.remove_signal_handler(signal.SIGTERM)
        raise
    # Started: from here on a signal stops the node cleanly, with no moment between the two handlers where
    # SIGTERM's default would kill it unregistered; and a SIGTERM that came as the start was ending (its
    # cancellation can land where the claim's keeper swallows it) stops it now.
    _stop_on_signals(node)
    if terminated:
        node.request_stop()


async def _serve(node: PoolNode) -> None:
    """Serve until a signal (or until the node stops itself: it lost its id, and then exits 1). The signals'
    handlers are :func:`_start`'s, installed as the start returned."""
    try:
        await node.wait_stopped()
    finally:
        await node.stop()
    if node.lost_claim is not None:
        raise node.lost_claim


async def _recovery_bar(node: PoolNode) -> None:
    """A progress bar of the NVMe tier's recovery, which goes on while the node serves (terminals only)."""
    report = node.recovery
    if report is None or report.done:
        return
    bar, update = _progress(f"node {node.node_id}: recovering its NVMe chunks", quiet=False)
    with bar:
        while report is not None and not report.done and not node.stopping:
            update(round(report.progress * RECOVERY_BAR_STEPS), RECOVERY_BAR_STEPS)
            await asyncio.sleep(RECOVERY_BAR_S)
            report = node.recovery


def cmd_node(args: argparse.Namespace) -> int:
    config = NodeConfig.from_options(_node_settings(args))  # --redis is required there: --config may supply it

    async def run() -> None:
        node = PoolNode(config)
        await _start(node)
        print(
            f"kvpool node {node.node_id} ready at {node.advertise_host}:{node.advertise_port} (epoch {node.epoch})",
            flush=True,
        )
        bar = asyncio.ensure_future(_recovery_bar(node)) if sys.stderr.isatty() else None
        try:
            await _serve(node)
        finally:
            if bar is not None:
                bar.cancel()

    asyncio.run(run())
    return 0


def _private_redis(settings: dict[str, Any]) -> tuple[EmbeddedRedis, NodeConfig]:
    """``kvpool up``'s own redis-server, started behind a password, and the config of the node that uses it.

    The password is the node's (``--redis-password-file`` or ``KVPOOL_REDIS_PASSWORD``), else a
    new one, kept in a mode-0600 file of the server's private directory: the index is never
    open to whoever reaches the port, token or not. The server dies with this process
    (``die_with_parent``; started here, from the main thread, which lives as long as it).
    """
    for path in remove_orphaned_dirs():
        logger.info("removed %s, left behind by a kvpool up that was killed", path)
    redis = EmbeddedRedis(die_with_parent=True)
    try:
        settings = {**settings, "redis": redis.url}
        if settings["redis_password_file"] is None and not settings["redis_password"]:
            secret = secrets.token_urlsafe(GENERATED_PASSWORD_BYTES)
            settings["redis_password_file"] = redis.write_secret(GENERATED_PASSWORD_FILE, secret)
        config = NodeConfig.from_options(settings)  # reads the password file
        redis.start(password=config.redis_password)
    except BaseException:
        redis.cleanup()
        raise
    return redis, config


def _password_note(config: NodeConfig, *, generated: bool) -> str:
    """What `kvpool up` says about its private Redis's password: where it is, never what it is."""
    if not config.redis_password_file:
        return "Redis requires the password of KVPOOL_REDIS_PASSWORD."
    whose = "a password generated for this run" if generated else "the password of --redis-password-file"
    return (
        f"Redis requires {whose}, read from {config.redis_password_file}; the pool URL names that file "
        "(redis_password_file=), so engines and admins of this user on this host need nothing more. "
        "Elsewhere, copy the file (mode 0600) and name the copy, or set KVPOOL_REDIS_PASSWORD."
    )


async def _serve_with_redis(node: PoolNode, redis: EmbeddedRedis) -> None:
    """Serve until a signal, or until the private redis-server dies: then stop the node and fail."""
    died: list[int] = []

    async def watch() -> None:
        died.append(await redis.wait_exit())
        node.request_stop()

    watcher = asyncio.create_task(watch())
    try:
        await _serve(node)
    finally:
        watcher.cancel()
    if died:
        how = f"was killed by signal {-died[0]}" if died[0] < 0 else f"exited with status {died[0]}"
        tail = redis.log_tail().splitlines()[-1:] or ["(empty)"]
        raise MetadataError(
            f"the pool's redis-server (port {redis.port}) {how}; the node stopped, since it cannot "
            f"publish without it. Last line of its log: {tail[0]}"
        )


def cmd_up(args: argparse.Namespace) -> int:
    settings = _node_settings(args)
    redis, config = (None, NodeConfig.from_options(settings)) if settings["redis"] else _private_redis(settings)
    try:

        async def run() -> None:
            node = PoolNode(config)
            await _start(node)  # leaves SIGTERM/SIGINT stopping the node: a Ctrl-C after the banner stops cleanly
            url, apart = _pool_url(node, config.redis_url, config.namespace)
            nvme = f"NVMe {format_size(config.nvme_bytes)} at {config.nvme_dir}" if config.nvme_dir else "no NVMe"
            print(
                f"kvpool pool is up: redis {mask_url(config.redis_url)}, node {node.node_id} at {node.advertise_host}:{node.advertise_port}, "
                f"DRAM {format_size(config.dram_bytes)}, {nvme}"
            )
            if node.prefaulted_bytes:
                print(
                    f"DRAM arena: {format_size(node.prefaulted_bytes)} of memory taken at start in "
                    f"{node.prefault_s:.1f} s (--prefault off takes it as chunks arrive)"
                )
            print(f"\nPool URL:\n  {url}\n")
            if redis is not None:
                generated = settings["redis_password_file"] is None and bool(config.redis_password_file)
                print(f"{_password_note(config, generated=generated)}\n")
            if apart:
                print(f"Engines also need, in their environment: {', '.join(apart)}.\n")
            print("LMCache config (LMCACHE_CONFIG_FILE):\n")
            print(render_yaml(lmcache_config(url)))
            print("Ctrl-C stops the pool.", flush=True)
            await (_serve(node) if redis is None else _serve_with_redis(node, redis))

        asyncio.run(run())
    finally:
        if redis is not None:
            redis.cleanup()
    print("kvpool pool stopped.")
    return 0


def _config(args: argparse.Namespace) -> PoolConfig:
    if not args.url:
        raise ConfigError("--url", "no pool URL: pass --url kvpool://HOST:PORT/NS or set KVPOOL_URL")
    return PoolConfig.from_url(args.url, args.environ)


def _run(args: argparse.Namespace, work: Callable[[PoolClient], Awaitable[T]]) -> T:
    """Run ``work`` with a client of the pool named by ``--url``; always closes it."""
    config = _config(args)

    async def go() -> T:
        async with PoolClient(config) as client:
            return await work(client)

    return asyncio.run(go())


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False, default=str))


def _table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    Console(width=max(120, shutil.get_terminal_size().columns)).print(table)


def _tiers_text(tiers: Mapping[str, TierReport]) -> str:
    return ", ".join(f"{name} {format_size(t.used_bytes)}/{format_size(t.capacity_bytes)}" for name, t in tiers.items())


def cmd_status(args: argparse.Namespace) -> int:
    status = _run(args, admin.pool_status)
    if args.json:
        _print_json(status.to_json())
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
    rows = _run(args, admin.node_rows)
    if args.json:
        _print_json([r.to_json() for r in rows])
        return 0
    _table(
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
                _tiers_text(r.tiers),
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

    count = _run(args, stream)
    if not args.json:
        print(f"({count} copies)", file=sys.stderr)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    stats = _run(args, admin.pool_stats)
    if args.json:
        _print_json(stats.to_json())
        return 0
    _table(f"counters ({stats.nodes} nodes)", ["counter", "value"], [[k, v] for k, v in stats.counters.items()])
    _table(
        "service time per op",
        ["op", "count", "p50 ms", "p99 ms"],
        [[op, v.count, v.p50_ms, v.p99_ms] for op, v in stats.latency.items()],
    )
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    if args.keys and (args.model or args.prefix):
        raise ConfigError("evict", "give keys or --model/--prefix, not both")
    report = _run(args, lambda c: admin.evict(c, args.keys, model=args.model, prefix=args.prefix))
    _print_json(report.to_json()) if args.json else print(f"evicted {report.evicted} chunks")
    if report.refused:
        why = next(iter(report.refused.values()))
        more = f" (and {len(report.refused) - 1} more nodes)" if len(report.refused) > 1 else ""
        print(
            f"kvpool: error: {report.kept} chunks kept, with their index entries: a node refused the delete"
            f"{more}: {why}",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return 0


def _progress(description: str, quiet: bool) -> tuple[Any, Callable[[int, int], None]]:
    from rich.progress import Progress

    progress = Progress(transient=True, disable=quiet or not sys.stderr.isatty())
    task = progress.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return progress, update


def cmd_drain(args: argparse.Namespace) -> int:
    if args.batch <= 0:
        raise ConfigError("--batch", "must be a positive number")
    bar, update = _progress(f"draining {args.node_id}", args.json)
    with bar:
        result = _run(args, lambda c: admin.drain(c, args.node_id, to=args.to, batch=args.batch, progress=update))
    if args.json:
        _print_json(result.to_json())
    elif not result.stopped_by_undrain:
        print(
            f"drained {args.node_id}: {result.moved} chunks moved, {result.already_elsewhere} were already "
            f"elsewhere, {result.unreadable} unreadable; the node stays marked draining until it stops "
            f"(or `kvpool undrain {args.node_id}`)"
        )
    if result.stopped_by_undrain:
        # Not finished: a script that stops the node after a drain must not take this for done.
        print(
            f"kvpool: error: the drain of {args.node_id} was stopped by `kvpool undrain {args.node_id}` after "
            f"{result.moved} chunks moved ({result.already_elsewhere} already elsewhere, {result.unreadable} "
            f"unreadable); the rest stays on the node, which takes writes again (`kvpool drain {args.node_id}` "
            "resumes)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return 0


def cmd_undrain(args: argparse.Namespace) -> int:
    changed = _run(args, lambda c: admin.undrain(c, args.node_id))
    if args.json:
        _print_json({"node_id": args.node_id, "was_draining": changed})
    elif changed:
        print(
            f"undrained {args.node_id}: placement sends it writes again; a drain still running on it stops "
            "after the batch it is moving"
        )
    else:
        print(f"{args.node_id} was not draining")
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"kvpool: refusing to flush namespace {args.namespace!r} without --yes", file=sys.stderr)
            return EXIT_USAGE
        answer = input(f"Type the namespace ({args.namespace}) to wipe every chunk in it: ")
        if answer.strip() != args.namespace:
            print("kvpool: not flushed", file=sys.stderr)
            return EXIT_USAGE
    args.url = _with_namespace(args, args.namespace)
    bar, update = _progress(f"flushing {args.namespace}", args.json)
    with bar:
        result = _run(args, lambda c: admin.flush(c, progress=update))
    _print_json(result.to_json()) if args.json else print(
        f"flushed {args.namespace}: {result.chunks_deleted} chunks deleted, "
        f"{result.index_entries_removed} index entries removed"
    )
    return 0


def _with_namespace(args: argparse.Namespace, namespace: str) -> str:
    return dataclasses.replace(_config(args), namespace=namespace).to_url()


def cmd_check(args: argparse.Namespace) -> int:
    bar, update = _progress("checking", args.json)
    with bar:
        report = _run(args, lambda c: admin.check(c, fix=args.fix, deep=args.deep, progress=update))
    code = EXIT_PROBLEMS if report.problems else EXIT_OK
    if args.json:
        _print_json(report.to_json())
        return code
    print(f"checked {report.index_entries} index entries, verified {report.verified} checksums")
    for copies, label in (
        (report.orphan_entries, "index entries without bytes"),
        (report.orphan_bytes, "bytes without index entries"),
        (report.corrupt, "corrupt copies"),
        (report.dead_node_entries, "entries of dead nodes"),
    ):
        print(f"  {label:<30} {len(copies)}")
        for copy in copies[:10]:
            print(f"    {copy.key} on {copy.node_id} ({copy.tier})")
    print(f"  {'dead nodes':<30} {len(report.dead_nodes)} {' '.join(report.dead_nodes)}")
    if report.legacy_entries:
        print(f"  {'index keys of the old schema':<30} {report.legacy_entries} (kvp:NS:k:{{KEY}}: read by nothing)")
    if report.fixed is not None:
        f = report.fixed
        print(
            f"fixed: removed {f.entries_removed} index entries, re-indexed {f.bytes_reindexed} chunks, "
            f"forgot {f.dead_nodes_forgotten} dead nodes, deleted {f.legacy_entries_removed} old-schema index keys"
        )
    else:
        if report.corrupt:
            print(
                f"the {len(report.corrupt)} corrupt copies are already out of use: their node quarantined (NVMe) "
                "or dropped (DRAM) each, with its index entry, when it checked it, as it does on any read"
            )
        if report.repairable:
            print(
                f"run `kvpool check --fix` to repair the other {report.repairable} problems (nothing else was changed)"
            )
        elif not report.problems:
            print("clean")
    return code


def cmd_doctor(args: argparse.Namespace) -> int:
    with _client_warnings_quiet():
        if args.lmcache_config is not None:
            findings = _lmcache_doctor(args.lmcache_config)
        elif args.node:
            findings = asyncio.run(check_node_host(_node_settings(args, "node")))
        else:
            given = [option.flag_name for option in NODE_OPTIONS if option.flag and getattr(args, option.name, None)]
            if given or args.config:
                raise ConfigError(given[0] if given else "--config", "node flags check a node's host: add --node")
            findings = _run(args, check_pool)
    _print_findings(findings, args.json)
    return EXIT_OK if all(f.ok for f in findings) else EXIT_ERROR


@contextlib.contextmanager
def _client_warnings_quiet() -> Iterator[None]:
    """While doctor runs, a failure is one of its findings, not also a client warning ("node marked down")
    on stderr; with --debug (the root logger at DEBUG) everything shows."""
    client = logging.getLogger("backend.client")
    before = client.level
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        client.setLevel(logging.ERROR)
    try:
        yield
    finally:
        client.setLevel(before)


def _lmcache_doctor(config_file: Path) -> list[Finding]:
    try:
        from backend.lmcache.doctor import diagnose
    except ImportError as exc:  # a pool node's install: no LMCache, no torch
        raise KVPoolError(
            f"doctor --lmcache-config runs LMCache's own loader, which is not installed here ({exc}): run it "
            "in the engine's Python, where the kvpool[lmcache] extra is (`pip install -e '.[lmcache]'` from the "
            "kvpool checkout); check the pool with `kvpool doctor --url URL`, a node's host with "
            "`kvpool doctor --node`"
        ) from None
    return diagnose(config_file)


def _print_findings(findings: list[Finding], as_json: bool) -> None:
    if as_json:
        _print_json([f.to_json() for f in findings])
    else:
        print("\n".join(render_findings(findings)))


def cmd_selftest(args: argparse.Namespace) -> int:
    if args.chunks <= 0:
        raise ConfigError("--chunks", "must be a positive number")
    chunk_bytes = parse_size(args.chunk_size, name="--chunk-size")
    if chunk_bytes <= 0:
        raise ConfigError("--chunk-size", "must be a positive size")
    findings = _run(args, lambda client: selftest(client, chunks=args.chunks, chunk_bytes=chunk_bytes))
    _print_findings(findings, args.json)
    return EXIT_OK if all(f.ok for f in findings) else EXIT_ERROR


def _require_pool(args: argparse.Namespace) -> None:
    """Raise, naming the cause, unless the URL reaches Redis with its credentials and a live node."""
    failed = [f for f in _run(args, reach) if not f.ok]
    if failed:
        f = failed[0]
        cause = f" ({TROUBLESHOOTING}#{f.cause.slug})" if f.cause is not None else ""
        raise KVPoolError(f"{f.detail}{cause}. Fix: {f.fix}. Nothing was printed; --offline prints without checking")


def cmd_lmcache_config(args: argparse.Namespace) -> int:
    _config(args)  # validates the URL (and reads any token_file) before printing it
    fmt = args.format or FORMATS[args.mode][0]
    if fmt not in FORMATS[args.mode]:
        raise ConfigError(
            "--format", f"{fmt!r} is not a format of --mode {args.mode} (choose {' or '.join(FORMATS[args.mode])})"
        )
    if args.form is not None and args.mode != "inproc":
        raise ConfigError("--form", "is for --mode inproc; --mode mp has one form, the L2 adapter")
    if not args.offline:
        _require_pool(args)
    # LMCache logs its whole config at INFO: a secret written into the URL stays out of it.
    url, left_out = without_inline_secrets(args.url)
    for name in left_out:
        print(
            f"kvpool: the {name} was left out of the config (LMCache logs its config); give it as "
            f"{SECRET_SOURCES[name]}",
            file=sys.stderr,
        )
    if args.mode == "mp":
        if fmt == "json":
            print(json.dumps(lmcache_mp_adapter(url)))
        else:
            server_args = lmcache_mp_server_args(url, chunk_size=args.chunk_size, l1_size_gib=args.local_cpu_gib)
            print(render_mp_command(server_args), end="")
        return 0
    data = lmcache_config(
        url, form=args.form or PLUGIN_FORM, chunk_size=args.chunk_size, local_cpu_gib=args.local_cpu_gib
    )
    print(render_env(data) if fmt == "env" else render_yaml(data), end="")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": cmd_up,
    "node": cmd_node,
    "status": cmd_status,
    "nodes": cmd_nodes,
    "ls": cmd_ls,
    "stats": cmd_stats,
    "evict": cmd_evict,
    "drain": cmd_drain,
    "undrain": cmd_undrain,
    "flush": cmd_flush,
    "check": cmd_check,
    "doctor": cmd_doctor,
    "selftest": cmd_selftest,
    "lmcache-config": cmd_lmcache_config,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # before the missing verb: `kvpool --bogus` names --bogus
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.verb is None:
        parser.error("the following arguments are required: VERB")
    # The one place the CLI reads the environment: the configs take it from here.
    args.environ = dict(os.environ)
    if getattr(args, "url", "") is None:
        args.url = args.environ.get(ENV_URL)
    debug = args.debug or env_flag(args.environ, ENV_DEBUG)
    # The servers (up, node) log what they do at INFO; a one-shot verb prints its answer
    # and keeps stderr for warnings and errors.
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO if args.verb in SERVER_VERBS else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return COMMANDS[args.verb](args)
    except KVPoolError as exc:
        if debug:
            raise
        print(f"kvpool: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_ERROR
    except BrokenPipeError:
        # The reader went away (`kvpool ls | head`): stop quietly. Point stdout at /dev/null
        # so the interpreter's final flush does not report the same broken pipe again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
