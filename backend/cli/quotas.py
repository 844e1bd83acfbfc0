"""The quota verb: ``kvpool quota`` lists, ``quota set TENANT BYTES [--scope node|pool]`` and ``quota clear TENANT
[--scope node|pool]`` (docs/fleet.md)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from backend import admin
from backend.cli.exits import EXIT_OK
from backend.cli.options import add_admin_options, run_with_client
from backend.cli.output import print_json, table
from backend.config import format_size, parse_size
from backend.errors import ConfigError
from backend.metadata import NODE_SCOPE, POOL_SCOPE, QUOTA_SCOPES
from backend.tenants import check_tenant


def add_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    quota = verbs.add_parser(
        "quota",
        help="tenants' byte quotas (bytes a tenant holds on each node, or over the pool): list; "
        "set TENANT BYTES [--scope pool]; clear TENANT [--scope pool]",
    )
    add_admin_options(quota)
    quota.add_argument("action", nargs="?", choices=("list", "set", "clear"), default="list")
    quota.add_argument("tenant", nargs="?", metavar="TENANT", help="1-64 of A-Z a-z 0-9 _ . -")
    quota.add_argument("size", nargs="?", metavar="BYTES", help="for set: 1048576, 512MiB, 4GiB (0: nothing)")
    quota.add_argument(
        "--scope",
        choices=QUOTA_SCOPES,
        default=NODE_SCOPE,
        help="for set and clear: the quota bounds the tenant's bytes on each node (node, the default) or "
        "summed over the live nodes (pool); a tenant may have both, and both apply",
    )


def _quota_bytes(text: str | None) -> int:
    if text is None:
        raise ConfigError("BYTES", "quota set needs TENANT and BYTES")
    if text.strip().startswith("-"):
        raise ConfigError("BYTES", f"a quota is 0 or more bytes, not {text}")
    return parse_size(text, name="BYTES")


def cmd_quota(args: argparse.Namespace) -> int:
    if args.action != "list" and args.tenant is None:
        raise ConfigError("TENANT", f"quota {args.action} needs a TENANT")
    if args.action != "set" and args.size is not None:
        raise ConfigError("BYTES", f"quota {args.action} takes no BYTES (got {args.size})")
    scope, where = args.scope, "over the pool" if args.scope == POOL_SCOPE else "on each node"
    if args.action == "set":
        check_tenant(args.tenant, "TENANT")  # before anything is asked of Redis
        quota_bytes = _quota_bytes(args.size)
        run_with_client(args, lambda c: admin.set_quota(c, args.tenant, quota_bytes, scope))
        print(f"tenant {args.tenant}: quota {format_size(quota_bytes)} {where} (from each node's next heartbeat)")
        return EXIT_OK
    if args.action == "clear":
        check_tenant(args.tenant, "TENANT")
        had = run_with_client(args, lambda c: admin.clear_quota(c, args.tenant, scope))
        print(f"tenant {args.tenant}: " + (f"quota {where} cleared" if had else f"had no quota {where}"))
        return EXIT_OK
    rows = run_with_client(args, admin.list_quotas)
    if args.json:
        print_json([row.to_json() for row in rows])
        return EXIT_OK
    if not rows:
        print("no tenants")
        return EXIT_OK
    table(
        None,
        ["tenant", "quota/node", "quota/pool", "held (pool)", "puts", "hits", "misses"],
        [
            [
                row.tenant,
                "-" if row.quota_bytes is None else format_size(row.quota_bytes),
                "-" if row.pool_quota_bytes is None else format_size(row.pool_quota_bytes),
                format_size(row.held_bytes),
                row.puts,
                row.hits,
                row.misses,
            ]
            for row in rows
        ],
    )
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"quota": cmd_quota}
