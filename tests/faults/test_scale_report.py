"""``python -m bench.scale.pool --report``: the scale benches composed, one summary of every budget of issue #34.

Run at the fewest chunks its node part can measure with (20,000), so the figures' values say little
(at that size a target may be met or missed): what is checked is that every figure is measured,
printed beside its target with a verdict, and written to the JSON beside the benches' own figures.
``make test`` runs the node and Redis parts (about 20 s); ``make faults`` (``KVPOOL_FULL=1``) every
part (about 90 s on two shared cores: the sweep part alone starts a node, four CLI runs and 1,200 lookups).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.faults.proxy import FULL

CHUNKS = 20_000
PARTS = ("node", "nvme", "disk", "redis", "sweep") if FULL else ("node", "redis")
# Every row of the summary, in the order printed: (part, name in the JSON, words of its printed label).
ROWS = (
    ("node", "fill_chunks_per_s", "fill: 20,000 chunks"),
    ("node", "node_bookkeeping_bytes_per_chunk", "node bookkeeping per chunk"),
    ("node", "nvme_record_bytes_per_chunk", "NVMe file's record"),
    ("redis", "redis_inprocess_bytes_beyond_key", "beyond key, in-process"),
    ("redis", "redis_layerwise_bytes_beyond_key", "beyond key, layerwise"),
    ("nvme", "republish_sample_99_s", "FLUSHALL at 20,000: 99 %"),
    ("nvme", "second_flush_sample_99_s", "second FLUSHALL mid-republish"),
    ("nvme", "heartbeat_lapsed", "heartbeat during both republishes"),
    ("nvme", "restart_first_hit_s", "restart over 20,000 NVMe files: first hit"),
    ("nvme", "restart_all_indexed_s", "restart: all indexed"),
    ("disk", "disk_scan_s", "scan of 20,000 chunks at start"),
    ("sweep", "sweep_walk_s", "sweep of a dead 20,000-chunk node"),
    ("sweep", "sweep_slowest_redis_call_ms", "sweep: slowest Redis call"),
    ("sweep", "admin_slowest_redis_call_ms", "stats, status at 20,000 keys: slowest call"),
    ("sweep", "stats_wall_s", "kvpool stats at 20,000 keys: wall time"),
    ("sweep", "status_wall_s", "kvpool status at 20,000 keys: wall time"),
    ("sweep", "lookup_together_p50_ratio", "lookup of 1,000 (keys stored together)"),
    ("sweep", "lookup_random_p50_ratio", "lookup of 1,000 (keys at random)"),
    ("node", "put_evicting_p50_ratio", "put of 16 that evicts"),
    ("node", "exists_p50_ratio", "EXISTS_BATCH of 1,000"),
    ("node", "get_p50_ratio", "GET_BATCH of 1,000"),
)
UNTARGETED = {"fill_chunks_per_s", "disk_scan_s", "stats_wall_s", "status_wall_s"}
HOW = {"nvme": "without fsync", "disk": "without fsync", "sweep": "index written directly", "node": "put path"}


def _scale(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.scale.pool", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout_s
    )


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(400 if FULL else 200)
def test_the_scale_report_prints_every_figure_beside_its_target_and_writes_them(tmp_path):
    parts = ",".join(PARTS)
    out = _scale("--report", "--chunks", str(CHUNKS), "--parts", parts, "--results", str(tmp_path), timeout_s=380)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    expected = [(name, words) for part, name, words in ROWS if part in PARTS]
    at = out.stdout.index(f"scale report at {CHUNKS:,} chunks")
    summary = out.stdout[at:]
    lines = summary.splitlines()
    table = lines[2 : next(i for i, line in enumerate(lines) if "targets missed" in line)]
    assert len(table) == len(expected), "\n".join(table)
    for (name, words), line in zip(expected, table):  # every row, in the order
        assert words in line, f"{name}: {line}"
        verdict = line.split()[-1]
        assert (verdict in ("ok", "MISSED")) == (name not in UNTARGETED), f"{name}: {line}"
    for part in PARTS:
        assert HOW.get(part, "") in summary.split("how the figures were made:")[1], part
    assert "python -m bench.scale.sweep --chunks 10000000 --parts admin" in summary
    # the benches' own detailed output came first
    assert 0 < out.stdout.index("node memory and eviction at 20,000 chunks") < at

    (path,) = tmp_path.glob("scale-report-*.json")
    record = json.loads(path.read_text())
    assert record["chunks"] == CHUNKS and record["parts"] == list(PARTS)
    assert record["nvme_files_fsync"] is False and record["index_written"]["sweep"] == "directly"
    rows = {row["name"]: row for row in record["summary"]}
    assert list(rows) == [name for name, _ in expected]
    for name, row in rows.items():
        assert isinstance(row["value"], (int, float)), (name, row)  # a bool is an int: the heartbeat's lapse
        assert (row["ok"] is None) == (name in UNTARGETED) == (row["target"] == ""), (name, row)
    results = record["results"]
    assert results["node"]["node"]["chunks"] == CHUNKS and results["node"]["nvme_records"]["records"] == CHUNKS
    assert rows["node_bookkeeping_bytes_per_chunk"]["value"] == round(
        results["node"]["node"]["overhead_per_chunk_bytes"], 1
    )
    assert {case["chunks"] for case in results["redis"].values()} == {CHUNKS}
    assert rows["redis_layerwise_bytes_beyond_key"]["value"] == results["redis"]["layerwise/1copy"]["beyond_key"]
    if FULL:
        assert results["nvme"]["republish"]["chunks"] == CHUNKS
        assert results["nvme"]["restart"]["recovered_files"] == CHUNKS
        assert results["disk"]["disk"]["files"]["files_made"] >= CHUNKS
        assert results["sweep"]["sweep"]["fields_removed"] >= CHUNKS
        assert results["sweep"]["lookup"][f"at_{CHUNKS}"]["together_p50_ms"] > 0


@pytest.mark.usefixtures("processes")
def test_the_report_names_the_fewest_chunks_a_part_needs():
    out = _scale("--report", "--chunks", "5000", timeout_s=60)
    assert out.returncode == 2
    assert "--chunks 5,000 is too few for the node part: it needs at least 20,000" in out.stderr
    out = _scale("--report", "--chunks", "5000", "--parts", "nvme,bogus", timeout_s=60)
    assert out.returncode == 2 and "choose from node,nvme,disk,redis,sweep" in out.stderr
    out = _scale("--chunks", "5000", timeout_s=60)  # the scale-out bench takes no --chunks
    assert out.returncode == 2 and "go with --report" in out.stderr
