"""The long-running verbs: ``up`` (a private redis-server plus one node) and ``node`` (join a pool)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import secrets
import signal
import sys
from collections.abc import Callable
from typing import Any

from backend.cli.exits import EXIT_TERMINATED
from backend.cli.options import add_node_options, node_settings
from backend.cli.output import progress_bar
from backend.config import REDIS_HELP, NodeConfig, format_size, pool_config_of_redis
from backend.embedded import EmbeddedRedis, remove_orphaned_dirs
from backend.errors import ConfigError, MetadataError
from backend.lmcache.config import lmcache_config, render_yaml
from backend.node.server import PoolNode
from backend.redis_topology import mask_url

logger = logging.getLogger("kvpool")


# `kvpool up`'s private Redis: its password, when the node was given none, is made here (docs/configuration.md).
GENERATED_PASSWORD_BYTES = 32
GENERATED_PASSWORD_FILE = "redis-password"
# `kvpool up --events`: the pool token made beside that password, and the node's event ring (docs/fleet-events.md).
GENERATED_TOKEN_BYTES = 32
GENERATED_TOKEN_FILE = "token"
UP_EVENT_RING_KEYS = 100_000  # an endpoint polling every second keeps up with ~100k puts a second

RECOVERY_BAR_STEPS = 1000  # the recovery bar moves by tenths of a percent of the shard directories
RECOVERY_BAR_S = 0.2  # how often it is redrawn


def add_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = verbs.add_parser("up", help="run a pool in the foreground: a private redis-server plus one node")
    up.add_argument("--redis", metavar="URL", help="use this Redis instead of starting a private one")
    up.add_argument(
        "--events",
        action="store_true",
        help="a pool `kvpool events` can serve: a pool token made for this run in a mode-0600 file beside the "
        f"Redis password's (the printed URL names it), and the node's event ring (--event-ring-keys "
        f"{UP_EVENT_RING_KEYS} unless given)",
    )
    add_node_options(up, "up")

    node = verbs.add_parser("node", help="run a node that joins an existing pool")
    node.add_argument("--redis", metavar="URL", help=REDIS_HELP)
    add_node_options(node, "node")


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
    bar, update = progress_bar(f"node {node.node_id}: recovering its NVMe chunks", quiet=False)
    with bar:
        while report is not None and not report.done and not node.stopping:
            update(round(report.progress * RECOVERY_BAR_STEPS), RECOVERY_BAR_STEPS)
            await asyncio.sleep(RECOVERY_BAR_S)
            report = node.recovery


def cmd_node(args: argparse.Namespace) -> int:
    config = NodeConfig.from_options(node_settings(args))  # --redis is required there: --config may supply it

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


def _private_redis(settings: dict[str, Any], *, events: bool) -> tuple[EmbeddedRedis, NodeConfig]:
    """``kvpool up``'s own redis-server, started behind a password, and the config of the node that uses it.

    The password is the node's (``--redis-password-file`` or ``KVPOOL_REDIS_PASSWORD``), else a
    new one, kept in a mode-0600 file of the server's private directory: the index is never
    open to whoever reaches the port, token or not. With ``events`` and no token given, a pool
    token is made the same way, beside it. The server dies with this process
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
        if events and not _has_token(settings):
            settings["token_file"] = redis.write_secret(
                GENERATED_TOKEN_FILE, secrets.token_urlsafe(GENERATED_TOKEN_BYTES)
            )
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


def _has_token(settings: dict[str, Any]) -> bool:
    return bool(settings["token_file"] or settings["token"])


def _events_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``kvpool up --events``'s node settings: the event ring on; with ``--redis``, the token must be given."""
    if settings["redis"] and not _has_token(settings):
        raise ConfigError(
            "--events",
            "with --redis, give the pool token as well (--token-file PATH, mode 0600, or KVPOOL_TOKEN): kvpool up "
            "makes a token file only beside the password of the Redis it starts",
        )
    return {**settings, "event_ring_keys": settings["event_ring_keys"] or UP_EVENT_RING_KEYS}


def _events_note(config: NodeConfig, url: str, *, generated: bool) -> str:
    """What `kvpool up --events` says: where the token is (never what it is) and the command that serves events."""
    whose = "a pool token generated for this run" if generated else "the pool token given"
    where = (
        f"in {config.token_file} (mode 0600; the pool URL names it, token_file=)"
        if config.token_file
        else ("from KVPOOL_TOKEN")
    )
    return (
        f"Events: the node keeps its last {config.event_ring_keys} stores and removals (--event-ring-keys); "
        f"clients and subscribers need {whose}, {where}. Serve them to routers with:\n"
        f"  kvpool events --url '{url}' --model MODEL"
    )


def cmd_up(args: argparse.Namespace) -> int:
    settings = node_settings(args)
    if args.events:
        settings = _events_settings(settings)
    redis, config = (
        (None, NodeConfig.from_options(settings)) if settings["redis"] else _private_redis(settings, events=args.events)
    )
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
            if args.events:
                generated = not _has_token(node_settings(args))
                print(f"{_events_note(config, url, generated=generated)}\n")
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


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": cmd_up,
    "node": cmd_node,
}
