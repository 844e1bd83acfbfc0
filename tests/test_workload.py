"""The workload replay (``python -m bench.workload.run``): a reduced multi-round trace through real LMCache engines.

The replay test starts kvpool and two engine processes, so it is in the process tier.
One replay of the reduced trace (``--reduced``) at half its working set, once per eviction
order the node offers, is shared by two tests: what any run of this size can honestly show
(engines hit chunks in the pool, both of them, and the trace moves users between engines
every round; no byte loaded differs from what was stored; the pool stayed within its
capacity and evicted to do so; the table is printed), and the issue's claim at this size:
``eviction=prefix`` serves clearly more of the tokens from the pool than ``eviction=lru``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from bench.workload import run as workload
from bench.workload.engine import Served
from bench.workload.runs import RunSpec

# Pool hit rate points by which prefix must beat lru on the reduced trace at 0.5. Seen on the shared 2-core
# machine, the load average 2-7 from other work: lru 14.2-15.3 % (13 replays), prefix 23.5-30.7 % (8; and
# 22.3-30.9 % in 3 more under its old name with touch=on). Prefix varies more: its touches reach the node 50 ms
# after the lookup, and how far they lag the requests varies with the load.
PREFIX_OVER_LRU_POINTS = 5.0


@pytest.fixture(scope="module")
def replayed(processes: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """The record and the printed output of one reduced multi-round replay on kvpool at 0.5, 2 engines."""
    out = tmp_path_factory.mktemp("workload")
    argv = ["--trace", "multi-round", "--engines", "2", "--capacity", "0.5", "--backends", "kvpool", "--reduced"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert workload.main([*argv, "--out", str(out)]) == 0
    return json.loads(next(out.glob("workload-*.json")).read_text()), printed.getvalue()


def test_reduced_multi_round_replay_hits_across_engines_verifies_every_byte_and_stays_in_capacity(
    replayed: tuple[dict[str, Any], str],
) -> None:
    record, out = replayed
    assert record["prefill"] == "modeled"
    results = record["results"]
    assert [r["backend"] for r in results] == ["kvpool lru", "kvpool prefix", "kvpool prefix-recency"]
    for result in results:
        assert result["requests"] == 96  # 16 users x 6 rounds
        assert result["wrong_chunks"] == 0
        assert result["pool_hit_tokens"] > 0
        assert result["engines_with_pool_hits"] == 2
        assert 0 < result["used_bytes"] <= result["capacity_bytes"]
        assert result["evictions"] > 0  # the bound bit: a working set twice the capacity went through
        assert result["bytes_loaded"] > 0 and result["bytes_stored"] > 0
    assert "| backend" in out and "TTFT ms (modeled)" in out
    assert out.count("| kvpool lru ") >= 2  # the run's line, then the table


def test_on_the_reduced_multi_round_trace_at_half_capacity_prefix_eviction_serves_more_from_the_pool_than_lru(
    replayed: tuple[dict[str, Any], str],
) -> None:
    """The issue's claim at make test's size: the most-read chains kept (and the engines' lookups told to the
    node by default, touch=auto, with nothing in their URLs) beat LRU's pool hit rate by a clear margin."""
    record, _ = replayed
    rate = {r["backend"]: 100 * r["pool_hit_tokens"] / r["tokens"] for r in record["results"]}
    assert rate["kvpool prefix"] >= rate["kvpool lru"] + PREFIX_OVER_LRU_POINTS, rate


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


def _descendants(pid: int) -> set[int]:
    """The live processes under ``pid`` (children, theirs, ...), from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.usefixtures("processes")
def test_ctrl_c_stops_the_replay_promptly_with_the_node_and_engines_it_started(tmp_path: Path) -> None:
    """SIGINT to the bench alone (not its children, as a terminal's Ctrl-C would also reach them) once its node
    runs and its engines start: it exits 130 within seconds, saying so, and no process it started is left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.support.waits import wait_until

    argv = ["--trace", "multi-round", "--engines", "2", "--capacity", "0.5", "--backends", "kvpool", "--reduced"]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench.workload.run", *argv, "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        # A terminal's Ctrl-C reaches a process whose SIGINT is handled; a shell without job control starts a
        # background command (`make test &`) with SIGINT ignored, which Python and so the bench would inherit.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    started: set[int] = set()

    def engines() -> list[int]:
        return [pid for pid in _descendants(bench.pid) if "bench.workload.engine" in _cmdline(pid)]

    try:
        assert wait_until(lambda: engines(), timeout_s=60), "no engine started"
        started = _descendants(bench.pid)
        assert any("backend.cli up" in _cmdline(p) for p in started)  # the node (and its Redis) run too
        interrupted_at = time.monotonic()
        bench.send_signal(signal.SIGINT)
        out, _ = bench.communicate(timeout=30)
        took_s = time.monotonic() - interrupted_at
        assert bench.returncode == 130, out
        assert "[workload] interrupted (Ctrl-C) after 0 run(s)" in out and "Traceback" not in out, out
        assert took_s < 15, took_s  # the engines get 3 s, the node 10 s at most; seen: about 4 s
        assert not [p for p in started if Path(f"/proc/{p}").exists() and _cmdline(p)], "processes left running"
        assert not list(tmp_path.glob("workload-*.json"))
    finally:
        for pid in _descendants(bench.pid) | started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
            bench.wait()
