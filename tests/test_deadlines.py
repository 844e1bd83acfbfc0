"""Every bound a client waits under is derived in one place, backend/config/deadlines.py.

- no module but that one does arithmetic on PoolConfig's durations (its fields named ``*_s``,
  whatever they are called: the set is read from the dataclass), found over the syntax tree;
- the client and the LMCache layer read those durations only through ``Deadlines``;
- docs/configuration.md's deadline table names every field of ``Deadlines`` and says how each is
  derived, and the derivation it writes gives the value the code computes;
- the values are today's: the put's room wait, the node's commit wait, the connector's call...
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.config import PoolConfig
from backend.config.deadlines import Deadlines
from backend.node.serve.puts import commit_wait_s
from backend.protocol.puts import PutOptions
from tests.conftest import REPO

DEADLINES_MODULE = REPO / "backend" / "config" / "deadlines.py"
SCANNED = ("backend", "kvpool", "nccl_channel", "bench")
# The rooms that hold a PoolConfig and wait on the network: they read its durations only through Deadlines.
DEADLINE_USERS = ("backend/client", "backend/lmcache")
DURATIONS = frozenset(f.name for f in dataclasses.fields(PoolConfig) if f.name.endswith("_s"))
# Calls that derive a number from their arguments (a unit conversion included).
DERIVING_CALLS = frozenset({"min", "max", "sum", "round", "abs", "pow", "divmod", "s_to_ms", "ms_to_s"})
ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def test_the_durations_are_read_from_the_config_dataclass() -> None:
    assert {"connect_timeout_s", "progress_timeout_s", "pair_timeout_s"} <= DURATIONS


def _reads_duration(node: ast.AST, aliases: set[str]) -> bool:
    """Whether ``node`` reads one of PoolConfig's durations: ``x.progress_timeout_s``, or a local named from one."""
    for part in ast.walk(node):
        if isinstance(part, ast.Attribute) and part.attr in DURATIONS:
            return True
        if isinstance(part, ast.Name) and part.id in aliases:
            return True
    return False


def _is_duration(value: ast.AST) -> bool:
    """Whether ``value`` is a duration itself (``config.progress_timeout_s``) or one worked on."""
    return (isinstance(value, ast.Attribute) and value.attr in DURATIONS) or _derives(value, set())


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math":
        return "math." + func.attr
    return ""


def _derives(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.BinOp):
        return _reads_duration(node.left, aliases) or _reads_duration(node.right, aliases)
    if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.Not):
        return _reads_duration(node.operand, aliases)
    if isinstance(node, ast.AugAssign):
        return _reads_duration(node.target, aliases) or _reads_duration(node.value, aliases)
    if isinstance(node, ast.Compare) and any(isinstance(op, ORDERINGS) for op in node.ops):
        return any(_reads_duration(side, aliases) for side in (node.left, *node.comparators))
    if isinstance(node, ast.Call):
        name = _call_name(node)
        if name in DERIVING_CALLS or name.startswith("math."):
            return any(_reads_duration(arg, aliases) for arg in (*node.args, *(k.value for k in node.keywords)))
    return False


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _scopes(tree: ast.AST) -> Iterator[ast.AST]:
    yield tree
    yield from (node for node in ast.walk(tree) if isinstance(node, SCOPES))


