"""docs/cli.md is the CLI's own --help output: this test fails when they drift.

Regenerate with ``make docs``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

VERBS = [
    "up",
    "node",
    "status",
    "nodes",
    "ls",
    "stats",
    "evict",
    "drain",
    "undrain",
    "flush",
    "check",
    "pin",
    "unpin",
    "pins",
    "events",
    "quota",
    "doctor",
    "selftest",
    "lmcache-config",
]
HEADER = """# kvpool CLI reference

Generated from `kvpool --help` and `kvpool VERB --help` by `make docs`;
`tests/test_cli_docs.py` fails when this file and the CLI drift apart. For what each
verb is for and how to run a pool, see [operations](operations.md).

Exit codes: `0` success; `1` a kvpool error, such as Redis or a node unreachable (one line
on stderr; `--debug` shows the trace), and also: `kvpool status` with no live node in its
namespace (after its screen; stderr names the namespaces that have live nodes), `kvpool
doctor` or `kvpool selftest` when a check failed, `kvpool lmcache-config` when its URL does
not reach Redis with its credentials and a live node (unless `--offline`; nothing is
printed); `2` a usage error: a bad flag, URL, option, config
file or environment variable, named in one line (nothing was changed); `3` from
`kvpool check` when it found problems, whether or not `--fix` repaired them (`0` when the
pool is clean), so a cron job can alert on it; `kvpool pin` of a key no live node holds, or
of a `--prefix` that names none, is a usage error (nothing was pinned), a ttl over a node's cap
is an error naming that cap, and `kvpool unpin` of a key its owner pins nowhere exits `1`; `141` when the reader of stdout went away
(`kvpool ls | head`), quietly, as `cat` does. {url_json} take `--url kvpool://...`
(default `$KVPOOL_URL`) and `--json`; `lmcache-config` takes `--url`; `selftest` takes the
URL as its argument (default `$KVPOOL_URL`) and `--json`. With `--json`, a verb that fails
with a kvpool error (exit `1` or `2`) also prints one JSON object on stdout,
`{{"error": "<the stderr line's text>", "type": "<the error's class>", "exit_code": N}}`, so a
script reading stdout never reads nothing. When the URL came from `$KVPOOL_URL` and Redis is
unreachable there, the line adds that the variable may be stale from an earlier `kvpool up`
(each run starts Redis on a new port). What `doctor` finds is explained,
cause by cause, in [troubleshooting](troubleshooting.md).
"""


def _verbs_taking(*flags: str) -> list[str]:
    from backend.cli import build_parser

    verbs = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    return [
        name
        for name, sub in verbs.items()
        if all(any(flag in action.option_strings for action in sub._actions) for flag in flags)
    ]


def _help(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "LMCACHE_TRACK_USAGE": "false"}
    out = subprocess.run(
        [sys.executable, "-m", "backend.cli", *args, "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
        check=True,
    )
    return out.stdout.rstrip() + "\n"


def render_cli_doc() -> str:
    url_json = ", ".join(f"`{verb}`" for verb in _verbs_taking("--url", "--json"))
    parts = [HEADER.format(url_json=url_json), "## kvpool\n\n```\n" + _help() + "```\n"]
    for verb in VERBS:
        parts.append(f"## kvpool {verb}\n\n```\n" + _help(verb) + "```\n")
    return "\n".join(parts)


@pytest.mark.usefixtures("processes")
def test_cli_doc_matches_the_help_output():
    assert (REPO / "docs" / "cli.md").read_text() == render_cli_doc(), "docs/cli.md is stale: run `make docs`"


@pytest.mark.usefixtures("processes")
def test_every_verb_is_documented():
    listed = _help()
    for verb in VERBS:
        assert verb in listed


if __name__ == "__main__":
    (REPO / "docs" / "cli.md").write_text(render_cli_doc())
