"""The flags verbs share, and what they name: the pool of ``--url`` and a node's options."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from backend.client import PoolClient
from backend.config import NODE_OPTIONS, NODE_VERB_DEFAULTS, PoolConfig, node_options
from backend.errors import ConfigError

T = TypeVar("T")


def add_admin_options(parser: argparse.ArgumentParser) -> None:
    add_url_option(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def add_url_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", metavar="kvpool://...", help="pool URL (default: $KVPOOL_URL)")


def add_node_options(parser: argparse.ArgumentParser, verb: str) -> None:
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


def node_settings(args: argparse.Namespace, verb: str = "") -> dict[str, Any]:
    """The node options of ``kvpool up``/``kvpool node`` (or of ``verb``'s node): flags, else environment, else
    --config, else defaults."""
    flags = {option.name: getattr(args, option.name, None) for option in NODE_OPTIONS if option.flag}
    defaults = NODE_VERB_DEFAULTS[verb or args.verb]
    return node_options(flags, config_file=args.config, environ=args.environ, defaults=defaults)


def pool_config(args: argparse.Namespace) -> PoolConfig:
    if not args.url:
        raise ConfigError("--url", "no pool URL: pass --url kvpool://HOST:PORT/NS or set KVPOOL_URL")
    return PoolConfig.from_url(args.url, args.environ)


def run_with_client(args: argparse.Namespace, work: Callable[[PoolClient], Awaitable[T]]) -> T:
    """Run ``work`` with a client of the pool named by ``--url``; always closes it.

    Not opened with ``connect()``: a verb's first call meets the same Redis errors, and ``doctor``
    turns them into findings."""
    config = pool_config(args)

    async def go() -> T:
        client = PoolClient(config)
        try:
            return await work(client)
        finally:
            await client.close()

    return asyncio.run(go())
