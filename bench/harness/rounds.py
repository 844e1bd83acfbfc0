"""Interleaved rounds: each cell is measured once per round, and reported as medians.

The harness runs every backend's cells in round 1, then every backend's cells again in
round 2, and so on, so that a slow minute of a shared machine lands on all backends
alike. A reported figure is the median over the rounds that measured the cell
(put/get GB/s; p50 and p99, each the median of that round's percentile over its
calls); every round's own figures stay under ``per_round``. The machine's ceilings,
measured at the start of every round, are reported as their best round. Pure
functions, no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["combine_cells", "combine_ceilings"]

IDENTITY = ("chunk", "chunk_bytes", "shape", "batch", "clients", "calls")
RATES = ("put_gbps", "get_gbps")
LATENCIES = ("put_ms", "get_ms")
QUANTILES = ("p50", "p99")
COUNTS = ("chunks_read", "misses", "mismatches", "evictions", "chunks_put")


def _identity(cell: dict[str, Any]) -> tuple[str, int, int]:
    return (cell["chunk"], cell["batch"], cell["clients"])


def combine_cells(round_cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per chunk x batch x clients, in the order first measured, from every round's cells."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for cell in round_cells:
        groups.setdefault(_identity(cell), []).append(cell)
    return [_combine(rounds) for rounds in groups.values()]


def _combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    cell = {field: rounds[0][field] for field in IDENTITY}
    measured = [r for r in rounds if "get_gbps" in r]
    cell["rounds"] = len(rounds)
    cell["rounds_measured"] = len(measured)
    for field in COUNTS:  # summed: a miss or a difference in any round counts
        if field in rounds[0]:
            cell[field] = sum(r.get(field, 0) for r in rounds)
    cell["errors"] = [f"round {r['round']}: {error}" for r in rounds for error in r["errors"]]
    if measured:
        for rate in RATES:
            cell[rate] = statistics.median(r[rate] for r in measured)
        for op in LATENCIES:
            cell[op] = {q: statistics.median(r[op][q] for r in measured) for q in QUANTILES}
            cell[op]["n"] = measured[0][op]["n"]  # calls per round behind each round's percentiles
    cell["per_round"] = [{k: v for k, v in r.items() if k not in IDENTITY} for r in rounds]
    return cell


def combine_ceilings(per_round: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Each ceiling's best over the rounds, with every round's value under ``per_round``.

    A ceiling is what the machine can do (``bench.harness.ceilings`` keeps the best of its own
    repetitions too): a busy round can only lower it, so the best round is the ceiling.
    """
    names = list(per_round[0])
    return {**{n: max(r[n] for r in per_round) for n in names}, "per_round": list(per_round)}
