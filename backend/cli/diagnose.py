"""The verbs that say what is wrong: ``doctor`` and ``selftest``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from backend.cli.exits import EXIT_ERROR, EXIT_OK
from backend.cli.options import add_node_options, node_settings, run_with_client
from backend.cli.output import print_json
from backend.config import NODE_OPTIONS, REDIS_HELP, parse_size
from backend.doctor import Finding, check_node_host, check_pool, selftest
from backend.doctor import render as render_findings
from backend.doctor.selftest import DEFAULT_CHUNK_BYTES as SELFTEST_CHUNK_BYTES
from backend.doctor.selftest import DEFAULT_CHUNKS as SELFTEST_CHUNKS
from backend.errors import ConfigError, KVPoolError
from backend.lmcache.logs import lmcache_logs


def add_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    doctor.add_argument(
        "--verbose", action="store_true", help="with --lmcache-config: show LMCache's own log (only its errors without)"
    )
    doctor.add_argument("--redis", metavar="URL", help="with --node: " + REDIS_HELP)
    add_node_options(doctor, "node")

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


def cmd_doctor(args: argparse.Namespace) -> int:
    with _client_warnings_quiet():
        if args.lmcache_config is not None:
            findings = _lmcache_doctor(args.lmcache_config, verbose=args.verbose)
        elif args.node:
            findings = asyncio.run(check_node_host(node_settings(args, "node")))
        else:
            given = [option.flag_name for option in NODE_OPTIONS if option.flag and getattr(args, option.name, None)]
            if given or args.config:
                raise ConfigError(given[0] if given else "--config", "node flags check a node's host: add --node")
            findings = run_with_client(args, check_pool)
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


def _lmcache_doctor(config_file: Path, *, verbose: bool) -> list[Finding]:
    with lmcache_logs(verbose=verbose, plain=not sys.stderr.isatty()):
        try:
            from backend.lmcache.doctor import diagnose
        except ImportError as exc:  # a pool node's install: no LMCache, no torch
            raise _no_lmcache(exc) from None
        return diagnose(config_file)


def _no_lmcache(exc: ImportError) -> KVPoolError:
    return KVPoolError(
        f"doctor --lmcache-config runs LMCache's own loader, which is not installed here ({exc}): run it "
        "in the engine's Python, where the kvpool[lmcache] extra is (`pip install -e '.[lmcache]'` from the "
        "kvpool checkout); check the pool with `kvpool doctor --url URL`, a node's host with "
        "`kvpool doctor --node`"
    )


def _print_findings(findings: list[Finding], as_json: bool) -> None:
    if as_json:
        print_json([f.to_json() for f in findings])
    else:
        terminal = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        print("\n".join(render_findings(findings, colour=terminal)))


def cmd_selftest(args: argparse.Namespace) -> int:
    if args.chunks <= 0:
        raise ConfigError("--chunks", "must be a positive number")
    chunk_bytes = parse_size(args.chunk_size, name="--chunk-size")
    if chunk_bytes <= 0:
        raise ConfigError("--chunk-size", "must be a positive size")
    findings = run_with_client(args, lambda client: selftest(client, chunks=args.chunks, chunk_bytes=chunk_bytes))
    _print_findings(findings, args.json)
    return EXIT_OK if all(f.ok for f in findings) else EXIT_ERROR


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "doctor": cmd_doctor,
    "selftest": cmd_selftest,
}
