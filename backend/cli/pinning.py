"""The pin verbs: ``pin``, ``unpin``, ``pins`` (docs/fleet.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend import admin
from backend.cli.exits import EXIT_ERROR, EXIT_OK
from backend.cli.options import add_admin_options, run_with_client
from backend.cli.output import print_json, table
from backend.config import format_size
from backend.errors import ConfigError, KVPoolError
from backend.tenants import check_tenant

PROMPT_FLAGS = ("--tokens-file", "--lmcache-config", "--model")


def _ttl(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def add_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    owner_help = f"who holds the pin (default {admin.DEFAULT_PIN_OWNER}): an unpin lets go of this owner's pins only"
    pin = verbs.add_parser(
        "pin", help="keep chunks on their nodes, never evicted, until unpinned or their ttl ends: KEY..., or --prefix"
    )
    add_admin_options(pin)
    pin.add_argument("keys", nargs="*", metavar="KEY")
    pin.add_argument("--prefix", help="every key the pool index holds now that starts with this text")
    pin.add_argument(
        "--ttl",
        type=_ttl,
        metavar="S",
        help="seconds the pin lasts (default: the node's --pin-ttl-default-s); 0: no expiry, where the node's "
        "--pin-ttl-max-s is 0",
    )
    pin.add_argument("--owner", default=admin.DEFAULT_PIN_OWNER, help=owner_help)
    _add_prompt_options(pin, "pin the chunks of a prompt the pool holds from its start, by its token ids")

    unpin = verbs.add_parser("unpin", help="let go of one of an owner's pins of each key: KEY..., or --prefix")
    add_admin_options(unpin)
    unpin.add_argument("keys", nargs="*", metavar="KEY")
    unpin.add_argument("--prefix", help="every key this owner pins that starts with this text")
    unpin.add_argument("--owner", default=admin.DEFAULT_PIN_OWNER, help=owner_help)
    _add_prompt_options(unpin, "let go of the owner's pins of a prompt's chunks, by its token ids")

    pins = verbs.add_parser("pins", help="list the pins of every live node: key, owner, refs, expiry, bytes")
    add_admin_options(pins)
    pins.add_argument("--prefix", default="", help="only keys starting with this text")
    pins.add_argument("--owner", help="only this owner's pins")


def _add_prompt_options(parser: argparse.ArgumentParser, what: str) -> None:
    group = parser.add_argument_group(
        "a prompt by its tokens", f"{what}: the keys LMCache makes of them for the engine these options describe"
    )
    group.add_argument("--tokens-file", type=Path, metavar="F", help="the token ids: a JSON list, or integers")
    group.add_argument("--lmcache-config", type=Path, metavar="FILE", help="the engine's LMCache config file")
    group.add_argument("--model", help="the engine's model name, as LMCache's keys carry it")
    group.add_argument("--world-size", type=int, default=1, metavar="N", help="its workers (each has its own keys)")
    group.add_argument("--kv-dtype", default="bfloat16", help="its KV dtype as LMCache spells it (default bfloat16)")
    group.add_argument("--layers", type=int, default=0, metavar="L", help="its layers (layerwise configs only)")
    group.add_argument(
        "--tenant",
        metavar="NAME",
        help="the tenant whose chunks (its stored keys ~t/NAME/KEY: an engine naming tenants by tag, "
        "tenant_tag=); default: the --url's tenant=, else no tenant's",
    )


def _prompt_workers(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The ``--tokens-file`` prompt's tokens and each worker's keys of it (``backend.lmcache.prompts``)."""
    missing = [flag for flag in PROMPT_FLAGS if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        raise ConfigError(missing[0], f"a prompt by its tokens needs {', '.join(PROMPT_FLAGS)}")
    if args.keys or args.prefix:
        raise ConfigError("--tokens-file", "name keys, --prefix or --tokens-file: one of them")
    if args.tenant is not None:
        check_tenant(args.tenant, "--tenant")
    try:
        from backend.lmcache import prompts
    except ImportError as exc:  # a pool node's install: no LMCache, no torch
        raise KVPoolError(
            f"--tokens-file makes the keys with LMCache's own code, which is not installed here ({exc}): run it "
            "in the engine's Python, where the kvpool[lmcache] extra is"
        ) from None
    tokens = prompts.read_tokens(args.tokens_file)
    workers = prompts.engine_prompt_keys(args.lmcache_config, args.model, args.world_size, args.kv_dtype, args.layers)
    return prompts, [worker.chunks(tokens) for worker in workers]


def _cmd_pin_prompt(args: argparse.Namespace) -> int:
    prompts, workers = _prompt_workers(args)

    async def work(client: Any) -> list[Any]:
        return [
            await prompts.pin_prompt(client, chunks, ttl_s=args.ttl, owner=args.owner, tenant=args.tenant)
            for chunks in workers
        ]

    reports = run_with_client(args, work)
    if args.json:
        print_json([report.to_json() for report in reports])
        return EXIT_OK
    for worker, report in enumerate(reports):
        print(
            f"worker {worker}: pinned {report.pinned_chunks} of the prompt's {report.chunks} chunks ({report.keys} "
            f"keys, {report.copies} copies on {len(report.nodes)} nodes) for owner {report.owner}, {_until(report.ttl_s)}"
        )
    return EXIT_OK


def _no_tenant_without_prompt(args: argparse.Namespace) -> None:
    if args.tenant is not None and args.tokens_file is None:
        raise ConfigError(
            "--tenant", "names the tenant of a prompt's chunks (--tokens-file); name other keys as stored, ~t/NAME/KEY"
        )


def _until(ttl_s: float | None) -> str:
    """How long a pin lasts, as ``pin`` reports it: the ttl the nodes applied (None: none)."""
    return "no expiry" if ttl_s is None else f"for {ttl_s:g} s"


def cmd_pin(args: argparse.Namespace) -> int:
    _no_tenant_without_prompt(args)
    if args.tokens_file is not None:
        return _cmd_pin_prompt(args)
    report = run_with_client(
        args, lambda c: admin.pin(c, args.keys, prefix=args.prefix, owner=args.owner, ttl_s=args.ttl)
    )
    if args.json:
        print_json(report.to_json())
    else:
        print(
            f"pinned {report.keys} keys ({report.copies} copies on {len(report.nodes)} nodes) for owner "
            f"{report.owner}, {_until(report.ttl_s)}"
        )
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace) -> int:
    _no_tenant_without_prompt(args)
    if args.tokens_file is not None:
        prompts, workers = _prompt_workers(args)

        async def work(client: Any) -> admin.UnpinReport:
            done = [
                await prompts.unpin_prompt(client, chunks, owner=args.owner, tenant=args.tenant) for chunks in workers
            ]
            return admin.UnpinReport(args.owner, sum(r.unpinned for r in done), ())

        report = run_with_client(args, work)  # a prompt's chunks never pinned (past its hit prefix) are no error
    else:
        report = run_with_client(args, lambda c: admin.unpin(c, args.keys, prefix=args.prefix, owner=args.owner))
    if args.json:
        print_json(report.to_json())
    else:
        print(f"unpinned {report.unpinned} keys for owner {report.owner}")
    if report.not_pinned:
        more = f" (and {len(report.not_pinned) - 1} more)" if len(report.not_pinned) > 1 else ""
        print(
            f"kvpool: error: {report.not_pinned[0]!r}{more} is not pinned by owner {report.owner} on any live node",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if args.tokens_file is not None and not report.unpinned:
        raise ConfigError("--tokens-file", f"owner {args.owner} pins none of this prompt's chunks on any live node")
    if not args.keys and not report.unpinned:
        raise ConfigError("--prefix", f"owner {args.owner} pins no key starting with {args.prefix!r}")
    return EXIT_OK


def cmd_pins(args: argparse.Namespace) -> int:
    rows = run_with_client(args, lambda c: admin.list_pins(c, args.prefix, args.owner))
    if args.json:
        print_json([row.to_json() for row in rows])
        return EXIT_OK
    if not rows:
        print("no pins")
        return EXIT_OK
    table(
        None,
        ["node", "key", "owner", "refs", "expires in", "bytes", "tier"],
        [
            [
                row.node_id,
                row.pin.key,
                row.pin.owner,
                row.pin.refs,
                "never" if row.pin.expires_in_s is None else f"{row.pin.expires_in_s:.0f} s",
                "-" if row.pin.nbytes is None else format_size(row.pin.nbytes),
                row.pin.tier or "not held",
            ]
            for row in rows
        ],
    )
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"pin": cmd_pin, "unpin": cmd_unpin, "pins": cmd_pins}
