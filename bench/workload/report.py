"""What a replay shows beside the simulator: the same trace's simulated policies, the verdict, the plots.

    python -m bench.workload.report docs/results/workload-<stamp>.json --plot docs/pictures

``bench.workload.run`` calls this after its table. For each trace x capacity it replays the same
trace through the simulator (``bench.workload.sim``) with every policy and the replay's own
engine-local tiers (``bench.workload.runs.local_chunks``), so the simulated pool hit rates sit
beside the measured ones on equal terms: the same requests, the same pool capacity in chunks,
the same local tier in front of the pool. Then it says how the node's ``eviction=prefix``
stands against ``eviction=lru`` (both measured) and against the simulated baselines.

The plots: per trace, the pool hit rate against capacity (measured backends solid, simulated
policies dashed), and the modeled time to first token per backend at each capacity.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workload import sim as workload_sim
from bench.workload.plots import NO_MATPLOTLIB, pyplot, save
from bench.workload.runs import local_chunks, make_trace
from bench.workload.traces import PRESETS, Trace

# The node's prefix-aware order, and the order it is measured against.
NODE_PREFIX = "kvpool prefix"
NODE_LRU = "kvpool lru"
REFERENCE = "belady"  # furthest next use: a reference, not a bound for prefix chains


@dataclass(frozen=True)
class Measured:
    """One replayed backend's figures that the report reads (a ``bench.workload.run.RunResult`` or its JSON)."""

    backend: str
    trace: str
    capacity: float
    bound: str
    pool_hit_rate: float
    local_hit_rate: float
    ttft_ms_mean: float
    no_cache_ttft_ms_mean: float
    failure: str | None = None

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Measured:
        tokens = record["tokens"] or 1
        return cls(
            backend=record["backend"],
            trace=record["trace"],
            capacity=record["capacity"],
            bound=record["bound"],
            pool_hit_rate=record["pool_hit_tokens"] / tokens,
            local_hit_rate=record["local_hit_tokens"] / tokens,
            ttft_ms_mean=record["ttft_ms_mean"],
            no_cache_ttft_ms_mean=record["no_cache_ttft_ms_mean"],
            failure=record.get("failure"),
        )


@dataclass(frozen=True)
class Simulated:
    """One simulated policy on the replayed trace, with the replay's local tiers."""

    policy: str
    trace: str
    capacity: float
    pool_hit_rate: float
    local_hit_rate: float


def simulate_beside(trace: Trace, capacity: float, local_fraction: float) -> list[Simulated]:
    """Every simulated policy on ``trace`` at ``capacity``, each engine's local tier as the replay sizes it."""
    local = local_chunks(trace.working_set_chunks, [r.chunk_tokens for r in trace.requests], local_fraction)
    preset = PRESETS["ci-tiny"]  # hit rates do not depend on the bytes per token
    costs = workload_sim.Costs(preset.kv_bytes_per_token, workload_sim.LOAD_GBPS * 1e9, 1.0)
    rows = []
    for policy in workload_sim.POLICIES:
        result = workload_sim.simulate(trace, policy, capacity, costs, local_fraction=local / trace.working_set_chunks)
        rows.append(
            Simulated(
                policy=policy,
                trace=trace.name,
                capacity=capacity,
                pool_hit_rate=result.pool_hit_rate,
                local_hit_rate=(result.hit_tokens - result.pool_hit_tokens) / result.total_tokens,
            )
        )
    return rows


def simulated_table(rows: Sequence[Simulated]) -> str:
    lines = ["| simulated policy | trace | capacity | pool hit % | local hit % |", "|---|---|---|---|---|"]
    lines += [
        f"| sim {r.policy} | {r.trace} | {r.capacity:g} | {100 * r.pool_hit_rate:.1f} | {100 * r.local_hit_rate:.1f} |"
        for r in rows
    ]
    return "\n".join(lines)


def verdict(measured: Sequence[Measured], simulated: Sequence[Simulated]) -> list[str]:
    """Per trace x capacity: the node's prefix order against its lru order and the simulated baselines.

    The baselines are every simulated policy but Belady (the reference) and the node's own orders
    (``prefix``, ``prefix-recency``: the simulator's model of what is measured). "Half-way" is from
    the measured LRU to the simulated Belady."""
    lines = []
    for trace, capacity in dict.fromkeys((m.trace, m.capacity) for m in measured):
        mine = {m.backend: m for m in measured if (m.trace, m.capacity) == (trace, capacity) and not m.failure}
        sims = {s.policy: s for s in simulated if (s.trace, s.capacity) == (trace, capacity)}
        prefix, lru = mine.get(NODE_PREFIX), mine.get(NODE_LRU)
        if prefix is None or lru is None or REFERENCE not in sims:
            continue
        baselines = {p: s for p, s in sims.items() if p != REFERENCE and not p.startswith("prefix")}
        best = max(baselines.values(), key=lambda s: s.pool_hit_rate)
        reference = sims[REFERENCE].pool_hit_rate
        gap = reference - lru.pool_hit_rate
        way = (prefix.pool_hit_rate - lru.pool_hit_rate) / gap if gap > 0 else float("nan")
        bounded = [m for m in mine.values() if not m.bound.startswith("none")]
        lowest = min(bounded, key=lambda m: m.ttft_ms_mean) if bounded else None
        lines.append(
            f"{trace} at {capacity:g}: eviction=prefix {100 * prefix.pool_hit_rate:.1f} % of tokens from the pool,"
            f" lru {100 * lru.pool_hit_rate:.1f} % ({100 * (prefix.pool_hit_rate - lru.pool_hit_rate):+.1f} points);"
            f" best simulated baseline {best.policy} {100 * best.pool_hit_rate:.1f} %,"
            f" simulated {REFERENCE} {100 * reference:.1f} %; "
            + (
                f"{100 * way:.0f} % of the way from lru to {REFERENCE}"
                if gap > 0
                else f"lru measured at or above {REFERENCE}"
            )
            + (
                f"; lowest modeled TTFT of the bounded backends: {lowest.backend} {lowest.ttft_ms_mean:.1f} ms"
                if lowest
                else ""
            )
        )
    return lines


