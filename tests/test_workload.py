"""The workload replay (``python -m bench.workload``): a reduced multi-round trace through real LMCache engines.

The replay test starts kvpool and two engine processes, so it is in the process tier.
It asserts what a run of this size can honestly show: engines hit chunks in the pool
(both of them, and the trace moves users between engines every round), no byte loaded
differs from what was stored, the pool stayed within its capacity and evicted to do so,
and the table is printed. Hit rates themselves are not asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import workload
from bench.workload_engine import Served
from bench.workload_runs import RunSpec


@pytest.mark.usefixtures("processes")
def test_reduced_multi_round_replay_hits_across_engines_verifies_every_byte_and_stays_in_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--trace", "multi-round", "--engines", "2", "--capacity", "0.5", "--backends", "kvpool", "--reduced"]
    assert workload.main([*argv, "--out", str(tmp_path)]) == 0

    record = json.loads(next(tmp_path.glob("workload-*.json")).read_text())
    assert record["prefill"] == "modeled"
    results = record["results"]
    assert results[0]["backend"] == "kvpool lru"
    for result in results:
        assert result["requests"] == 24  # 6 users x 4 rounds
        assert result["wrong_chunks"] == 0
        assert result["pool_hit_tokens"] > 0
        assert result["engines_with_pool_hits"] == 2
        assert 0 < result["used_bytes"] <= result["capacity_bytes"]
        assert result["evictions"] > 0  # the bound bit: a working set twice the capacity went through
        assert result["bytes_loaded"] > 0 and result["bytes_stored"] > 0
    out = capsys.readouterr().out
    assert "| backend" in out and "TTFT ms (modeled)" in out
    assert out.count("| kvpool lru ") >= 2  # the run's line, then the table


def run_spec(tokens: list[tuple[int, ...]]) -> RunSpec:
    return RunSpec.make(
        backend="kvpool",
        eviction="lru",
        trace="multi-round",
        capacity=0.5,
        working_set_chunks=10,
        preset=(2, 2, 64),
        engines=2,
        local_fraction=0.05,
        prefill_tokens_per_s=1000.0,
        trace_tokens=tokens,
    )


def served(request: int, local: int, pool: int, spent_s: float) -> Served:
    return Served(request, 4, local, pool, 0, 0, spent_s, 0.0, 0.0, pool * 100, (4 - local - pool) * 100)


def test_summary_counts_hit_tokens_per_tier_and_models_ttft_from_load_time_and_missed_tokens() -> None:
    tokens = [(256, 256, 256, 64), (256, 256, 256, 256)]
    run = run_spec(tokens)
    # request 0: 1 local + 2 pool chunks of 256, its 64-token tail recomputed; request 1: nothing found
    summary = workload.summarize(run, [(0, served(0, 1, 2, 0.010)), (1, served(1, 0, 0, 0.002))], 1.0)
    assert summary["tokens"] == 832 + 1024
    assert summary["local_hit_tokens"] == 256
    assert summary["pool_hit_tokens"] == 512
    assert summary["engines_with_pool_hits"] == 1
    # modeled TTFT: load time + missed tokens at 1,000 tokens/s; no cache: every token at that rate
    assert summary["ttft_ms_mean"] == pytest.approx((10 + 64 + 2 + 1024) / 2)
    assert summary["no_cache_ttft_ms_mean"] == pytest.approx((832 + 1024) / 2)
    assert summary["bytes_loaded"] == 200 and summary["bytes_stored"] == 100 + 400


def test_capacity_is_a_fraction_of_the_working_set_in_whole_chunks() -> None:
    run = run_spec([(256,) * 3])
    chunk = 2 * 2 * 256 * 2 * 64 * 2
    assert run.capacity_bytes == 5 * chunk
    assert run.label == "kvpool lru"
