"""docs/security.md's threat model: every row names at least one test, and every test it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_class_sizes import REPO

SECURITY_DOC = REPO / "docs" / "security.md"
# `file.py::test_name`, `::test_name` (the file named before it in the cell), or `file.py` alone
_REF = re.compile(r"`((?:[\w/]+\.py)?)(?:::(\w+))?`")


def _rows() -> list[list[str]]:
    text = SECURITY_DOC.read_text()
    table = text[text.index("## Threat model") :]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| attacker")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }


def _resolve(name: str) -> Path:
    return REPO / name if name.startswith("tests/") else REPO / "tests" / "security" / name


def test_every_row_of_the_threat_model_names_tests_that_exist():
    rows = _rows()
    assert len(rows) >= 20, "the threat model table was not found whole"
    for row in rows:
        assert len(row) == 4, f"a threat model row has {len(row)} cells, not 4: {row}"
        refs = _REF.findall(row[3])
        assert refs, f"no test named for: {row[0]} / {row[1]}"
        current: Path | None = None
        for file_name, test_name in refs:
            if file_name:
                current = _resolve(file_name)
                assert current.is_file(), f"{file_name} (row: {row[1][:60]}) does not exist"
            assert current is not None, f"::{test_name} names no file before it"
            if test_name:
                assert test_name in _tests_in(current), f"{current.name}::{test_name} does not exist"
