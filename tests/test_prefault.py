"""--prefault: a node takes its DRAM arena's memory at start, before it registers.

Real node processes. A prefaulted node has every page of its arena resident when
clients first find it; where the directory cannot hold the whole arena it still
starts, says so, and serves (chunks that find no room live in private memory).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.client import Chunk, SyncPoolClient
from backend.config import PoolConfig
from backend.shm import HEADER_BYTES
from tests.support.waits import wait_until

MiB = 1024 * 1024


def _chunks(prefix: str, count: int, size: int) -> list[Chunk]:
    rng = random.Random(count)
    return [Chunk(f"{prefix}@{i}", rng.randbytes(size)) for i in range(count)]


def _arena(client: SyncPoolClient) -> dict:
    (node,) = client.nodes()
    return client.node_stats(node)["arena"]


def _round_trip(client: SyncPoolClient, chunks: list[Chunk]) -> None:
    client.put(chunks)
    got = client.get([c.key for c in chunks])
    assert [bytes(g.data) if g is not None else None for g in got] == [c.data for c in chunks]


def test_a_prefaulting_node_has_its_whole_arena_resident_when_it_is_ready_and_serves(node_factory, pool_url):
    node_factory("--prefault", "on", shm=True, dram="64MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        arena = _arena(client)  # the first thing a client can ask, once the node is registered
        assert arena["grown_bytes"] == arena["size_bytes"] == 128 * MiB  # DRAM + its 64 MiB of slack
        assert os.stat(arena["path"]).st_blocks * 512 >= HEADER_BYTES + arena["size_bytes"]  # in /dev/shm now
        chunks = _chunks("warm", 4, 4 * MiB)
        _round_trip(client, chunks)
        assert client.counters["shm_get_bytes"] == 16 * MiB  # the same-host path, out of the arena
        assert _arena(client)["fallbacks"] == 0


def test_a_node_without_prefault_takes_no_arena_pages_at_start(node_factory, pool_url):
    node_factory("--prefault", "off", shm=True, dram="64MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        arena = _arena(client)
        assert arena["grown_bytes"] == 0 and os.stat(arena["path"]).st_blocks * 512 <= HEADER_BYTES


def test_a_prefaulting_node_without_shared_memory_keeps_dram_in_a_private_arena(node_factory, pool_url):
    node = node_factory(dram="64MiB", env={"KVPOOL_PREFAULT": "on"})  # --shm-dir off; on through the environment
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        (info,) = client.nodes()
        assert info.shm_path == ""  # nothing for clients to map
        arena = _arena(client)
        assert arena["path"] == "private memory" and arena["grown_bytes"] == arena["size_bytes"] == 128 * MiB
        memory = node.memory()
        assert memory["VmRSS"] >= 128 * MiB  # taken at start, not as chunks arrive
        _round_trip(client, _chunks("private", 4, 4 * MiB))
        assert client.counters.get("shm_get_bytes", 0) == 0


def _my_stages() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"kvpool-{os.getpid()}-*.stage")}


def test_the_lmcache_connector_makes_its_put_stage_when_it_starts_not_at_its_first_put(
    node_factory, pool_url, stack_factory
):
    node_factory(shm=True, dram="64MiB")
    before = _my_stages()
    stack = stack_factory(pool_url)
    assert wait_until(lambda: _my_stages() - before, timeout_s=10.0)  # made at start (~0.1 s), off the first put
    client = stack.connector().client
    assert client.counters.get("staged_put_bytes", 0) == 0  # nothing was put yet
    obj = stack.make_object(1)
    stack.put([stack.key(1)], [obj])
    stack.release([obj])
    assert client.counters["staged_put_bytes"] == stack.chunk_bytes and len(_my_stages() - before) == 1


def test_getting_ready_to_put_opens_every_connection_with_the_stage_mapped(node_factory, pool_url):
    # Otherwise each of the first connections_per_node puts pays a connect, a handshake and the
    # node's mapping of the stage: the tail of a fresh client's first puts.
    node_factory(shm=True, dram="64MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?connections_per_node=3")) as client:
        assert client.prepare_puts() == 1
        (node,) = client.nodes()
        opened = client.node_stats(node)["counters"]["connections_accepted"]
        assert opened == 3
        _round_trip(client, _chunks("warm", 6, 64 * 1024))  # three stripes, one per connection
        counters = client.node_stats(node)["counters"]
        assert counters["connections_accepted"] == opened  # no put opened one
        assert counters["staged_put_bytes"] == 6 * 64 * 1024


@pytest.fixture
def small_tmpfs(processes: None, tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs: a /dev/shm that cannot hold a node's whole arena (needs root to mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root; the refusal path is then untested here")
    where = tmp_path / "shm"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m,mode=1777", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_node_whose_shm_dir_cannot_hold_the_arena_still_starts_warns_and_serves(small_tmpfs, node_factory, pool_url):
    node = node_factory("--prefault", "on", "--shm-dir", str(small_tmpfs), dram="64MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        arena = _arena(client)
        assert 0 < arena["grown_bytes"] <= 32 * MiB < arena["size_bytes"]
        assert "can be had there" in node.log  # the start-up warning names what it could not take
        chunks = _chunks("small", 12, 4 * MiB)  # 48 MiB: more than the tmpfs holds
        _round_trip(client, chunks)
        assert _arena(client)["fallbacks"] > 0  # the rest lived in private memory, served over TCP
