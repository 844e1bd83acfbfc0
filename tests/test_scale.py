"""Eight node processes on one host behave as one pool: capacity, placement, join, kill, drain.

Placement weighs each node by its free capacity (``backend.placement``). In an
empty pool that is its capacity, and because nodes then fill in proportion, the
ratio holds as the pool fills: a node's share of new keys is its capacity share.
A node that joins a fuller pool has more free space than its capacity share, so it
takes more than that share of the next writes, from the first one.

The nodes have fixed ids, so the hash outcomes (and these tests) are reproducible;
the key counts are large enough that they would pass for other ids too (the
binomial spread of the smallest share is under a quarter of the 10% tolerance).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence

import pytest

from backend.admin import drain
from backend.config import parse_size
from backend.metadata import NodeInfo
from kvpool import Chunk, PoolClient, PoolConfig
from tests.conftest import REPO, NodeProcess
from tests.support.cli import kvpool
from tests.support.waits import wait_until

KIB = 1024
MIB = 1024 * KIB
# 2 x 16, 3 x 32 and 3 x 64 MiB: 320 MiB, capacity shares 5%, 10% and 20%.
SIZES = ("16MiB", "16MiB", "32MiB", "32MiB", "32MiB", "64MiB", "64MiB", "64MiB")
SHARE_TOLERANCE = 0.10  # each node within +-10% (relative) of its share
PLACEMENT_KEYS = 40_000  # smallest share 5%: binomial spread 2.2% of it, so 10% is 4.6 sigma
JOIN_KEYS = 10_000  # joiner's share about 1/6: spread 2.2% of it
LOSS_KEYS = 2_000
PUT_BATCH = 2_000
SMALL = 1 * KIB


def _start(node_factory: object, sizes: Sequence[str] = SIZES) -> list[NodeProcess]:
    return [node_factory("--node-id", f"n{i}", "--nvme", "0", dram=size) for i, size in enumerate(sizes)]  # type: ignore[operator]


def _chunks(prefix: str, count: int, size: int) -> list[Chunk]:
    payload = os.urandom(size + count)
    return [Chunk(f"{prefix}@{i}", payload[i : i + size]) for i in range(count)]


async def _put(client: PoolClient, chunks: Sequence[Chunk]) -> None:
    for start in range(0, len(chunks), PUT_BATCH):
        await client.put(chunks[start : start + PUT_BATCH])


async def _holders(client: PoolClient, keys: Sequence[str]) -> list[set[str]]:
    """The node ids the index records for each key."""
    return [{loc.node_id for loc in entry} for entry in await client.index.lookup(keys)]


def _shares(holders: Sequence[set[str]]) -> dict[str, float]:
    counts = Counter(node_id for held in holders for node_id in held)
    return {node_id: count / len(holders) for node_id, count in counts.items()}


def _within(measured: float, expected: float) -> bool:
    return abs(measured - expected) <= SHARE_TOLERANCE * expected


def test_status_capacity_is_the_sum_of_the_eight_nodes(node_factory, pool_url):
    _start(node_factory)
    out = kvpool("status", "--url", pool_url, "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["nodes"] == {"alive": 8, "dead": 0, "draining": 0}
    assert status["capacity_bytes"] == sum(parse_size(s) for s in SIZES) == 320 * MIB
    assert {n["node_id"]: n["capacity_bytes"] for n in status["node_list"]} == {
        f"n{i}": parse_size(s) for i, s in enumerate(SIZES)
    }


def test_placement_gives_each_node_its_capacity_share_within_ten_percent(node_factory, pool_url):
    _start(node_factory)

    async def scenario() -> dict[str, float]:
        async with PoolClient(PoolConfig.from_url(pool_url)) as client:
            chunks = _chunks("place", PLACEMENT_KEYS, SMALL)
            await _put(client, chunks)
            holders = await _holders(client, [c.key for c in chunks])
            assert all(len(held) == 1 for held in holders)
            return _shares(holders)

    shares = asyncio.run(scenario())
    total = sum(parse_size(s) for s in SIZES)
    expected = {f"n{i}": parse_size(s) / total for i, s in enumerate(SIZES)}
    assert set(shares) == set(expected)
    off = {n: (round(shares[n], 4), expected[n]) for n in expected if not _within(shares[n], expected[n])}
    assert not off, f"nodes outside +-10% of their capacity share (measured, expected): {off}"


def test_a_joining_node_takes_its_free_space_share_of_the_next_writes(node_factory, pool_url):
    _start(node_factory)
    fill = _chunks("fill", 640, 256 * KIB)  # 160 MiB: the pool is half full

    async def fill_pool() -> None:
        async with PoolClient(PoolConfig.from_url(pool_url)) as client:
            await _put(client, fill)

    asyncio.run(fill_pool())

    async def registry() -> list[NodeInfo]:
        async with PoolClient(PoolConfig.from_url(pool_url)) as client:
            return await client.nodes(refresh=True)

    filled = sum(len(c.data) for c in fill)
    assert wait_until(lambda: sum(n.used_bytes for n in asyncio.run(registry())) >= filled, timeout_s=15)
    node_factory("--node-id", "joiner", "--nvme", "0", dram="32MiB")

    async def scenario() -> tuple[float, float, list[bool]]:
        async with PoolClient(PoolConfig.from_url(pool_url)) as client:
            view = await client.nodes(refresh=True)  # the view the next put places by
            assert "joiner" in {n.node_id for n in view}
            expected = next(n.free_bytes for n in view if n.node_id == "joiner") / sum(n.free_bytes for n in view)
            chunks = _chunks("after-join", JOIN_KEYS, SMALL)
            await client.put(chunks)
            shares = _shares(await _holders(client, [c.key for c in chunks]))
            got = await client.get([c.key for c in chunks])
            intact = [g is not None and g.data == c.data for g, c in zip(got, chunks)]
            return shares.get("joiner", 0.0), expected, intact

    measured, expected, read_back = asyncio.run(scenario())
    assert expected > 32 / 320  # a fuller pool: its free share exceeds its capacity share
    assert _within(measured, expected), f"joiner took {measured:.4f} of the writes, expected {expected:.4f}"
    assert all(read_back)


def test_a_killed_node_costs_only_the_hits_it_alone_held(node_factory, pool_url):
    nodes = _start(node_factory)
    victim = nodes[-1]  # n7, 64 MiB: a 20% share

    async def scenario() -> None:
        async with (
            PoolClient(PoolConfig.from_url(pool_url)) as one,
            PoolClient(PoolConfig.from_url(pool_url + "?replicas=2")) as two,
        ):
            single = _chunks("single", LOSS_KEYS, SMALL)
            double = _chunks("double", LOSS_KEYS, SMALL)
            await _put(one, single)
            await _put(two, double)
            holders = await _holders(one, [c.key for c in single])
            alone_on_victim = {c.key for c, held in zip(single, holders) if held == {"n7"}}
            assert all(len(held) == 2 for held in await _holders(two, [c.key for c in double]))
            assert abs(len(alone_on_victim) / LOSS_KEYS - 0.2) <= 0.05  # about its share (5.6 sigma)

            victim.kill()  # SIGKILL; the registry still calls it alive for a heartbeat TTL
            got = await one.get([c.key for c in single])
            lost = {c.key for c, g in zip(single, got) if g is None}
            assert lost == alone_on_victim
            assert all(g is None or g.data == c.data for g, c in zip(got, single))

            got = await two.get([c.key for c in double])
            assert all(g is not None and g.data == c.data for g, c in zip(got, double))

    asyncio.run(scenario())


def test_a_drained_node_costs_no_hits(node_factory, pool_url):
    nodes = _start(node_factory)
    chunks = _chunks("drain", LOSS_KEYS, SMALL)

    async def put() -> int:
        async with PoolClient(PoolConfig.from_url(pool_url)) as client:
            await _put(client, chunks)
            return sum(1 for held in await _holders(client, [c.key for c in chunks]) if held == {"n7"})

    on_victim = asyncio.run(put())
    assert on_victim > 0
    out = kvpool("drain", "n7", "--url", pool_url, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["moved"] == on_victim
    assert nodes[-1].terminate() == 0

    async def read() -> list[bool]:
        async with PoolClient(PoolConfig.from_url(pool_url)) as client:
            got = await client.get([c.key for c in chunks])
            return [g is not None and g.data == c.data for g, c in zip(got, chunks)]

    assert all(asyncio.run(read()))


def test_a_drain_right_after_another_node_died_still_costs_no_hits(node_factory, pool_url):
    # The dead node stays in the registry until its heartbeat expires; a drain that
    # trusted its copies would delete the only live one.
    a, b, _ = (node_factory("--node-id", f"n{i}", "--nvme", "0", dram="32MiB") for i in range(3))
    chunks = _chunks("pair", 300, SMALL)

    async def scenario() -> list[bool]:
        async with (
            PoolClient(PoolConfig.from_url(pool_url + "?replicas=2")) as writer,
            PoolClient(PoolConfig.from_url(pool_url)) as admin,
        ):
            await _put(writer, chunks)
            holders = await _holders(writer, [c.key for c in chunks])
            assert any(held == {"n0", "n1"} for held in holders)
            b.kill()
            report = await drain(admin, "n0")
            assert report.unreadable == 0
        assert a.terminate() == 0
        async with PoolClient(PoolConfig.from_url(pool_url)) as client:
            got = await client.get([c.key for c in chunks])
            return [g is not None and g.data == c.data for g, c in zip(got, chunks)]

    assert all(asyncio.run(scenario()))


@pytest.mark.usefixtures("processes")
def test_scale_bench_shows_capacity_adding_up_and_the_membership_events(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.scale.pool",
            "--sizes",
            "1,4",
            "--working-set",
            "12MiB",
            "--node-dram",
            "8MiB",
            "--chunk",
            "64KiB",
            "--rounds",
            "1",
            "--join-keys",
            "1000",
            "--no-redis-benchmark",
            "--results",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = tmp_path.glob("scale-*.json")
    record = json.loads(path.read_text())
    one, four = record["rows"]
    assert (one["nodes"], four["nodes"]) == (1, 4)
    assert one["hit_rate"] < 1.0 and four["hit_rate"] == 1.0  # the working set fits only in the larger pool
    assert four["hgetall_per_get_key"] >= 1.0
    events = record["membership"]
    assert events["join"]["joiner_write_share"] > 0
    assert events["kill"]["replicas_1"]["lost_exactly_those"]
    assert events["kill"]["replicas_2"]["hits_after"] == events["kill"]["replicas_2"]["keys"]
    assert events["drain"]["hits_after"] == events["drain"]["hits_before"]
    assert "nodes  capacity  put GB/s" in out.stdout
