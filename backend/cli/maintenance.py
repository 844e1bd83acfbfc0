"""The verbs that change a pool: ``evict``, ``drain``, ``undrain``, ``flush``, ``check``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from backend import admin
from backend.cli.exits import EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE
from backend.cli.options import add_admin_options, pool_config, run_with_client
from backend.cli.output import print_json, progress_bar
from backend.errors import ConfigError


def add_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evict = verbs.add_parser("evict", help="remove chunks everywhere: KEY..., or --model / --prefix")
    add_admin_options(evict)
    evict.add_argument("keys", nargs="*", metavar="KEY")
    evict.add_argument("--model", help="every key of this model")
    evict.add_argument("--prefix", help="every key starting with this text")

    drain = verbs.add_parser(
        "drain", help="move a node's chunks to other nodes, then leave it draining (until it stops or `undrain`)"
    )
    add_admin_options(drain)
    drain.add_argument("node_id", metavar="NODE")
    drain.add_argument("--to", metavar="NODE", help="move everything to this node (default: normal placement)")
    drain.add_argument(
        "--batch",
        type=int,
        default=admin.DRAIN_BATCH_ITEMS,
        help=f"chunks moved per step (default {admin.DRAIN_BATCH_ITEMS})",
    )

    undrain = verbs.add_parser("undrain", help="end a drain: the node takes writes again")
    add_admin_options(undrain)
    undrain.add_argument("node_id", metavar="NODE")

    flush = verbs.add_parser("flush", help="wipe every chunk of a namespace (asks on a terminal unless --yes)")
    add_admin_options(flush)
    flush.add_argument("--namespace", required=True, help="the namespace to wipe (must be given explicitly)")
    flush.add_argument("--yes", action="store_true", help="do not ask")

    check = verbs.add_parser("check", help="fsck: index vs bytes, checksums, dead nodes; --fix repairs")
    add_admin_options(check)
    check.add_argument("--fix", action="store_true", help="repair what was found and say what changed")
    check.add_argument("--deep", action="store_true", help="verify the checksum of every chunk (default: a sample)")


def cmd_evict(args: argparse.Namespace) -> int:
    if args.keys and (args.model or args.prefix):
        raise ConfigError("evict", "give keys or --model/--prefix, not both")
    report = run_with_client(args, lambda c: admin.evict(c, args.keys, model=args.model, prefix=args.prefix))
    print_json(report.to_json()) if args.json else print(f"evicted {report.evicted} chunks")
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


def cmd_drain(args: argparse.Namespace) -> int:
    if args.batch <= 0:
        raise ConfigError("--batch", "must be a positive number")
    bar, update = progress_bar(f"draining {args.node_id}", args.json)
    with bar:
        result = run_with_client(
            args, lambda c: admin.drain(c, args.node_id, to=args.to, batch=args.batch, progress=update)
        )
    if args.json:
        print_json(result.to_json())
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
    changed = run_with_client(args, lambda c: admin.undrain(c, args.node_id))
    if args.json:
        print_json({"node_id": args.node_id, "was_draining": changed})
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
    bar, update = progress_bar(f"flushing {args.namespace}", args.json)
    with bar:
        result = run_with_client(args, lambda c: admin.flush(c, progress=update))
    print_json(result.to_json()) if args.json else print(
        f"flushed {args.namespace}: {result.chunks_deleted} chunks deleted, "
        f"{result.index_entries_removed} index entries removed"
    )
    return 0


def _with_namespace(args: argparse.Namespace, namespace: str) -> str:
    return dataclasses.replace(pool_config(args), namespace=namespace).to_url()


def cmd_check(args: argparse.Namespace) -> int:
    bar, update = progress_bar("checking", args.json)
    with bar:
        report = run_with_client(args, lambda c: admin.check(c, fix=args.fix, deep=args.deep, progress=update))
    code = EXIT_PROBLEMS if report.problems else EXIT_OK
    if args.json:
        print_json(report.to_json())
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


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "evict": cmd_evict,
    "drain": cmd_drain,
    "undrain": cmd_undrain,
    "flush": cmd_flush,
    "check": cmd_check,
}
