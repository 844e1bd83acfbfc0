"""The store has one door: nothing outside ``backend/node/store/`` reaches past ``TierManager`` into its parts.

A caller that writes ``ctx.tiers.quotas.count_read(...)`` or ``tiers.table.slot(...)`` owns a
rule of the store (the layout check, a quota count, a chain touch) that the store no longer sees;
two callers then drift. So each store operation is one call on ``TierManager`` (docs/design.md,
"The node"), which keeps its table, eviction orders, quotas and tier objects private. This test
holds both halves over the syntax tree: the manager exposes none of them, and no module of the
product names one through a manager (``tiers.X``, ``self.tiers.X``, ``ctx.tiers.X``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.test_class_sizes import REPO

STORE = "backend/node/store"
CHECKED = ("backend", "nccl_channel", "bench")  # the product: the store's own tests may build its parts directly
# The store's parts: what a caller must ask the manager for instead of reaching into.
PARTS = {
    "table",
    "held",
    "order",
    "orders",
    "quotas",
    "dram",
    "nvme",
    "changes",
    "leases",
    "landing",
    "demoter",
    "arena",
    "buffers",
    "memory",
    "recovering",
    "room",
    "reads",
    "readback",
}


def _is_manager(node: ast.expr) -> bool:
    """Whether ``node`` names a TierManager by the project's one name for it: ``tiers`` (``x_tiers``), or ``.tiers``."""
    if isinstance(node, ast.Name):
        return node.id == "tiers" or node.id.endswith("_tiers")
    return isinstance(node, ast.Attribute) and node.attr == "tiers"


def reach_throughs(root: Path, roots: tuple[str, ...] = CHECKED) -> Iterator[str]:
    """``path:line: tiers.part`` for each access of a store part (or a private name) through a manager outside the store."""
    for top in roots:
        for path in sorted((root / top).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative.startswith(STORE + "/"):
                continue
            found = [
                node
                for node in ast.walk(ast.parse(path.read_text(), relative))
                if isinstance(node, ast.Attribute)
                and _is_manager(node.value)
                and (node.attr in PARTS or node.attr.startswith("_"))
            ]
            for node in sorted(found, key=lambda n: (n.lineno, n.col_offset)):
                yield f"{relative}:{node.lineno}: {ast.unparse(node)}"


def public_parts(root: Path) -> list[str]:
    """The names of store parts ``TierManager`` exposes: attributes set on ``self`` and methods or properties."""
    tree = ast.parse((root / STORE / "tiers.py").read_text())
    (manager,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TierManager"]
    names: set[str] = set()
    for node in ast.walk(manager):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    names.update(n.name for n in manager.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return sorted(names & PARTS)


def test_no_module_reaches_past_the_tier_manager_into_the_store() -> None:
    assert list(reach_throughs(REPO)) == []


def test_the_tier_manager_exposes_none_of_the_stores_parts() -> None:
    assert public_parts(REPO) == []


def test_the_scan_finds_a_reach_through(tmp_path: Path) -> None:
    """The rule sees each way a manager is named, and leaves the store's own modules alone."""
    (tmp_path / "backend/node/serve").mkdir(parents=True)
    (tmp_path / STORE).mkdir(parents=True)
    (tmp_path / "backend/node/serve/ops.py").write_text(
        "def f(self, ctx, tiers, pinned_tiers):\n"
        "    tiers.table.slot('k')\n"
        "    self.ctx.tiers.quotas.count_read('k', hit=True)\n"
        "    ctx.tiers.dram.capacity_bytes\n"
        "    pinned_tiers._leases\n"
        "    tiers.read(['k'], None, 1)\n"  # a store call: allowed
    )
    (tmp_path / STORE / "intake.py").write_text("def g(tiers):\n    tiers.table.slot('k')\n")
    found = list(reach_throughs(tmp_path, ("backend",)))
    assert found == [
        "backend/node/serve/ops.py:2: tiers.table",
        "backend/node/serve/ops.py:3: self.ctx.tiers.quotas",
        "backend/node/serve/ops.py:4: ctx.tiers.dram",
        "backend/node/serve/ops.py:5: pinned_tiers._leases",
    ]
