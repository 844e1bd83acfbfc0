"""The docs a new user follows cannot drift from the code silently.

- every ``kvpool …`` command line shown in README.md and docs/*.md parses with the
  CLI's real argument parser;
- every option the pool URL parser knows has a row in docs/configuration.md's option
  table and is named in its ``KVPOOL_*`` table, and every name those tables give is
  one the code reads;
- every metric a node can export has a row in docs/metrics.md;
- every ``kvpool node`` / ``kvpool up`` command and every ``kvpool://`` URL shown as an
  example carries the secrets and address flags its setup needs (a reader copies them
  literally: a URL without the Redis password gives an engine that misses on every lookup);
- every ``pip install`` shown, in the docs or in a message of the code, installs from a
  checkout: the package is not published.

(docs/cli.md itself is the ``--help`` output, checked by tests/test_cli_docs.py.)
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import pytest

from backend.cli import build_parser
from backend.config.pool import ENV_PREFIX, OPTION_NAMES, known_env_names
from backend.metrics import _RECOVERY_GAUGES, _TIER_GAUGES, NODE_COUNTERS, NODE_PREFIX
from tests.conftest import REPO
from tests.test_metrics import _source_counters

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GENERATED = {"cli.md"}  # the --help output, checked byte for byte elsewhere
VERBS = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


SYNTAX = "<!-- syntax, not a setup -->"  # on the line before a code block that shows a URL's form, not a pool


@dataclass(frozen=True)
class Example:
    """One line of shell (a code block's line, continuations joined) or one inline code span of a doc."""

    where: str
    text: str
    context: str  # the whole code block, or the span: where an example may set KVPOOL_* for itself
    in_block: bool
    syntax: bool  # in a block marked SYNTAX


def _examples() -> Iterator[Example]:
    for path in DOCS:
        if path.name in GENERATED:
            continue
        lines = path.read_text().splitlines()
        block: list[str] | None = None
        start = 0
        for number, line in enumerate(lines, 1):
            if not line.lstrip().startswith("```"):
                if block is not None:
                    block.append(line)
                else:
                    for span in re.findall(r"`([^`]+)`", line):
                        yield Example(f"{path.relative_to(REPO)}:{number}", span, span, False, False)
                continue
            if block is None:
                block, start = [], number
                continue
            syntax = start > 1 and lines[start - 2].strip() == SYNTAX
            pending, context = "", "\n".join(block)
            for offset, text in enumerate(block, start + 1):
                text = pending + text
                pending = ""
                if text.rstrip().endswith("\\"):
                    pending = text.rstrip()[:-1] + " "
                    continue
                yield Example(f"{path.relative_to(REPO)}:{offset}", text, context, True, syntax)
            block = None


EXAMPLES = list(_examples())


def _command_lines() -> Iterator[tuple[str, list[str], str]]:
    """(where, command, context) for each ``kvpool VERB ...`` in a code block or inline code span."""
    for example in EXAMPLES:
        if example.in_block:
            yield from ((example.where, c, example.context) for c in _commands_in(example.text.split(" #")[0]))
        elif not ERROR_TEXT.search(example.text):  # an error message quoting a command, not one to run
            yield from ((example.where, c, example.context) for c in _commands_in(example.text))


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
    shown = {argv[0] for _, argv, _ in COMMANDS}
    assert len(COMMANDS) > 30 and len(shown) >= len(VERBS) - 2, sorted(shown)


@pytest.mark.parametrize(("where", "argv", "context"), COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_every_documented_command_parses(where, argv, context):
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


def test_the_unknown_option_message_in_the_docs_is_the_one_the_code_gives():
    from backend.config import PoolConfig
    from backend.errors import ConfigError

    message = re.search(r"`(replica: unknown option in the URL; [^`]+)`", CONFIGURATION)
    assert message, "the example of the unknown-option error is gone from docs/configuration.md"
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url("kvpool://h:1/ns?replica=2")
    assert message.group(1) == str(caught.value)  # the close name, then every option in order


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


METRICS = (REPO / "docs" / "metrics.md").read_text()


def test_every_node_metric_has_a_row_in_the_metrics_page():
    rows = set(re.findall(r"^\| `(kvpool_node_[a-z_]+)`", METRICS, re.MULTILINE))
    missing = _node_metric_names() - rows
    assert len(_node_metric_names()) > 40
    assert not missing, f"node metrics with no row in docs/metrics.md: {sorted(missing)}"


def test_the_counters_said_to_appear_once_non_zero_are_exactly_those_not_always_exported():
    rows = dict(re.findall(r"^\| `kvpool_node_([a-z_]+)_total` \|(.*)$", METRICS, re.MULTILINE))
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


# -- examples carry the secrets and address flags their setup needs ----------------------------------
#
# Every pool the docs set up has a Redis with a password (`kvpool up`'s private one always
# has one; every other setup shown runs Redis with one), so every example names it. A pool
# that another host reaches (a node listening beyond loopback, or a Redis on another host)
# has a token and nodes that advertise an address the other hosts can dial.

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WILDCARD = {"0.0.0.0", "::"}
PASSWORD_ENV = ("KVPOOL_REDIS_PASSWORD", "os.environ")  # an example that sets it (or reads it) for itself
TOKEN_ENV = ("KVPOOL_TOKEN", "os.environ")


def _option(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), None when absent."""
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def _redis_hosts(redis_url: str) -> list[str]:
    """The host names of a ``--redis`` URL (one per seed of a cluster or sentinel list)."""
    netloc = redis_url.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    return [seed.rsplit(":", 1)[0].strip("[]") for seed in netloc.split(",")]


def _server_faults(argv: list[str], context: str) -> list[str]:
    """What a ``kvpool node`` / ``kvpool up`` example leaves out of what its setup needs."""
    verb, faults = argv[0], []
    redis = _option(argv, "--redis")
    if "--config" in argv or "--help" in argv or "..." in argv:  # a file may carry any of it; or elided
        return []
    if redis is not None and "://" not in redis:  # `kvpool up --redis URL`: a form named in prose
        return []
    if verb == "node" and redis is None:  # a flag named in prose (`kvpool node --advertise HOST`), not a command
        return []
    host = _option(argv, "--host") or "127.0.0.1"
    has = {flag: _option(argv, flag) is not None for flag in ("--redis-password-file", "--token-file", "--advertise")}
    if (verb == "node" or redis is not None) and not has["--redis-password-file"]:
        if not any(name in context for name in PASSWORD_ENV):
            faults.append("--redis-password-file (its Redis has a password)")
    remote_redis = redis is not None and any(h not in LOOPBACK for h in _redis_hosts(redis))
    if remote_redis and host in LOOPBACK:
        faults.append(f"--host beyond loopback (its Redis is on another host, so are its clients; --host {host})")
    if host not in LOOPBACK or remote_redis:
        if not has["--token-file"] and not any(name in context for name in TOKEN_ENV):
            faults.append("--token-file (other hosts reach it)")
        if not has["--advertise"] and (remote_redis or host in WILDCARD):
            faults.append("--advertise (the address other hosts dial)")
    return faults


SERVERS = [(w, argv, c) for w, argv, c in COMMANDS if argv[0] in ("node", "up")]


@pytest.mark.parametrize(("where", "argv", "context"), SERVERS, ids=[w for w, _, _ in SERVERS])
def test_every_node_and_up_example_carries_the_secrets_and_address_flags_its_setup_needs(where, argv, context):
    faults = _server_faults(argv, context)
    assert not faults, f"{where}: `kvpool {shlex.join(argv)}` lacks {'; '.join(faults)}"


URL_RE = re.compile(r"kvpool://[^\s'\"`)]+")
COMMAND_SPAN = re.compile(r"^(\$ )?(kvpool |export |[A-Z_]+=\S* kvpool )|from_url\(")


def _url_examples() -> Iterator[tuple[str, str, str]]:
    """(where, url, context) for each pool URL given to something: in a code block (not one marked SYNTAX),
    or in an inline code span that is a command. URLs in prose and tables show forms, not setups."""
    for example in EXAMPLES:
        if example.syntax or not (example.in_block or COMMAND_SPAN.search(example.text)):
            continue
        for url in URL_RE.findall(example.text):
            if url.rstrip(".,;") != "kvpool://" and "..." not in url:
                yield example.where, url, example.context


def _url_faults(url: str, context: str) -> list[str]:
    parts = urlsplit(url.replace("$", "%24"))  # a shell variable is a host name here
    query = parse_qs(parts.query)
    faults = []
    if "redis_password_file" not in query and not any(name in context for name in PASSWORD_ENV):
        faults.append("redis_password_file= (its Redis has a password)")
    host = (parts.hostname or "").replace("%24", "$")
    if host not in LOOPBACK and "token_file" not in query and not parts.username and not parts.password:
        if not any(name in context for name in TOKEN_ENV):
            faults.append("token_file= (a pool other hosts reach has a token)")
    return faults


URLS = list(_url_examples())


def test_the_docs_show_pool_urls_to_check():
    assert len(URLS) > 20, URLS


@pytest.mark.parametrize(("where", "url", "context"), URLS, ids=[w for w, _, _ in URLS])
def test_every_pool_url_example_names_the_redis_password_and_the_token_it_needs(where, url, context):
    faults = _url_faults(url, context)
    assert not faults, f"{where}: {url} lacks {'; '.join(faults)}"


# -- install lines ----------------------------------------------------------------------------------

PIP_INSTALL = re.compile(r"pip install ([^`\n)]*)")


def _pip_installs() -> Iterator[tuple[str, str]]:
    """(where, what follows ``pip install``) in the docs and in the code's messages."""
    sources = [p for p in DOCS if p.name not in GENERATED]
    sources += sorted((REPO / "backend").rglob("*.py")) + sorted((REPO / "nccl_channel").rglob("*.py"))
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in PIP_INSTALL.finditer(line):
                yield f"{path.relative_to(REPO)}:{number}", match.group(1).split(" #")[0]  # not its comment


INSTALLS = list(_pip_installs())


def test_the_docs_show_install_lines():
    assert len(INSTALLS) >= 5, INSTALLS


@pytest.mark.parametrize(("where", "words"), INSTALLS, ids=[w for w, _ in INSTALLS])
def test_every_install_line_installs_kvpool_from_a_checkout_not_from_an_index(where, words):
    """kvpool is not published: ``pip install 'kvpool[lmcache]'`` fails; a path (``.``, ``-e .``) works."""
    by_name = [w for w in words.replace('"', " ").replace("'", " ").split() if re.fullmatch(r"kvpool(\[.*\])?", w)]
    assert not by_name, f"{where}: pip install {words.strip()} names kvpool as a published package"
