"""No room holds one big class: every class in backend/ and nccl_channel/ stays under 300 lines.

Run as a script to list every class there by size: ``python -m tests.test_class_sizes``.
"""

from __future__ import annotations

import ast
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_CLASS_LINES = 300
CHECKED = ("backend", "nccl_channel")


def class_sizes(*roots: str) -> list[tuple[int, str]]:
    """(lines, "path:Class") for every class under ``roots``, largest first."""
    sizes = []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    sizes.append((lines, f"{path.relative_to(REPO)}:{node.name}"))
    return sorted(sizes, reverse=True)


def test_no_class_is_over_300_lines() -> None:
    sizes = class_sizes(*CHECKED)
    assert sizes, "no class found: the scan is looking in the wrong place"
    assert [(n, name) for n, name in sizes if n > MAX_CLASS_LINES] == []


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    for lines, name in class_sizes(*CHECKED):
        print(f"{lines:5d}  {name}{'  (over ' + str(MAX_CLASS_LINES) + ')' if lines > MAX_CLASS_LINES else ''}")
    sys.exit(0)