def _in_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope`` outside the functions defined in it (each has its own locals)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def derivations(source: str, where: str = "") -> list[str]:
    """``where:line: code`` for each place ``source`` does arithmetic on a PoolConfig duration.

    A local given a duration (``timeout = config.progress_timeout_s``, or one worked on) counts as one in its
    scope; a local given what a call made of one (``store = MetadataStore(config.progress_timeout_s)``) does not.
    """
    tree = ast.parse(source)
    found: dict[int, str] = {}
    for scope in _scopes(tree):
        aliases: set[str] = set()
        for node in _in_scope(scope):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and _is_duration(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                aliases |= {t.id for t in targets if isinstance(t, ast.Name)}
        for node in _in_scope(scope):
            if _derives(node, aliases):
                line = getattr(node, "lineno", 0)
                found[line] = f"{where}:{line}: {ast.get_source_segment(source, node)}"
    return [found[line] for line in sorted(found)]


def _sources(*roots: str) -> Iterator[Path]:
    for root in roots:
        yield from sorted((REPO / root).rglob("*.py"))


def test_no_module_but_the_deadlines_module_does_arithmetic_on_the_config_durations() -> None:
    paths = [p for p in _sources(*SCANNED) if p != DEADLINES_MODULE]
    assert len(paths) > 100, "the scan is looking in the wrong place"
    found = [d for path in paths for d in derivations(path.read_text(), str(path.relative_to(REPO)))]
    assert found == [], "derive these in backend/config/deadlines.py (a named Deadlines field):\n" + "\n".join(found)


def test_the_deadlines_module_is_where_they_are_derived() -> None:
    assert derivations(DEADLINES_MODULE.read_text()), "the scan finds nothing in the module that derives them"


@pytest.mark.parametrize(
    "code",
    [
        "wait = config.progress_timeout_s * 2",
        "ms = s_to_ms(self.ctx.config.progress_timeout_s * SHARE)",
        "bound = max(cfg.connect_timeout_s, 1.0)",
        "total += cfg.pair_timeout_s",
        "if cfg.progress_timeout_s > limit:\n    pass",
        "def f(cfg):\n    timeout = cfg.progress_timeout_s\n    return timeout / 4",
        "def f(cfg):\n    wait = cfg.progress_timeout_s * 2\n    return wait + 1",
        "x = -config.connect_timeout_s",
        "ms = s_to_ms(config.progress_timeout_s)",
        "y = math.ceil(config.pair_timeout_s)",
    ],
)
def test_the_scan_finds_a_derivation(code: str) -> None:
    assert derivations(code)


@pytest.mark.parametrize(
    "code",
    [
        "sock = connect(host, port, config.connect_timeout_s)",
        "same = a.progress_timeout_s == b.progress_timeout_s",
        "wait = deadlines.progress_s * 2",  # a Deadlines field is not a config duration
        "def f(cfg):\n    timeout = cfg.progress_timeout_s\n\ndef g(timeout):\n    return timeout * 2",
        "def f(self, cfg):\n    self.store = Store(cfg.progress_timeout_s)\n    self.hooks += [1]",
        "def f(cfg):\n    store = Store(cfg.progress_timeout_s)\n    return store.size * 2",
    ],
)
def test_the_scan_lets_a_plain_use_pass(code: str) -> None:
    assert derivations(code) == []


def test_the_client_and_the_lmcache_layer_read_the_durations_only_through_deadlines() -> None:
    read = []
    for path in _sources(*DEADLINE_USERS):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in DURATIONS:
                read.append(f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr}")
    assert read == [], "use the client's Deadlines (ctx.deadlines, PoolClient.deadlines):\n" + "\n".join(read)


# -- the values ---------------------------------------------------------------------------
def test_the_deadlines_of_the_default_config_are_the_bounds_the_client_always_had() -> None:
    d = Deadlines.from_config(PoolConfig())
    assert (d.connect_s, d.progress_s, d.redis_call_s, d.touch_s) == (2.0, 2.0, 2.0, 2.0)
    assert (d.room_wait_s, d.room_wait_ms, d.commit_wait_s) == (1.0, 1000, 0.5)
    assert (d.connector_call_s, d.delete_s, d.channel_transfer_s, d.pair_s) == (4.0, 8.0, 2.0, 30.0)
    # A request queued behind two puts that may each be held for room: its silence grows by both holds.
    assert d.request_silence_s(2 * d.room_wait_s) == 4.0
    assert d.request_overall_s(2.0, 256 * 1024 * 1024) == 258.0  # 256 MiB at 1 MiB/s on top of its silence


def test_each_bound_follows_the_duration_it_is_derived_from() -> None:
    d = Deadlines.from_config(PoolConfig(connect_timeout_s=0.3, progress_timeout_s=0.5, pair_timeout_s=7.0))
    assert (d.connect_s, d.progress_s, d.pair_s) == (0.3, 0.5, 7.0)
    assert (d.room_wait_ms, d.commit_wait_s, d.connector_call_s, d.delete_s) == (250, 0.125, 1.0, 2.0)
    tiny = Deadlines.from_config(PoolConfig(progress_timeout_s=0.01))
    assert tiny.commit_wait_s == 0.05  # the node's floor: even a put that may wait for nothing gets a commit


def test_deadlines_are_a_frozen_value() -> None:
    d = Deadlines.from_config(PoolConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.progress_s = 5.0  # type: ignore[misc]


@pytest.mark.parametrize("progress_s", [0.01, 0.3, 2.0, 7.5])
def test_the_commit_wait_is_what_the_node_gives_the_put_the_client_sends(progress_s: float) -> None:
    d = Deadlines.from_config(PoolConfig(progress_timeout_s=progress_s))
    assert commit_wait_s(PutOptions(1, d.room_wait_ms)) == pytest.approx(d.commit_wait_s, abs=0.001)


# -- the table in docs/configuration.md ---------------------------------------------------
CONFIGURATION = (REPO / "docs" / "configuration.md").read_text()
ROW = re.compile(r"^\| `([a-z_]+)` \| (.+?) \| `([0-9.]+) s` \| (.+?) \|$", re.MULTILINE)
TIMES = "\u00d7"  # the table's multiplication sign
DERIVATION = re.compile(rf"`([a-z_]+)`(?: {TIMES} ([0-9.]+))?(?:, at least ([0-9.]+) s)?")


def _table() -> dict[str, tuple[str, float]]:
    start = CONFIGURATION.index("## Deadlines")
    end = CONFIGURATION.find("\n## ", start + 1)
    rows = ROW.findall(CONFIGURATION[start : end if end >= 0 else None])
    assert rows, "docs/configuration.md has no deadline table under ## Deadlines"
    return {name: (derived, float(default)) for name, derived, default, _why in rows}


def _derive(text: str, config: PoolConfig) -> float:
    """A derivation as the table writes it (a duration, times a factor, at least a floor), worked out."""
    match = DERIVATION.fullmatch(text)
    assert match, f"{text!r} is not `FIELD`, `FIELD` {TIMES} FACTOR or `FIELD` {TIMES} FACTOR, at least N s"
    field, factor, floor = match.groups()
    assert field in DURATIONS, f"{field} is not a duration of PoolConfig"
    return max(getattr(config, field) * float(factor or 1), float(floor or 0))


def test_the_deadline_table_names_every_field_of_deadlines_and_no_other() -> None:
    assert list(_table()) == [f.name for f in dataclasses.fields(Deadlines)]


@pytest.mark.parametrize(
    "config",
    [
        PoolConfig(),
        PoolConfig(connect_timeout_s=0.3, progress_timeout_s=0.5, pair_timeout_s=7.0),
        PoolConfig(connect_timeout_s=9.0, progress_timeout_s=0.01, pair_timeout_s=0.2),
    ],
    ids=["defaults", "short", "tiny-progress"],
)
def test_the_deadline_table_says_how_each_bound_is_derived(config: PoolConfig) -> None:
    deadlines = Deadlines.from_config(config)
    for name, (derived, _default) in _table().items():
        assert _derive(derived, config) == pytest.approx(getattr(deadlines, name)), f"{name}: {derived}"


def test_the_deadline_table_gives_each_bound_at_the_default_config() -> None:
    deadlines = Deadlines.from_config(PoolConfig())
    assert {name: default for name, (_, default) in _table().items()} == dataclasses.asdict(deadlines)
