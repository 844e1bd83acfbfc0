"""How verbs print: JSON, tables (rich), progress bars on a terminal."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Mapping
from typing import Any

from backend.config import format_size
from backend.protocol.reports import TierReport


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False, default=str))


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    shown = Table(title=title, show_lines=False)
    for column in columns:
        shown.add_column(column, overflow="fold")
    for row in rows:
        shown.add_row(*(str(cell) for cell in row))
    Console(width=max(120, shutil.get_terminal_size().columns)).print(shown)


def tiers_text(tiers: Mapping[str, TierReport]) -> str:
    return ", ".join(f"{name} {format_size(t.used_bytes)}/{format_size(t.capacity_bytes)}" for name, t in tiers.items())


def progress_bar(description: str, quiet: bool) -> tuple[Any, Callable[[int, int], None]]:
    from rich.progress import Progress

    progress = Progress(transient=True, disable=quiet or not sys.stderr.isatty())
    task = progress.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return progress, update
