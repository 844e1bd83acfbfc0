"""What every bench plot shares: matplotlib's pyplot drawing to files, and how a figure is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NO_MATPLOTLIB = "no matplotlib (pip install -e '.[bench]'): no plots written"


def pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg backend (files, no display), or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(plt: Any, figure: Any, path: Path) -> Path:
    """Lay ``figure`` out, write it to ``path`` (100 dpi) and close it."""
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
