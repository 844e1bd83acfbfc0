"""The replay's report: the simulated policies beside the measured ones, on equal terms, and the verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.workload import report as workload_report
from bench.workload import sim as workload_sim
from bench.workload.report import Measured, Simulated
from bench.workload.runs import local_chunks, make_trace


def measured(backend: str, pool: float, ttft: float, bound: str = "--dram 1MiB") -> Measured:
    return Measured(backend, "multi-round", 0.5, bound, pool, 0.2, ttft, 100.0)


def simulated(policy: str, pool: float) -> Simulated:
    return Simulated(policy, "multi-round", 0.5, pool, 0.2)


def test_the_verdict_compares_prefix_with_lru_and_the_baselines_but_not_belady_or_the_nodes_own_orders() -> None:
    lines = workload_report.verdict(
        [
            measured("kvpool lru", 0.20, 90.0),
            measured("kvpool prefix", 0.35, 70.0),
            measured("redis", 0.10, 120.0),
            measured("lm", 0.60, 40.0, bound="none: it has no eviction"),
        ],
        [
            simulated("lru", 0.21),
            simulated("s3-fifo", 0.30),
            simulated("prefix", 0.50),  # the node's own rule: not a baseline
            simulated("belady", 0.40),
        ],
    )
    assert len(lines) == 1
    line = lines[0]
    assert "+15.0 points" in line
    assert "best simulated baseline s3-fifo 30.0 %" in line
    assert "75 % of the way from lru to belady" in line  # (35 - 20) / (40 - 20)
    # lm is unbounded: it is not among the bounded backends whose TTFT is compared
    assert "lowest modeled TTFT of the bounded backends: kvpool prefix 70.0 ms" in line


def test_the_simulator_beside_the_replay_gets_the_replays_local_tier() -> None:
    trace = make_trace("multi-round", engines=2, seed=0, reduced=True)
    tokens = [r.chunk_tokens for r in trace.requests]
    local = local_chunks(trace.working_set_chunks, tokens, 0.05)
    assert local == 3 * max(len(t) for t in tokens)  # three of the largest requests beat 5 % of this small trace
    rows = workload_report.simulate_beside(trace, 0.5, 0.05)
    assert [r.policy for r in rows] == list(workload_sim.POLICIES)
    assert all(r.local_hit_rate > 0 for r in rows)  # the local tiers are in front of the pool
    no_local = workload_sim.simulate(trace, "lru", 0.5, workload_sim.Costs(1024, 1e9, 1.0), local_fraction=0.0)
    with_local = next(r for r in rows if r.policy == "lru")
    assert with_local.pool_hit_rate < no_local.pool_hit_rate  # the local tiers take hits the pool had


def test_the_report_refuses_results_that_do_not_say_their_setup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "workload-old.json"
    old.write_text(json.dumps({"results": []}))
    with pytest.raises(SystemExit):
        workload_report.main([str(old)])
    assert "written before the report's fields" in capsys.readouterr().err
