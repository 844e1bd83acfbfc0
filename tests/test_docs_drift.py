"""The docs a new user follows cannot drift from the code silently.

- every ``kvpool …`` command line shown in README.md and docs/*.md parses with the
  CLI's real argument parser;
- every option the pool URL parser knows has a row in docs/configuration.md's option
  table and is named in its ``KVPOOL_*`` table, and every name those tables give is
  one the code reads;
- every metric a node can export has a row in docs/operations.md.

(docs/cli.md itself is the ``--help`` output, checked by tests/test_cli_docs.py.)
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator

import pytest

from backend.cli import build_parser
from backend.config.pool import ENV_PREFIX, OPTION_NAMES, known_env_names
from backend.metrics import _RECOVERY_GAUGES, _TIER_GAUGES, NODE_COUNTERS, NODE_PREFIX
from tests.conftest import REPO
from tests.test_metrics import _source_counters

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GENERATED = {"cli.md"}  # the --help output, checked byte for byte elsewhere
VERBS = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def _command_lines() -> Iterator[tuple[str, list[str]]]:
    """(where, command) for each ``kvpool VERB ...`` in a code block or inline code span."""
    for path in DOCS:
        if path.name in GENERATED:
            continue
        text = path.read_text()
        in_block = False
        pending = ""
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{path.relative_to(REPO)}:{number}"
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            if in_block:
                line = pending + line
                pending = ""
                if line.rstrip().endswith("\\"):
                    pending = line.rstrip()[:-1] + " "
                    continue
                for command in _commands_in(line.split(" #")[0]):
                    yield where, command
            else:
                for span in re.findall(r"`([^`]+)`", line):
                    if not ERROR_TEXT.search(span):  # an error message quoting a command, not one to run
                        yield from ((where, command) for command in _commands_in(span))


def _commands_in(text: str) -> Iterator[list[str]]:
    """The argv of each ``kvpool VERB ...`` in one line of shell, up to a pipe, redirection, ``;`` or ``&``."""
    text = text.strip().removeprefix("$ ").replace("\\|", "|")
    if text.startswith("usage:") or "kvpool" not in text:
        return
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: prose, or a command cut by the line end
        tokens = text.split()
    for i, token in enumerate(tokens[:-1]):
        if token.lstrip("$(") == "kvpool" and tokens[i + 1] in VERBS:
            argv = []
            for word in tokens[i + 1 :]:
                if set(word) <= set("|&;<>()"):
                    break
                argv.append(word)
            if len(argv) > 1 or argv[0] in QUIET_VERBS:  # else the verb's name in prose
                yield argv


ERROR_TEXT = re.compile(r"^(kvpool: error: |[A-Za-z]*Error: )")
QUIET_VERBS = {"status", "nodes", "stats", "ls", "up", "check"}  # a command with no arguments


def _parse(argv: list[str]) -> str:
    """'' when the CLI's parser takes ``argv``, else its error message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        return "" if exc.code == 0 else err.getvalue().strip().splitlines()[-1]
    return ""


COMMANDS = list(_command_lines())


def test_the_docs_show_commands_of_most_verbs():
    shown = {argv[0] for _, argv in COMMANDS}
    assert len(COMMANDS) > 30 and len(shown) >= len(VERBS) - 2, sorted(shown)


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_parses(where, argv):
    assert _parse(argv) == "", f"{where}: `kvpool {shlex.join(argv)}`"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else None]


CONFIGURATION = (REPO / "docs" / "configuration.md").read_text()


def test_every_url_option_has_a_row_in_the_option_table_and_no_row_is_unknown():
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", CONFIGURATION, re.MULTILINE))
    options = set(OPTION_NAMES)
    table = {row for row in rows if row in options or re.fullmatch(r"[a-z]+(_[a-z]+)*", row)}
    assert options <= rows, f"options without a row: {sorted(options - rows)}"
    documented = _section(CONFIGURATION, "## Options")
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", documented, re.MULTILINE))
    assert listed == options, f"rows for no option: {sorted(listed - options)}; missing: {sorted(options - listed)}"
    assert table


def test_the_unknown_option_message_in_the_docs_lists_every_option():
    message = re.search(r"`replica: unknown option in the URL; known: ([a-z_, ]+)`", CONFIGURATION)
    assert message, "the example of the unknown-option error is gone from docs/configuration.md"
    assert message.group(1).split(", ") == list(OPTION_NAMES)


def test_the_environment_table_names_every_variable_the_code_reads_and_no_other():
    table = _section(CONFIGURATION, "## Environment variables")
    documented = set(re.findall(r"`(KVPOOL_[A-Z_]+)`", table.split("**Precedence:**")[0]))
    known = set(known_env_names())
    assert documented == known, f"undocumented: {sorted(known - documented)}; unknown: {sorted(documented - known)}"
    assert {f"{ENV_PREFIX}{name.upper()}" for name in OPTION_NAMES} <= documented


def _node_metric_names() -> set[str]:
    """Every metric name ``backend/metrics/node.py`` can export for a node (counters as ``_total``)."""
    node_counters, _ = _source_counters()  # what the node's code (and a channel node's) can count
    names = {f"{NODE_PREFIX}{name}_total" for name in set(NODE_COUNTERS) | node_counters}
    source = (REPO / "backend" / "metrics" / "node.py").read_text()
    names |= {NODE_PREFIX + name for name in re.findall(r'_gauge\(\s*"([a-z_]*[a-z])",', source)}
    names |= {f"{NODE_PREFIX}tier_{field}" for field in _TIER_GAUGES}
    names |= {f"{NODE_PREFIX}recovery_{field}" for field in _RECOVERY_GAUGES}
    names |= {f"{NODE_PREFIX}request_latency_seconds_{part}" for part in ("bucket", "count", "sum")}
    return names


def test_every_node_metric_has_a_row_in_operations():
    operations = (REPO / "docs" / "operations.md").read_text()
    rows = set(re.findall(r"^\| `(kvpool_node_[a-z_]+)`", operations, re.MULTILINE))
    missing = _node_metric_names() - rows
    assert len(_node_metric_names()) > 40
    assert not missing, f"node metrics with no row in docs/operations.md: {sorted(missing)}"


def test_the_counters_said_to_appear_once_non_zero_are_exactly_those_not_always_exported():
    operations = (REPO / "docs" / "operations.md").read_text()
    rows = dict(re.findall(r"^\| `kvpool_node_([a-z_]+)_total` \|(.*)$", operations, re.MULTILINE))
    said_late = {name for name, text in rows.items() if "appears once non-zero" in text}
    assert said_late == set(rows) - set(NODE_COUNTERS)


def test_every_node_flag_has_a_row_in_configuration_and_every_row_is_a_flag():
    node = build_parser()._subparsers._group_actions[0].choices["node"]  # type: ignore[union-attr]
    flags = {option for action in node._actions for option in action.option_strings if option.startswith("--")}
    flags.discard("--help")
    table = _section(CONFIGURATION, "## Node flags")
    rows = {
        flag
        for cell in re.findall(r"^\| (`--[^|]+)\|", table, re.MULTILINE)
        for flag in re.findall(r"`(--[a-z-]+)", cell)
    }
    assert flags == rows, f"flags without a row: {sorted(flags - rows)}; rows of no flag: {sorted(rows - flags)}"
