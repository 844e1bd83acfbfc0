"""The NVMe tier's recovery at start runs in the background: the node serves at once, recovered keys become
hits as they are indexed, and what the node does meanwhile (a put, a delete, a write of its own) wins over
the older files it finds.

A node here runs in this process, over files written as a previous run of it left them (its chunk files,
without fsync, dated an hour back, and its index entries under an older epoch). One shard directory is held
back (a slow disk, injected by wrapping ``scan_shard``) so that what happens while recovery runs can be
done before it reaches that directory, every time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from pathlib import Path

import pytest

from backend.config import NodeConfig
from backend.metadata import Location, MetadataStore
from backend.node.index import recovery
from backend.node.server import PoolNode
from backend.node.store.nvme_format import CHUNKS_DIR, TMP_SUFFIX, chunk_name, chunk_path, write_chunk
from backend.protocol import ItemMeta, checksum
from kvpool import Chunk, PoolClient, PoolConfig
from tests.support.waits import until

FILES = 600
HELD_BACK = "ff"  # the shard directory recovery reaches last
NODE_ID = "rec-node"
OLD_EPOCH = 1


def _previous_run(root: Path, count: int) -> dict[str, bytes]:
    """Chunk files as an earlier run left them (an hour old), with at least three keys in ``HELD_BACK``."""
    stored: dict[str, bytes] = {}
    i = 0
    while len(stored) < count or sum(chunk_name(k)[0] == HELD_BACK for k in stored) < 3:
        key, data = f"vllm@rec@1@0@{i:x}@bfloat16", random.Random(i).randbytes(64)
        record = write_chunk(
            root, ItemMeta(key, len(data), checksum(data), "uint8", (len(data),), 0), data, durable=False
        )
        os.utime(record.path, (time.time() - 3600, time.time() - 3600))
        stored[key] = data
        i += 1
    (root / "node_id").write_text(NODE_ID + "\n")
    return stored


class HeldBack:
    """``scan_shard`` with one shard directory held until released (a slow disk there)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.reached = threading.Event()
        scan_shard = recovery.scan_shard

        def held_back(root: Path, shard: str, written_before: float = float("inf")) -> recovery.ShardScan:
            if os.path.basename(shard) == HELD_BACK:
                self.reached.set()
                assert self.release.wait(30), "the test never released the shard"
            return scan_shard(root, shard, written_before)

        monkeypatch.setattr(recovery, "scan_shard", held_back)


async def test_a_restarted_node_serves_while_it_recovers_and_what_it_did_meanwhile_wins(
    redis_server, namespace, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="backend.node.index.recovery")
    root = tmp_path / "nvme"
    stored = _previous_run(root, FILES)
    late = [k for k in stored if chunk_name(k)[0] == HELD_BACK]
    replaced, deleted, untouched = late[0], late[1], late[2]
    early = next(k for k in stored if chunk_name(k)[0] == "00")
    # Debris of the earlier run's crash, and a write of this run in flight (a .tmp file dated now).
    (root / CHUNKS_DIR / "01").mkdir(parents=True, exist_ok=True)
    old_tmp, new_tmp = root / CHUNKS_DIR / "01" / ("old" + TMP_SUFFIX), root / CHUNKS_DIR / "01" / ("new" + TMP_SUFFIX)
    old_tmp.write_bytes(b"torn")
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))
    store = MetadataStore(redis_server.url, namespace)  # what the earlier run published is still there
    await store.index.commit([(k, Location(NODE_ID, OLD_EPOCH, "nvme", 64, checksum(v))) for k, v in stored.items()])
    held = HeldBack(monkeypatch)
    config = NodeConfig(
        redis_url=redis_server.url, namespace=namespace, dram_bytes=4 << 20, nvme_dir=root, nvme_bytes=64 << 20
    )
    node = PoolNode(config)
    await node.start()
    new_tmp.write_bytes(b"being written")  # after the start: this run's
    try:
        report = node.recovery
        assert report is not None and not report.done  # it serves before recovery is over
        async with PoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{redis_server.port}/{namespace}")) as client:
            await until(lambda: client.get([early]), lambda got: got[0] is not None)  # recovered: a hit
            assert await asyncio.to_thread(held.reached.wait, 10)
            assert (await client.get([untouched])) == [None]  # not recovered yet: a miss, never an error
            await client.put([Chunk(replaced, b"newer bytes of this run")])
            assert await client.delete([deleted]) == 1  # the earlier run's entry told the client who held it
            held.release.set()
            await until(lambda: node.recovery, lambda r: r is not None and r.done)
            got = await client.get([replaced, deleted, untouched, early])
            assert [None if g is None else bytes(g.data) for g in got] == [
                b"newer bytes of this run",  # the put of this run, not the older file
                None,  # deleted while recovery ran: not brought back
                stored[untouched],
                stored[early],
            ]
            everything = [k for k in stored if k not in (replaced, deleted)]
            got = await client.get(everything)
            assert all(g is not None and bytes(g.data) == stored[k] for k, g in zip(everything, got, strict=True))
        entries = await store.index.lookup([replaced, untouched])
        assert [(loc.epoch, loc.checksum) for loc in entries[0]] == [(node.epoch, checksum(b"newer bytes of this run"))]
        assert [loc.epoch for loc in entries[1]] == [node.epoch]
        assert not chunk_path(root, deleted).exists() and not chunk_path(root, replaced).exists()  # the older files
        assert not old_tmp.exists() and new_tmp.exists()  # crash debris removed; this run's write left alone
        report = node.recovery
        assert report is not None and (report.files, report.indexed) == (len(stored) - 2,) * 2
        assert (report.progress, report.temp_removed, report.quarantined) == (1.0, 1, 0)
        said = [r.getMessage() for r in caplog.records if r.name == "backend.node.index.recovery"]
        assert any("NVMe recovery 50 %" in line for line in said)
        assert any(f"recovered {len(stored) - 2} NVMe chunks" in line and "all indexed" in line for line in said)
    finally:
        held.release.set()
        await node.stop()
        await store.close()
