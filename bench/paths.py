"""Where the benchmarks find the repository, their data and the folder their results go to."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "bench" / "data"
# A run's results stay out of the tree: the few the docs cite are copied to docs/results/.
RESULTS = REPO / ".kvpool" / "results"
