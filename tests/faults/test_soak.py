"""Load: the bounded soak (bench/scale/soak.py) run short here and for 2 minutes under ``make faults``.

32 clients, mixed put/get/contains, a working set twice the pool's DRAM: every hit
byte-identical, no errors, at most 1% of the puts refused as busy (a burst waits for
room instead), every node evicting and staying within its memory bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.scale.soak import Values, verdict
from tests.conftest import REPO

FULL = bool(os.environ.get("KVPOOL_FULL"))
DURATION_S = 120 if FULL else 12


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(DURATION_S + 240)
def test_a_soak_of_32_clients_over_twice_the_dram_returns_no_wrong_byte_and_stays_within_memory() -> None:
    cmd = [
        sys.executable,
        "-m",
        "bench.scale.soak",
        "--duration",
        str(DURATION_S),
        "--clients",
        "32",
        "--nodes",
        "2",
        "--dram",
        "32MiB",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=DURATION_S + 180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["wrong_bytes"] == 0 and figures["errors_total"] == 0
    assert figures["busy_puts"] <= 0.01 * figures["ops"]["put"], figures  # refusing everything cannot pass
    assert all(figures["ops"].get(op, 0) > 0 for op in ("put", "get", "contains"))
    assert figures["hits"] > 0 and figures["misses"] > 0  # 2x DRAM: some reads must miss
    for node in figures["nodes_detail"].values():
        assert node["alive"]
        assert node["evictions"] > 0  # the working set really did not fit
        assert node["rss_before_bytes"] < node["rss_peak_bytes"] <= node["bound_bytes"]


def test_the_soak_check_catches_a_single_wrong_byte_or_a_version_never_written() -> None:
    values = Values(4096, seed=3)
    good = bytearray(values.make(7, 2))
    assert values.check(7, good, newest=2)
    assert not values.check(7, good, newest=1)  # a version from the future
    assert not values.check(8, good, newest=2)  # another key's bytes
    good[-1] ^= 1
    assert not values.check(7, good, newest=2)


def test_the_soak_verdict_fails_on_wrong_bytes_errors_busy_puts_a_dead_node_or_memory_past_its_bound() -> None:
    node = {"alive": True, "rss_peak_bytes": 100, "bound_bytes": 100}
    clean = {
        "wrong_bytes": 0,
        "errors_total": 0,
        "errors": {},
        "nodes_detail": {"n1": node},
        "ops": {"put": 1000},
        "busy_puts": 10,
    }
    assert verdict(clean, max_errors=0) == []
    assert verdict({**clean, "busy_puts": 11}, 0) == ["11 of 1000 puts refused as busy (allowed 1%)"]
    assert verdict({**clean, "wrong_bytes": 1}, 0) == ["1 hits returned wrong bytes"]
    assert "errors" in verdict({**clean, "errors_total": 2, "errors": {"get:X": 2}}, 1)[0]
    assert verdict({**clean, "nodes_detail": {"n1": {**node, "alive": False}}}, 0) == ["node n1 died"]
    assert "over its bound" in verdict({**clean, "nodes_detail": {"n1": {**node, "rss_peak_bytes": 101}}}, 0)[0]
