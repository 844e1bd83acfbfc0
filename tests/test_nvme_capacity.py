"""A node's advertised NVMe capacity is never more than its disk can hold.

Placement weighs nodes by free capacity (``backend/placement.py``): a node started with an
``--nvme`` larger than its disk's free space would otherwise draw nearly every put. Real
nodes on this machine's real disk, asked for more than ``os.statvfs`` says it has free.
"""

from __future__ import annotations

import os
from pathlib import Path

from backend.config import format_size
from kvpool import Chunk, PoolConfig, SyncPoolClient

GIB = 2**30
TIB = 2**40
PUTS = 60


def _free_bytes(path: Path) -> int:
    disk = os.statvfs(path)
    return disk.f_bavail * disk.f_frsize


def _nvme_capacities(url: str) -> dict[str, int]:
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        return {n.node_id: n.tiers["nvme"]["capacity_bytes"] for n in client.nodes()}


def test_an_nvme_size_beyond_the_free_space_is_capped_and_said_at_start_and_placement_spreads(
    node_factory, pool_url, tmp_path
):
    free = _free_bytes(tmp_path)
    asked = free + TIB  # a typo's worth more than the disk has
    typo = node_factory("--nvme-dir", str(tmp_path / "a"), "--nvme", str(asked), dram="16MiB")
    honest_bytes = free // 2
    honest = node_factory("--nvme-dir", str(tmp_path / "b"), "--nvme", str(honest_bytes), dram="16MiB")

    said = "\n".join(typo.output)
    assert f"--nvme {format_size(asked)} is more than the disk holding" in said, said
    assert "the node advertises" in said and "nodes sharing a disk each count its free space" in said
    assert not any("is more than the disk" in line for line in honest.output)

    capacities = _nvme_capacities(pool_url)
    # within what the disk can hold (its free space, read again by the test, give or take others' writes)
    assert capacities[typo.node_id] <= _free_bytes(tmp_path) + GIB
    assert capacities[typo.node_id] >= free - 4 * GIB  # capped to the disk, not to nothing
    assert capacities[honest.node_id] == honest_bytes  # a size the disk can hold is advertised as given

    chunks = [Chunk(f"capacity-model@1@0@{i:x}@bfloat16", os.urandom(1024)) for i in range(PUTS)]
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        held = {n.node_id: client.node_stats(n)["tiers"]["dram"]["objects"] for n in client.nodes()}
    assert sum(held.values()) == PUTS, held
    # weights free : free/2, so about a third go to the honest node; uncapped it would be about 3 %
    assert held[honest.node_id] >= PUTS // 6, held
