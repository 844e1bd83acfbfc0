"""The benchmark harness: a real ``--quick --smoke`` run, and its round-trip counter.

No timing is asserted: these prove that every backend the harness drove gave back
exactly the bytes it stored, that the results file has what the docs describe, and
that the Redis round-trip counter counts round trips, not commands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import redis
import torch

from backend.embedded import EmbeddedRedis
from bench.harness import SMOKE_SHAPES, base_bytes, byte_view, identical, stamp
from bench.peers import PEER_NAMES
from bench.resp_proxy import CountingProxy, RespCounter
from tests.conftest import REPO

HARNESS_TIMEOUT_S = 150
CELL_FIELDS = {"chunk", "chunk_bytes", "shape", "batch", "clients", "rounds", "chunks_read", "misses", "mismatches",
               "errors", "put_gbps", "get_gbps", "put_ms", "get_ms", "put_vs_ceiling", "get_vs_ceiling",
               "put_vs_redis", "get_vs_redis", "get_p99_vs_redis"}  # fmt: skip
REDIS_BACKED = ("kvpool", "kvpool-shm", "redis", "resp")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path_factory.mktemp("bench-results")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.harness", "--quick", "--smoke", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=HARNESS_TIMEOUT_S,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )  # fmt: skip
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
            assert cell["chunks_read"] == cell["batch"] * cell["clients"] * cell["rounds"] > 0
            assert cell["misses"] == 0 and cell["mismatches"] == 0, (name, cell)


@pytest.mark.slow
def test_quick_smoke_results_file_has_every_documented_field(smoke_run):
    _, run = smoke_run
    assert {"harness", "started", "command", "plan", "machine", "ceilings", "backends", "targets", "failures",
            "ok"} <= set(run)  # fmt: skip
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
            assert {"p50", "p99", "n"} <= set(cell["get_ms"]) and cell["get_ms"]["n"] == cell["rounds"]
        lookup = backend["lookup"]
        assert lookup["hit_prefix"] == lookup["keys"] == run["plan"]["lookup_keys"]
        assert {"p50", "p99", "n"} <= set(lookup["ms"])
        if name in REDIS_BACKED:
            assert lookup["redis_round_trips"] >= 1 and lookup["redis_commands"] >= 1
            assert lookup["proxied_hit_prefix"] == lookup["keys"]
    redis_cells = run["backends"]["redis"]["cells"]
    assert all(cell["get_vs_redis"] == pytest.approx(1.0) for cell in redis_cells)
    assert {t["target"] for t in run["targets"]} and all("met" in t for t in run["targets"])


def test_resp_counter_counts_values_split_at_every_byte():
    stream = (b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"  # a command
              b"$-1\r\n+OK\r\n:12\r\n"  # nil, simple string, integer
              b"*2\r\n*1\r\n$2\r\nab\r\n%1\r\n+f\r\n$0\r\n\r\n"  # nested array and map
              b"$5\r\na\r\nbc\r\n")  # a bulk string holding CRLF  # fmt: skip
    whole = RespCounter()
    assert whole.feed(stream) == 6
    piecewise = RespCounter()
    for i in range(len(stream)):
        piecewise.feed(stream[i : i + 1])
    assert piecewise.count == 6 and piecewise.between_values


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


def test_get_budget_reads_through_the_arena_and_over_tcp_and_accounts_for_each_millisecond(tmp_path):
    out = tmp_path / "budget.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.profile_get", "--chunk-mib", "1", "--batch", "2", "--rounds", "3",
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=HARNESS_TIMEOUT_S,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "one thread copy" in proc.stdout and "tcp loopback batch" in proc.stdout
    report = json.loads(out.read_text())
    assert list(report["paths"]) == ["same-host arena", "TCP"]
    for path, result in report["paths"].items():
        rows = dict(result["budget_ms"])
        assert rows["lookup (one Redis round trip)"] > 0, path
        # the phases a get runs one after the other add up to its total
        sequential = [ms for phase, ms in result["budget_ms"] if not phase.startswith(" ")]
        assert sum(sequential[:-1]) == pytest.approx(sequential[-1]), path
    arena = dict(report["paths"]["same-host arena"]["budget_ms"])
    assert arena["LEASE round trip (the node answers offsets)"] > 0  # it copied out of the mapping (it raises if not)
    tcp = dict(report["paths"]["TCP"]["budget_ms"])
    assert tcp["  per stripe, summed: receive + checksum (wall)"] > 0
