"""The pin verbs: ``pin``, ``unpin``, ``pins`` (docs/fleet.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from backend import admin
from backend.cli.exits import EXIT_ERROR, EXIT_OK
from backend.cli.options import add_admin_options, run_with_client
from backend.cli.output import print_json, table
from backend.config import format_size
from backend.errors import ConfigError


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

    unpin = verbs.add_parser("unpin", help="let go of one of an owner's pins of each key: KEY..., or --prefix")
    add_admin_options(unpin)
    unpin.add_argument("keys", nargs="*", metavar="KEY")
    unpin.add_argument("--prefix", help="every key this owner pins that starts with this text")
    unpin.add_argument("--owner", default=admin.DEFAULT_PIN_OWNER, help=owner_help)

    pins = verbs.add_parser("pins", help="list the pins of every live node: key, owner, refs, expiry, bytes")
    add_admin_options(pins)
    pins.add_argument("--prefix", default="", help="only keys starting with this text")
    pins.add_argument("--owner", help="only this owner's pins")


def cmd_pin(args: argparse.Namespace) -> int:
    report = run_with_client(
        args, lambda c: admin.pin(c, args.keys, prefix=args.prefix, owner=args.owner, ttl_s=args.ttl)
    )
    if args.json:
        print_json(report.to_json())
    else:
        until = "no expiry" if report.ttl_s is None else f"for {report.ttl_s:g} s"
        print(
            f"pinned {report.keys} keys ({report.copies} copies on {len(report.nodes)} nodes) for owner "
            f"{report.owner}, {until}"
        )
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace) -> int:
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
