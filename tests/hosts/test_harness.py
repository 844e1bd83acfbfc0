"""The harness across hosts (``python -m bench.harness.run --hosts``) in its smallest run, so that it cannot rot.

One condition (0.2 ms of added RTT through the delay proxies), 16 KiB chunks, batch 8,
one round: every backend runs on its hosts, reads back every chunk byte for byte, and
the results file has the figures, the ratios and the path's ceilings that the docs
describe. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.hosts.bed import missing
from bench.hosts.harness import BACKENDS
from tests.conftest import REPO

HARNESS_TIMEOUT_S = 90


@pytest.mark.usefixtures("processes")
def test_hosts_harness_runs_every_backend_across_hosts_and_reads_back_every_byte(tmp_path):
    reason = missing()
    if reason:
        pytest.fail(f"host bed unavailable: {reason}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.harness.run",
            "--hosts",
            "--smoke",
            "--rtts",
            "0.2",
            "--no-rate",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=HARNESS_TIMEOUT_S,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(tmp_path.glob("hosts-*.json"))
    assert proc.returncode == 0 and len(files) == 1, tail
    run = json.loads(files[0].read_text())
    assert run["ok"] is True and run["failures"] == []
    (condition,) = run["conditions"]
    assert condition["condition"] == {"name": "rtt 0.2 ms", "rtt_ms": 0.2, "rate_gbit": None}
    assert list(condition["backends"]) == list(BACKENDS)
    for name, backend in condition["backends"].items():
        assert backend["status"] == "ok", (name, backend["errors"])
        (cell,) = backend["cells"]
        assert cell["chunks_read"] == cell["batch"] * cell["calls"] == 8 * cell["calls"] > 0
        assert cell["misses"] == 0 and cell["mismatches"] == 0, (name, cell)
        assert cell["get_gbps"] > 0 and cell["put_gbps"] > 0
    assert condition["backends"]["kvpool"]["nodes"] == 2 and condition["backends"]["kvpool-1node"]["nodes"] == 1
    for name in ("kvpool", "kvpool-1node"):  # filled before the cell, so that its puts evicted
        (fill,) = condition["backends"][name]["fills"]
        assert fill["dram_capacity_bytes"] - fill["dram_used_bytes"] < fill["chunk_bytes"]
    assert {r["pool"] for r in condition["ratios"]} == {"kvpool", "kvpool-1node"}
    for r in condition["ratios"]:
        assert r["get_best_peer"] in ("lm", "resp") and r["get_vs_best_peer"] > 0 and r["put_vs_redis"] > 0
    ceilings = condition["ceilings"]
    assert ceilings["stream_gbps"] > 0 and ceilings["proxied_stream_gbps"] > 0
    assert ceilings["proxied_rtt_ms"] >= 0.2  # the proxy's delay is in the path: 0.1 ms each way
    assert "| rtt 0.2 ms | 16KiB | kvpool | 2 |" in proc.stdout
