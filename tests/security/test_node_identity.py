"""Node identity is exclusive: one process per node id, claimed in Redis before anything of the id is touched.

The attack (issue 33): a second node started with a live node's ``--node-id`` beat under the
same id with a newer epoch, so the dead-node reaper removed the first node's index entries as
those of an ended run; once the duplicate died (kill -9) the first node's chunks were lost for
good while it kept running. Each test runs real node processes against a real redis-server.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from backend.config import NodeConfig
from backend.config.node import ENV_PREFAULT
from backend.config.values import NODE_ID_RULE, check_node_id, default_node_id
from backend.embedded import EmbeddedRedis
from backend.errors import ConfigError
from backend.launch.nodes import NodeProcess
from backend.node.store.nvme_format import chunk_path
from kvpool import PoolConfig, SyncPoolClient
from tests.support.chunks import all_read_back, seeded_chunks
from tests.support.recovery import wait_recovered
from tests.support.waits import wait_until

FULL = bool(os.environ.get("KVPOOL_FULL"))  # `make faults`: more rounds, and the long kill orders
KIB = 1024
TTL_S = NodeConfig.heartbeat_ttl_s  # a node's heartbeat TTL (5 s): how long a crashed run's beat stays
START_S = 20.0  # a node process's start on a busy 2-core machine, with margin
REFUSED = 2  # the exit code of a ConfigError: a live node holds the id


def _live(client: SyncPoolClient) -> dict[str, int]:
    """Live node id -> epoch, as the registry says now."""
    return {n.node_id: n.epoch for n in client.nodes(refresh=True)}


@pytest.fixture
def spawn(processes: None, redis_server: EmbeddedRedis, namespace: str) -> Iterator[Callable[..., NodeProcess]]:
    """Node processes started without waiting for them (``node_factory`` waits until ready); killed after."""
    started: list[NodeProcess] = []

    def start(*extra: str, dram: str = "64MiB") -> NodeProcess:
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", ENV_PREFAULT: "off"}
        args = ["--redis", redis_server.url, "--namespace", namespace, "--dram", dram, "--shm-dir", "off", *extra]
        node = NodeProcess(args, env).spawn()
        started.append(node)
        return node

    yield start
    for node in started:
        if node.alive():
            node.resume()
        node.kill()


def _exit_code(node: NodeProcess, timeout_s: float) -> int | None:
    """The node's exit code, or None if it is still running after ``timeout_s``."""
    try:
        return node.wait_exit(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def test_a_duplicate_node_id_is_refused_while_the_original_lives_and_nothing_of_it_is_touched(
    node_factory, spawn, pool_url
):
    original = node_factory("--node-id", "orig")
    chunks = seeded_chunks("dup", 16, 64 * KIB)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        duplicate = spawn("--node-id", "orig")
        code = _exit_code(duplicate, TTL_S + START_S)
        duplicate.kill()  # the attack's second half: a duplicate that ran dies with kill -9
        assert code == REFUSED, duplicate.tail()
        log = duplicate.log
        assert "node id 'orig' is held by a live node" in log, log
        assert f"127.0.0.1:{original.port}" in log and f"pid {original.pid}" in log, log
        # Nothing of the original was touched: same epoch, alive, and after two more of its beats
        # (each lets the dead-node reaper take a step) every chunk still reads byte-identical.
        assert _live(client) == {"orig": original.epoch}
        beat_at = client.nodes(refresh=True)[0].heartbeat_at
        assert wait_until(lambda: client.nodes(refresh=True)[0].heartbeat_at > beat_at + 1.5, 10.0)
        assert all_read_back(client, chunks)
        assert original.alive()


def test_a_duplicate_killed_while_it_waits_out_a_frozen_original_leaves_every_chunk_readable(
    node_factory, spawn, pool_url
):
    original = node_factory("--node-id", "frozen-orig")
    chunks = seeded_chunks("frozen", 16, 64 * KIB)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        duplicate = spawn("--node-id", "frozen-orig")
        # Freeze the original once the duplicate starts its claim: its beat is not renewed, so the
        # duplicate waits (up to the TTL) to see whether it lapses; kill -9 it while it waits.
        assert wait_until(lambda: "claiming node id frozen-orig" in duplicate.log, START_S), duplicate.tail()
        original.pause()
        try:
            waiting = wait_until(lambda: "is held by" in duplicate.log, TTL_S / 2)
            duplicate.kill()
        finally:
            original.resume()
        assert waiting, duplicate.tail()
        assert "ready at" not in duplicate.log
        assert wait_until(lambda: _live(client) == {"frozen-orig": original.epoch}, 10.0)
        assert all_read_back(client, chunks)


@pytest.mark.usefixtures("processes")
def test_two_nodes_started_at_once_under_one_id_exactly_one_wins(spawn, pool_url):
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        for round_ in range(5 if FULL else 2):
            node_id = f"race-{round_}"
            pair = [spawn("--node-id", node_id), spawn("--node-id", node_id)]
            assert wait_until(lambda pair=pair: all(p.match or not p.alive() for p in pair), TTL_S + START_S)
            winners = [p for p in pair if p.match]
            losers = [p for p in pair if not p.match]
            assert len(winners) == 1 and len(losers) == 1, [p.tail() for p in pair]
            assert losers[0].wait_exit() == REFUSED, losers[0].tail()
            assert f"node id '{node_id}' is held by a live node" in losers[0].log
            winner = winners[0].wait_ready()
            assert _live(client).get(node_id) == winner.epoch
            winner.kill()


def test_a_node_killed_and_restarted_at_once_waits_out_its_last_beat_and_recovers_its_nvme_chunks(
    node_factory, pool_url, tmp_path
):
    nvme = ["--nvme-dir", str(tmp_path / "nvme"), "--nvme", "64MiB"]  # the id is kept in the directory
    first = node_factory(*nvme, dram="1MiB")
    chunks = seeded_chunks("crash", 24, 128 * KIB)  # 3 MiB into 1 MiB of DRAM: most are demoted to NVMe
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        for chunk in chunks:
            client.put([chunk])
        assert wait_until(lambda: client.node_stats(client.nodes()[0])["tiers"]["nvme"]["objects"] >= 16, 10.0)
        first.kill()  # kill -9: its last beat stays for up to one TTL
        killed_at = time.monotonic()
        on_disk = [c for c in chunks if chunk_path(tmp_path / "nvme", c.key).exists()]  # what it held on NVMe
        second = node_factory(*nvme, dram="1MiB")
        took_s = time.monotonic() - killed_at
        assert second.node_id == first.node_id and second.epoch > first.epoch
        assert "lapsed; this node takes the id over" in second.log, second.tail()
        assert took_s < TTL_S + START_S
        assert wait_recovered(client)  # it serves while recovery runs: keys become hits as they are indexed
        assert len(on_disk) >= 16 and client.contains([c.key for c in on_disk]) == [True] * len(on_disk)
        assert all_read_back(client, on_disk)


def test_a_second_node_on_a_live_nodes_nvme_directory_is_refused_under_any_id(node_factory, spawn, pool_url, tmp_path):
    """The id's claim guards the id; the directory needs its own guard: before it, a node started with another
    --node-id on the same --nvme-dir took the live node's files as its own (and removed its temp files)."""
    nvme = ["--nvme-dir", str(tmp_path / "nvme"), "--nvme", "64MiB"]
    original = node_factory("--node-id", "dir-owner", *nvme, dram="1MiB")
    chunks = seeded_chunks("dir", 24, 128 * KIB)  # most are demoted to the directory
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        for chunk in chunks:
            client.put([chunk])
        for other in (["--node-id", "dir-thief"], []):  # another id, and a made-up one
            intruder = spawn(*other, *nvme, dram="1MiB")
            assert _exit_code(intruder, START_S) == REFUSED, intruder.tail()
            assert "is in use by another node process" in intruder.log, intruder.tail()
            assert f"pid {original.pid}" in intruder.log, intruder.tail()
        assert (tmp_path / "nvme" / "node_id").read_text().strip() == "dir-owner"
        assert all_read_back(client, chunks)
        original.kill()  # kill -9: the kernel lets the lock go, and a restart under the id takes the directory
        restarted = node_factory("--node-id", "dir-owner", *nvme, dram="1MiB")
        assert restarted.alive()


def test_a_node_frozen_past_its_ttl_whose_id_was_taken_stops_instead_of_fighting_for_it(node_factory, spawn, pool_url):
    original = node_factory("--node-id", "taken")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        original.pause()  # frozen past its TTL: dead to the pool, and its id free again
        try:
            successor = spawn("--node-id", "taken").wait_ready(TTL_S + START_S)
            chunks = seeded_chunks("successor", 8, 64 * KIB)
            client.put(chunks)
        finally:
            original.resume()
        assert _exit_code(original, 10.0) == 1, original.tail()
        assert "this node stops serving under the id" in original.log
        # It left the successor's registry entry, claim and index entries alone.
        assert _live(client) == {"taken": successor.epoch}
        assert all_read_back(client, chunks)
        assert successor.alive()


@pytest.mark.skipif(not FULL, reason="the long kill order runs under `make faults` (KVPOOL_FULL=1)")
def test_every_kill_order_of_original_and_duplicate_leaves_the_originals_nvme_chunks_readable(
    node_factory, spawn, pool_url, tmp_path
):
    """Original frozen while a duplicate waits, then killed: the duplicate takes the id over; the
    original restarted is refused while it lives; the duplicate killed, the original restarts and
    recovers every chunk it had on NVMe."""
    nvme = ["--node-id", "orig-nvme", "--nvme-dir", str(tmp_path / "nvme"), "--nvme", "64MiB"]
    original = node_factory(*nvme, dram="1MiB")
    chunks = seeded_chunks("order", 24, 128 * KIB)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        for chunk in chunks:
            client.put([chunk])
        assert wait_until(lambda: client.node_stats(client.nodes()[0])["tiers"]["nvme"]["objects"] >= 16, 10.0)
        duplicate = spawn("--node-id", "orig-nvme")
        assert wait_until(lambda: "claiming node id" in duplicate.log, START_S)
        original.pause()
        assert wait_until(lambda: "is held by" in duplicate.log, TTL_S)
        original.kill()  # kill -9 while the duplicate waits: its beat lapses, the duplicate takes over
        duplicate.wait_ready(TTL_S + START_S)
        again = spawn(*nvme, dram="1MiB")
        assert _exit_code(again, TTL_S + START_S) == REFUSED, again.tail()
        assert wait_until(lambda: _live(client) == {"orig-nvme": duplicate.epoch}, 5.0)
        on_disk = [c for c in chunks if chunk_path(tmp_path / "nvme", c.key).exists()]  # the original's NVMe chunks
        duplicate.kill()
        restarted = node_factory(*nvme, dram="1MiB")
        assert "lapsed; this node takes the id over" in restarted.log
        assert wait_recovered(client)
        assert len(on_disk) >= 16 and client.contains([c.key for c in on_disk]) == [True] * len(on_disk)
        assert all_read_back(client, on_disk)


# -- node ids are validated ---------------------------------------------------------------
BAD_IDS = ["a|b", "-flag", ".hidden", "has space", "x" * 129, "caf\u00e9", "line\n", "k{tag}", ""]


@pytest.mark.parametrize("bad", BAD_IDS[:-1])
def test_a_node_id_outside_the_rule_is_refused_naming_the_rule(bad):
    with pytest.raises(ConfigError, match="is not a valid node id") as refused:
        NodeConfig(redis_url="redis://r:1", namespace="ns", dram_bytes=1 << 20, node_id=bad)
    assert NODE_ID_RULE in str(refused.value) and "--node-id" in str(refused.value)


def test_node_ids_inside_the_rule_and_the_defaults_pass():
    for good in ("n1", "gpu-7-7000", "node_01.rack-3", "A" * 128, "7"):
        assert check_node_id(good, "--node-id") == good
    assert default_node_id("gpu-7.example.com", "7000") == "gpu-7.example.com-7000"
    assert default_node_id("my host|x", "7000") == "my-host-x-7000"
    assert default_node_id("-odd", "1") == "n-odd-1"
    assert default_node_id("", "1") == "n-1"
    assert len(default_node_id("h" * 300, "abcdef12")) == 128


@pytest.mark.usefixtures("processes")
def test_a_bad_node_id_is_refused_at_start_and_a_bad_kept_one_names_its_file(spawn, tmp_path):
    flag = spawn("--node-id", "a|b")
    assert _exit_code(flag, START_S) == REFUSED, flag.tail()
    assert "--node-id" in flag.log and NODE_ID_RULE in flag.log, flag.log
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / "node_id").write_text("kept|id\n")
    kept = spawn("--nvme-dir", str(nvme), "--nvme", "8MiB")
    assert _exit_code(kept, START_S) == REFUSED, kept.tail()
    assert str(nvme / "node_id") in kept.log and NODE_ID_RULE in kept.log, kept.log
