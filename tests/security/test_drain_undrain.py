"""A misconfigured operator: `kvpool undrain` while `kvpool drain` runs stops the drain.

Before, undrain cleared the mark and the running drain went on moving every chunk off a
node that placement was sending writes to again. Now the drain sees its mark gone before
its next batch and stops, every chunk either moved whole or still on the node. A real
drain in another process against two real nodes; what is promised: docs/operations.md,
"Take a node out: drain".
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

from backend.metadata import MetadataStore
from kvpool import Chunk, PoolConfig, SyncPoolClient
from tests.conftest import REPO
from tests.support.cli import kvpool
from tests.support.waits import wait_until

KIB = 1024


def _draining(url: str) -> dict[str, bool]:
    async def read() -> dict[str, bool]:
        config = PoolConfig.from_url(url)
        store = MetadataStore(config.redis_url, config.namespace)
        try:
            return {n.node_id: n.draining for n in await store.registry.nodes()}
        finally:
            await store.close()

    return asyncio.run(read())


def test_undrain_stops_a_running_drain_which_leaves_every_chunk_whole_and_says_why(node_factory, pool_url):
    a, b = node_factory(dram="64MiB"), node_factory(dram="64MiB")
    url = pool_url + "?connect_timeout_s=10&progress_timeout_s=10"
    rng = random.Random(7)
    chunks = [Chunk(f"undrain@1@0@{i}@bfloat16", rng.randbytes(64 * KIB)) for i in range(300)]
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        node_a = next(n for n in client.nodes() if n.node_id == a.node_id)
        on_a = int(client.node_stats(node_a)["objects"])
        assert on_a > 50
        drain = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "drain", a.node_id, "--url", url, "--batch", "1"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert wait_until(lambda: int(client.node_stats(node_a)["objects"]) < on_a - 10, 30.0, 0.02)
            # Hold the drain mid-batch (its put waits on the frozen target) so undrain surely finds it running.
            b.pause()
            try:
                undrained = kvpool("undrain", a.node_id, "--url", url)
            finally:
                b.resume()
            assert undrained.returncode == 0, undrained.stderr
            assert "a drain still running on it stops" in undrained.stdout
            out, err = drain.communicate(timeout=60)
        finally:
            if drain.poll() is None:
                drain.kill()
                drain.wait(10)
        assert drain.returncode == 1, (out, err)
        assert f"the drain of {a.node_id} was stopped by `kvpool undrain {a.node_id}`" in err
        assert "drained" not in out
        left = int(client.node_stats(node_a)["objects"])
        assert 0 < left < on_a - 10, (left, on_a)  # it stopped mid-way, not at the end
        assert _draining(url)[a.node_id] is False
        # Nothing half-moved: every chunk reads back byte-identical, from a or from b.
        got = client.get([c.key for c in chunks])
        assert [bytes(g.data) if g is not None else None for g in got] == [bytes(c.data) for c in chunks]
        assert int(client.node_stats(node_a)["objects"]) == left  # the drain is over: nothing more leaves a
        client.put([Chunk(f"after@1@0@{i}@bfloat16", b"x" * 1000) for i in range(40)])
        assert int(client.node_stats(node_a)["objects"]) > left  # placement sends a writes again
