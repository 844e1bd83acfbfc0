"""The benchmark harness: a real ``--quick --smoke --rounds 2`` run, its round-trip counter, its tables.

No timing is asserted: these prove that every backend the harness drove gave back
exactly the bytes it stored in every round, that the results file has what the docs
describe (medians beside each round's figures, and kvpool's puts evicting from a full
pool), that the targets are computed as the docs define them, and that the Redis
round-trip counter counts round trips, not commands.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest
import redis
import torch

from backend.embedded import EmbeddedRedis
from bench.harness import report
from bench.harness.cells import base_bytes, byte_view, identical, stamp
from bench.harness.peers import PEER_NAMES
from bench.harness.plan import SMOKE_SHAPES
from bench.harness.resp_proxy import CountingProxy, RespCounter
from bench.harness.rounds import combine_cells
from bench.harness.run import parse_args
from tests.conftest import REPO

HARNESS_TIMEOUT_S = 150
SMOKE_ROUNDS = 2
CELL_FIELDS = {
    "chunk",
    "chunk_bytes",
    "shape",
    "batch",
    "clients",
    "rounds",
    "calls",
    "chunks_read",
    "misses",
    "mismatches",
    "errors",
    "put_gbps",
    "get_gbps",
    "put_ms",
    "get_ms",
    "put_vs_ceiling",
    "get_vs_ceiling",
    "put_vs_redis",
    "get_vs_redis",
    "get_p99_vs_redis",
    "per_round",
}
ROUND_FIELDS = {"round", "chunks_read", "misses", "mismatches", "errors", "put_gbps", "get_gbps", "put_ms", "get_ms"}
REDIS_BACKED = ("kvpool", "kvpool-shm", "redis", "resp")
KVPOOL = ("kvpool", "kvpool-shm")


@pytest.fixture(scope="module")
def smoke_run(
    processes: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path_factory.mktemp("bench-results")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.harness.run",
            "--quick",
            "--smoke",
            "--rounds",
            str(SMOKE_ROUNDS),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=HARNESS_TIMEOUT_S,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    files = sorted(out.glob("harness-*.json"))
    assert len(files) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(files[0].read_text())


@pytest.mark.slow
def test_quick_smoke_run_reads_back_every_chunk_byte_identical(smoke_run):
    proc, run = smoke_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert run["ok"] is True and run["failures"] == []
    ran = [name for name, b in run["backends"].items() if b["status"] != "skipped"]
    assert set(ran) >= {"kvpool", "kvpool-shm", "redis", "resp", "lm", "fs"}
    for name in ran:
        backend = run["backends"][name]
        assert backend["status"] == "ok", (name, backend.get("errors"))
        assert backend["cells"], name
        for cell in backend["cells"]:
            assert cell["errors"] == [], (name, cell)
            assert cell["rounds"] == cell["rounds_measured"] == SMOKE_ROUNDS
            assert cell["chunks_read"] == cell["batch"] * cell["clients"] * cell["calls"] * SMOKE_ROUNDS > 0
            assert cell["misses"] == 0 and cell["mismatches"] == 0, (name, cell)
            for r in cell["per_round"]:  # the byte checks ran in every round, not only in one
                assert r["chunks_read"] == cell["batch"] * cell["clients"] * cell["calls"]
                assert r["misses"] == 0 and r["mismatches"] == 0, (name, r)


@pytest.mark.slow
def test_quick_smoke_cells_report_the_median_of_each_rounds_figures(smoke_run):
    _, run = smoke_run
    assert run["plan"]["rounds"] == SMOKE_ROUNDS
    for name, backend in run["backends"].items():
        for cell in backend.get("cells", []):
            assert [r["round"] for r in cell["per_round"]] == list(range(1, SMOKE_ROUNDS + 1)), name
            for r in cell["per_round"]:
                assert ROUND_FIELDS <= set(r), (name, ROUND_FIELDS - set(r))
            for rate in ("put_gbps", "get_gbps"):
                assert cell[rate] == pytest.approx(statistics.median(r[rate] for r in cell["per_round"]))
            for op in ("put_ms", "get_ms"):
                for q in ("p50", "p99"):
                    assert cell[op][q] == pytest.approx(statistics.median(r[op][q] for r in cell["per_round"]))
    per_round = run["ceilings"]["per_round"]
    assert len(per_round) == SMOKE_ROUNDS
    assert run["ceilings"]["tcp_loopback_gbps"] == max(r["tcp_loopback_gbps"] for r in per_round)


@pytest.mark.slow
def test_quick_smoke_kvpool_puts_evict_from_a_pool_filled_before_each_round(smoke_run):
    _, run = smoke_run
    dram_bytes = run["plan"]["kvpool_dram_bytes"]
    for name in KVPOOL:
        backend = run["backends"][name]
        assert [f["round"] for f in backend["fills"]] == list(range(1, SMOKE_ROUNDS + 1))  # one chunk size
        for fill in backend["fills"]:
            assert fill["dram_capacity_bytes"] == dram_bytes
            assert fill["dram_capacity_bytes"] - fill["dram_used_bytes"] < fill["chunk_bytes"]
            assert fill["filler_chunks"] * fill["chunk_bytes"] > dram_bytes  # fillers alone overflow DRAM
        for cell in backend["cells"]:
            for r in cell["per_round"]:
                assert r["chunks_put"] == cell["batch"] * cell["clients"] * cell["calls"]
                assert r["evictions"] >= r["chunks_put"] > 0, (name, r)  # every measured put evicted
            # the cell's own chunks were not among the evicted: every get hit, byte for byte
            assert cell["misses"] == 0 and cell["mismatches"] == 0


@pytest.mark.slow
def test_quick_smoke_results_file_has_every_documented_field(smoke_run):
    _, run = smoke_run
    assert {
        "harness",
        "started",
        "command",
        "plan",
        "machine",
        "ceilings",
        "backends",
        "targets",
        "failures",
        "ok",
    } <= set(run)
    assert "--quick --smoke" in run["command"]
    assert run["plan"]["mode"] == "quick" and run["plan"]["smoke"] is True
    assert run["ceilings"]["memcpy_gbps"] > 0 and run["ceilings"]["tcp_loopback_gbps"] > 0
    assert set(run["backends"]) == set(PEER_NAMES)
    for name, backend in run["backends"].items():
        if backend["status"] == "skipped":
            assert backend["reason"], name  # the one line saying why
            continue
        assert backend["ceiling"] in {"tcp_loopback", "memcpy"}
        for cell in backend["cells"]:
            assert CELL_FIELDS <= set(cell), (name, CELL_FIELDS - set(cell))
            assert cell["shape"][0] == 2 and cell["shape"][2] == 256
            assert cell["chunk_bytes"] == 2 * cell["shape"][1] * 256 * cell["shape"][3] * 2  # bf16
            assert {"p50", "p99", "n"} <= set(cell["get_ms"]) and cell["get_ms"]["n"] == cell["calls"] * cell["clients"]
        lookup = backend["lookup"]
        assert lookup["hit_prefix"] == lookup["keys"] == run["plan"]["lookup_keys"]
        assert {"p50", "p99", "n"} <= set(lookup["ms"])
        if name in REDIS_BACKED:
            assert lookup["redis_round_trips"] >= 1 and lookup["redis_commands"] >= 1
            assert lookup["proxied_hit_prefix"] == lookup["keys"]
    redis_cells = run["backends"]["redis"]["cells"]
    assert all(cell["get_vs_redis"] == pytest.approx(1.0) for cell in redis_cells)
    assert {t["target"] for t in run["targets"]} and all("met" in t for t in run["targets"])
    for name in KVPOOL:
        assert run["backends"][name]["ceiling"] == {"kvpool": "tcp_loopback", "kvpool-shm": "memcpy"}[name]


def _cell(chunk: str, put: float, get: float, put_p50: float = 10.0, put_p99: float = 15.0) -> dict:
    return {
        "chunk": chunk,
        "batch": 8,
        "clients": 1,
        "put_gbps": put,
        "get_gbps": get,
        "put_ms": {"p50": put_p50, "p99": put_p99},
    }


def test_targets_compare_kvpool_with_the_best_peer_and_the_ceiling_of_its_path():
    results = {
        "kvpool": {"cells": [_cell("4MiB", put=2.0, get=3.0)], "lookup": {"keys": 1000, "redis_round_trips": 1}},
        "kvpool-shm": {"cells": [_cell("4MiB", put=2.6, get=6.0, put_p50=10.0, put_p99=25.0)]},
        "redis": {"cells": [_cell("4MiB", put=1.0, get=0.5)]},
        "resp": {"cells": [_cell("4MiB", put=1.4, get=2.2)]},
        "lm": {"cells": [_cell("4MiB", put=1.2, get=2.5)]},
        "fs": {"cells": [_cell("4MiB", put=2.0, get=4.0)]},
        "mooncake": {"status": "skipped"},
    }
    rows = report.targets(results, {"tcp_loopback_gbps": 4.0, "memcpy_gbps": 10.0})
    at_4mib = {t["target"]: t for t in rows if t["chunk"] == "4MiB"}
    expected = {  # target: (measured ratio, met)
        "kvpool get vs best of lm:// and resp://": (3.0 / 2.5, True),
        "kvpool get vs TCP loopback ceiling": (3.0 / 4.0, False),
        "kvpool-shm get vs fs://": (6.0 / 4.0, True),
        "kvpool-shm get vs memcpy ceiling": (6.0 / 10.0, True),
        "kvpool put (full pool) vs best network peer": (2.0 / 1.4, True),  # fs:// is not a network peer
        "kvpool put p99 vs its p50 (full pool)": (1.5, True),
        "kvpool-shm put (full pool) vs best peer, fs:// included": (2.6 / 2.0, True),
        "kvpool-shm put p99 vs its p50 (full pool)": (2.5, False),
    }
    assert set(at_4mib) == set(expected)
    for name, (ratio, met) in expected.items():
        assert at_4mib[name]["value"] == pytest.approx(ratio), name
        assert at_4mib[name]["met"] is met, name
    assert at_4mib["kvpool get vs best of lm:// and resp://"]["against"] == "lm:// 2.50 GB/s"
    assert {t["met"] for t in rows if t["chunk"] == "32MiB"} == {None}  # not measured: not met, not missed
    (lookup,) = [t for t in rows if t["chunk"] is None]
    assert lookup["value"] == 1 and lookup["met"] is True
    results["kvpool"]["lookup"]["redis_round_trips"] = 0  # exactly one: fewer means nothing was looked up
    assert [t["met"] for t in report.targets(results, {}) if t["chunk"] is None] == [False]


def test_rounds_combine_into_medians_and_any_rounds_miss_fails_the_cell():
    def one_round(round_no: int, put: float, misses: int = 0) -> dict:
        return {
            "round": round_no,
            "chunk": "4MiB",
            "chunk_bytes": 4 << 20,
            "shape": [2, 4, 256, 1024],
            "batch": 8,
            "clients": 1,
            "calls": 4,
            "chunks_read": 32,
            "misses": misses,
            "mismatches": 0,
            "errors": [],
            "put_gbps": put,
            "get_gbps": 2 * put,
            "put_ms": {"p50": put, "p99": 3 * put, "n": 4},
            "get_ms": {"p50": put, "p99": put, "n": 4},
            "evictions": 32,
            "chunks_put": 32,
        }

    (cell,) = combine_cells([one_round(1, 5.0), one_round(2, 1.0, misses=1), one_round(3, 2.0)])
    assert cell["rounds"] == 3 and [r["round"] for r in cell["per_round"]] == [1, 2, 3]
    assert cell["put_gbps"] == 2.0 and cell["get_gbps"] == 4.0 and cell["put_ms"]["p99"] == 6.0
    assert cell["misses"] == 1 and cell["chunks_read"] == 96 and cell["evictions"] == 96
    assert "chunk" not in cell["per_round"][0] and cell["per_round"][1]["put_gbps"] == 1.0


def test_targets_mode_is_the_targets_measurement_and_refuses_to_be_narrowed():
    _, plan = parse_args(["--targets"])
    assert (list(plan.shapes), plan.batches, plan.clients, plan.rounds) == (["4MiB", "32MiB"], (8,), (1,), 3)
    assert plan.kvpool_dram_bytes() >= 2 * plan.largest_cell_bytes()
    _, plan = parse_args(["--chunks", "4MiB", "--batches", "8", "--clients", "1", "--rounds", "2"])
    assert (list(plan.shapes), plan.batches, plan.clients, plan.rounds) == (["4MiB"], (8,), (1,), 2)
    for argv in (
        ["--targets", "--chunks", "4MiB"],
        ["--targets", "--rounds", "2"],
        ["--chunks", "1GiB"],
        ["--smoke", "--chunks", "4MiB"],
        ["--batches", "0"],
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_resp_counter_counts_values_split_at_every_byte():
    stream = (
        b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"  # a command
        b"$-1\r\n+OK\r\n:12\r\n"  # nil, simple string, integer
        b"*2\r\n*1\r\n$2\r\nab\r\n%1\r\n+f\r\n$0\r\n\r\n"  # nested array and map
        b"$5\r\na\r\nbc\r\n"
    )  # a bulk string holding CRLF
    whole = RespCounter()
    assert whole.feed(stream) == 6
    piecewise = RespCounter()
    for i in range(len(stream)):
        piecewise.feed(stream[i : i + 1])
    assert piecewise.count == 6 and piecewise.between_values


@pytest.mark.usefixtures("processes")
def test_proxy_counts_a_pipeline_as_one_round_trip_and_sequential_commands_one_each():
    with EmbeddedRedis() as server, CountingProxy(server.port) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=10)
        try:
            client.ping()
            before = proxy.counts()
            pipe = client.pipeline(transaction=False)
            for i in range(1000):  # about 60 KB: sent in several pieces
                pipe.hgetall(f"kvpool:test:index:{i:06d}:" + "x" * 32)
            assert pipe.execute() == [{}] * 1000
            after_pipeline = proxy.counts()
            for i in range(20):
                client.exists(f"key-{i}")
            after_sequential = proxy.counts()
        finally:
            client.close()
    assert after_pipeline["requests"] - before["requests"] == 1000
    assert after_pipeline["round_trips"] - before["round_trips"] == 1
    assert after_sequential["round_trips"] - after_pipeline["round_trips"] == 20


def test_byte_check_catches_one_flipped_byte_and_a_chunk_read_under_another_key():
    base = base_bytes(SMOKE_SHAPES["16KiB"])
    chunk = SimpleNamespace(tensor=base.clone().view(torch.bfloat16))
    stamp(chunk, 7)
    assert identical(chunk, base, 7)
    assert not identical(chunk, base, 8)  # the right bytes under the wrong key
    byte_view(chunk)[base.numel() // 2] ^= 1
    assert not identical(chunk, base, 7)


@pytest.mark.usefixtures("processes")
def test_get_budget_reads_through_the_arena_and_over_tcp_and_accounts_for_each_millisecond(tmp_path):
    out = tmp_path / "budget.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.harness.profile_get",
            "--chunk-mib",
            "1",
            "--batch",
            "2",
            "--rounds",
            "3",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HARNESS_TIMEOUT_S,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "one thread copy" in proc.stdout and "tcp loopback batch" in proc.stdout
    report = json.loads(out.read_text())
    assert list(report["paths"]) == ["same-host arena", "TCP"]
    for path, result in report["paths"].items():
        rows = dict(result["budget_ms"])
        lookup = (
            "  lookup (one Redis round trip), all of it"
            if path == "same-host arena"
            else "lookup (one Redis round trip)"
        )
        assert rows[lookup] > 0, path
        # the phases a get runs one after the other add up to its total
        sequential = [ms for phase, ms in result["budget_ms"] if not phase.startswith(" ")]
        assert sum(sequential[:-1]) == pytest.approx(sequential[-1]), path
    arena = dict(report["paths"]["same-host arena"]["budget_ms"])
    assert arena["LEASE round trip (the node answers offsets)"] > 0  # it copied out of the mapping (it raises if not)
    tcp = dict(report["paths"]["TCP"]["budget_ms"])
    assert tcp["  per stripe, summed: receive + checksum (wall)"] > 0


def test_lookups_mode_looks_up_a_stored_prefix_a_half_one_and_misses_and_refuses_transfer_flags():
    from bench.harness.lookups import LOOKUP_BACKENDS, cell_keys

    stored, absent = [f"s{i}" for i in range(1000)], [f"a{i}" for i in range(1000)]
    assert cell_keys(stored, absent, 128, "hit") == (stored[:128], 128)
    assert cell_keys(stored, absent, 16, "half") == (stored[:8] + absent[:8], 8)
    assert cell_keys(stored, absent, 1000, "miss") == (absent, 0)
    args, _ = parse_args(["--lookups"])
    assert args.lookups and args.backends == list(LOOKUP_BACKENDS)
    with pytest.raises(SystemExit):
        parse_args(["--lookups", "--quick"])


def test_first_hour_summary_is_the_median_node_per_round_and_the_first_over_last_round():
    from bench.scale.first_hour import render, summarize

    def node(first: float, last: float) -> dict:
        rounds = [
            {"shm_put_gbps": first, "tcp_get_gbps": 2.0},
            {"shm_put_gbps": 1.0, "tcp_get_gbps": 2.0},
            {"shm_put_gbps": last, "tcp_get_gbps": 4.0},
        ]
        return {"rounds": rounds, "start_s": 1.0, "prefault": "", "misses": 0, "mismatches": 0}

    nodes = [node(0.2, 1.0), node(0.4, 2.0), node(9.0, 2.0)]  # one outlier node
    latencies = [{"p50_ms": 10.0, "p99_ms": 30.0}, {"p50_ms": 12.0, "p99_ms": 600.0}, {"p50_ms": 8.0, "p99_ms": 20.0}]
    summary = summarize(nodes, latencies)
    assert summary["per_round"][0]["shm_put_gbps"] == 0.4 and summary["per_round"][2]["shm_put_gbps"] == 2.0
    assert summary["first_over_last"] == {"shm_put_gbps": 0.2, "tcp_get_gbps": 0.5}
    assert (summary["put_p50_ms"], summary["put_p99_ms"], summary["put_p99_over_p50"]) == (10.0, 30.0, 3.0)
    assert "r1/r3" in render("on", summary) and "p99/p50 3.00" in render("on", summary)


@pytest.mark.usefixtures("processes")
def test_importing_a_bench_module_changes_no_environment_variable():
    """A module that sets os.environ as it is imported leaks into every process its importer starts later.

    (A test worker that imported the replay's engine module once gave every later ``kvpool doctor``
    LMCACHE_LOG_LEVEL=ERROR, and LMCache's config dump vanished from its output.) Set a child's
    environment where the child is started instead. In a fresh interpreter: one that imported a
    module already would not run its top level again.
    """
    modules = sorted(f"bench.{p.stem}" for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, json, os, sys\nbefore = dict(os.environ)\nchanged = {}\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    keys = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
        "    if keys:\n        changed[name] = keys\n        before = dict(os.environ)\n"
        "print(json.dumps(changed))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_LOG")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}
