"""A node restarted over many NVMe chunk files serves at once and indexes them in the background.

The files are written as a node writes them but without fsync, by ``bench.scale.nvme.write_files``
(16-byte payloads); Redis holds nothing of them. Under ``KVPOOL_FULL=1`` (``make faults``) 200,000 of
them, against the bars issue #34 sets for 10^6 (first hit within 10 s, all indexed within 120 s; the
10^6 figures are ``python -m bench.scale.nvme --only restart --chunks 1000000``); else 5,000.
"""

from __future__ import annotations

import os
import random
import time

from bench.scale.nvme import chunk_key, payload_of, write_files
from kvpool import PoolConfig, SyncPoolClient
from tests.support.recovery import wait_recovered
from tests.support.waits import wait_until

FULL = bool(os.environ.get("KVPOOL_FULL"))
FILES = 200_000 if FULL else 5_000
SAMPLE = 1000
READY_S = 5.0  # serving: recovery goes on behind it (before, the whole scan and its publication came first)
FIRST_HIT_S = 10.0
ALL_INDEXED_S = 120.0


def test_a_node_restarted_over_many_nvme_files_serves_at_once_and_indexes_them_all_in_the_background(
    node_factory, pool_url, tmp_path
):
    root = tmp_path / "nvme"
    write_files(root, FILES, 16)
    (root / "node_id").write_text("restarted\n")
    sample = {chunk_key(i): payload_of(i, 16) for i in random.Random(3).sample(range(FILES), SAMPLE)}
    spawned = time.monotonic()
    node = node_factory("--nvme-dir", str(root), "--nvme", "8GiB", dram="64MiB")
    ready_s = time.monotonic() - spawned
    assert node.node_id == "restarted" and ready_s < READY_S

    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:

        def hits() -> int:
            got = client.get(list(sample))
            assert all(g is None or bytes(g.data) == sample[k] for k, g in zip(sample, got, strict=True))
            return sum(g is not None for g in got)

        assert wait_until(lambda: hits() > 0, FIRST_HIT_S - (time.monotonic() - spawned), 0.02), node.tail()
        assert wait_recovered(client, ALL_INDEXED_S - (time.monotonic() - spawned)), node.tail()
        assert hits() == SAMPLE
        report = client.node_stats(client.nodes()[0])["recovery"]
    assert (report["files"], report["indexed"], report["progress"]) == (FILES, FILES, 1.0)
    assert f"recovered {FILES} NVMe chunks" in node.log