# -- plots -----------------------------------------------------------------------------------
def plot(measured: Sequence[Measured], simulated: Sequence[Simulated], directory: Path) -> list[Path]:
    """Per trace: pool hit rate vs capacity (measured solid, simulated dashed); modeled TTFT per backend."""
    plt = pyplot()
    if plt is None:
        print(NO_MATPLOTLIB)
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for trace in dict.fromkeys(m.trace for m in measured):
        rows = [m for m in measured if m.trace == trace and not m.failure]
        sims = [s for s in simulated if s.trace == trace]
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for backend in dict.fromkeys(m.backend for m in rows):
            points = sorted((m.capacity, 100 * m.pool_hit_rate) for m in rows if m.backend == backend)
            unbounded = any(m.bound.startswith("none") for m in rows if m.backend == backend)
            label = f"{backend} (unbounded)" if unbounded else backend
            axes.plot(
                *zip(*points, strict=True), marker="o", label=label, linewidth=2 if backend.startswith("kvpool") else 1
            )
        for policy in dict.fromkeys(s.policy for s in sims):
            points = sorted((s.capacity, 100 * s.pool_hit_rate) for s in sims if s.policy == policy)
            axes.plot(*zip(*points, strict=True), marker=".", linestyle="--", label=f"sim {policy}", alpha=0.7)
        axes.set_xlabel("pool capacity (fraction of the working set)")
        axes.set_ylabel("tokens served from the pool (%)")
        axes.set_title(f"{trace}: pool hit rate, replayed (solid) and simulated (dashed)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=6, ncol=2)
        written.append(save(plt, figure, directory / f"workload-replay-{trace}-hits.png"))

        capacities = sorted({m.capacity for m in rows})
        backends = list(dict.fromkeys(m.backend for m in rows))
        figure, axes = plt.subplots(figsize=(7, 4.5))
        width = 0.8 / max(1, len(backends))
        for i, backend in enumerate(backends):
            values = [
                next((m.ttft_ms_mean for m in rows if m.backend == backend and m.capacity == c), 0.0)
                for c in capacities
            ]
            axes.bar([x + i * width for x in range(len(capacities))], values, width, label=backend)
        no_cache = max((m.no_cache_ttft_ms_mean for m in rows), default=0.0)
        axes.axhline(no_cache, color="black", linestyle=":", label="no cache")
        axes.set_xticks([x + width * (len(backends) - 1) / 2 for x in range(len(capacities))])
        axes.set_xticklabels([f"{c:g}" for c in capacities])
        axes.set_xlabel("pool capacity (fraction of the working set)")
        axes.set_ylabel("mean time to first token, ms (prefill modeled)")
        unbounded = list(dict.fromkeys(m.backend for m in rows if m.bound.startswith("none")))
        axes.set_title(
            f"{trace}: modeled TTFT per backend" + (f" ({', '.join(unbounded)} unbounded)" if unbounded else "")
        )
        axes.grid(alpha=0.3, axis="y")
        axes.legend(fontsize=6, ncol=2)
        written.append(save(plt, figure, directory / f"workload-replay-{trace}-ttft.png"))
    return written


# -- the report ------------------------------------------------------------------------------
def report(
    measured: Sequence[Measured],
    traces: dict[str, Trace],
    local_fraction: float,
    plot_dir: Path | None = None,
    print_line: Callable[[str], None] = print,
) -> list[Simulated]:
    """Print the simulated policies beside the replay and the verdict; write the plots when asked."""
    simulated: list[Simulated] = []
    for trace, capacity in dict.fromkeys((m.trace, m.capacity) for m in measured):
        simulated += simulate_beside(traces[trace], capacity, local_fraction)
    print_line("")
    print_line(
        "The same traces simulated with the replay's local tiers (bench.workload.sim; a model, not a measurement):"
    )
    for line in simulated_table(simulated).splitlines():
        print_line(line)
    for line in verdict(measured, simulated):
        print_line(f"[workload] {line}")
    if plot_dir is not None:
        for path in plot(measured, simulated, plot_dir):
            print_line(f"[workload] wrote {path}")
    return simulated


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workload.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "results",
        type=Path,
        nargs="+",
        help="docs/results/workload-<stamp>.json file(s) of one trace setup (.json.gz too)",
    )
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write the PNGs there")
    args = parser.parse_args(argv)
    measured: list[Measured] = []
    setups = set()
    for path in args.results:
        raw = path.read_bytes()
        record = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
        if "engines" not in record:
            parser.error(f"{path}: written before the report's fields (engines, seed, reduced, local_fraction)")
        setups.add((record["engines"], record["seed"], record["reduced"], record["local_fraction"]))
        measured += [Measured.from_json(r) for r in record["results"]]
    if len(setups) != 1:
        parser.error(f"the files replayed different setups (engines, seed, reduced, local fraction): {sorted(setups)}")
    engines, seed, reduced, local_fraction = setups.pop()
    traces = {name: make_trace(name, engines, seed, reduced) for name in dict.fromkeys(m.trace for m in measured)}
    report(measured, traces, local_fraction, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
