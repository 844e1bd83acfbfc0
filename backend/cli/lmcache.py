"""``kvpool lmcache-config``: the LMCache config (or multiprocess server command) that enables kvpool."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from backend.cli.options import add_url_option, pool_config, run_with_client
from backend.config import without_inline_secrets
from backend.doctor import TROUBLESHOOTING, reach
from backend.errors import ConfigError, KVPoolError
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

FORMATS = {"inproc": ("yaml", "env"), "mp": ("args", "json")}  # lmcache-config --format, per --mode


def add_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cfg = verbs.add_parser("lmcache-config", help="print the LMCache config that enables kvpool")
    add_url_option(cfg)
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


def _require_pool(args: argparse.Namespace) -> None:
    """Raise, naming the cause, unless the URL reaches Redis with its credentials and a live node."""
    failed = [f for f in run_with_client(args, reach) if not f.ok]
    if failed:
        f = failed[0]
        cause = f" ({TROUBLESHOOTING}#{f.cause.slug})" if f.cause is not None else ""
        raise KVPoolError(f"{f.detail}{cause}. Fix: {f.fix}. Nothing was printed; --offline prints without checking")


def cmd_lmcache_config(args: argparse.Namespace) -> int:
    pool_config(args)  # validates the URL (and reads any token_file) before printing it
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
    "lmcache-config": cmd_lmcache_config,
}
