"""A node full of tiny chunks stays within ``--dram`` plus 256 bytes of bookkeeping per chunk (RSS from /proc).

A real node (DRAM only, private memory taken as chunks are written, so its RSS follows
what it holds) is filled through the real put path with 32-byte values under LMCache's
layerwise key strings until its DRAM is full, then given as many again, so it evicts
all the time. Its RSS is read from /proc: at the fill, the bookkeeping per chunk held
(RSS growth less each value's 64-byte cell and its key's length) is at most 256 bytes;
after the overfill, RSS is still within the bound docs/scale-node.md states. The newest
chunks read back byte-identical. Runs with 49,152 chunks held in ``make test`` (15 s)
and 262,144 under ``make faults`` (``KVPOOL_FULL=1``, about a minute).
"""

from __future__ import annotations

import asyncio

import pytest

from backend.node.memory.arena import room_of
from bench.scale.node import LAYOUT_FINGERPRINT, VALUE_BYTES, fill, layerwise_key, value_of
from kvpool import PoolClient, PoolConfig
from tests.faults.proxy import FULL

HELD = 262_144 if FULL else 49_152
# Chunks put before the baseline is read: every path of the fill has run, with as many requests in
# flight as the fill keeps (their objects' high-water mark stays with the process, whatever it holds).
WARM = 4 * 4096
BOOKKEEPING_BYTES = 256  # the budget per chunk, beyond its room and its key
NOISE_BYTES = 4 * 1024 * 1024  # what the process allocates meanwhile that is no chunk's (buffers, the heap's slack)


@pytest.mark.timeout(400 if FULL else 120)
def test_a_node_full_of_tiny_chunks_stays_within_dram_plus_its_bookkeeping(node_factory, pool_url):
    room = room_of(VALUE_BYTES)
    node = node_factory("--prefault", "off", dram=str(HELD * room))
    config = PoolConfig.from_url(pool_url + "?connect_timeout_s=60&progress_timeout_s=60")

    async def scenario() -> dict:
        async with PoolClient(config) as client:
            (info,) = await client.nodes()
            await fill(client, 0, WARM)
            baseline = node.memory()["VmRSS"]
            await fill(client, WARM, HELD)
            full = node.memory()["VmRSS"]
            await fill(client, HELD, 2 * HELD)  # as many again: each put evicts
            after = node.memory()
            stats = await client.node_stats(info)
            newest = [layerwise_key(i) for i in range(2 * HELD - 100, 2 * HELD)]
            got = await client.get(newest, fingerprint=LAYOUT_FINGERPRINT)
            assert [bytes(g.data) if g else None for g in got] == [value_of(i) for i in range(2 * HELD - 100, 2 * HELD)]
            return {"baseline": baseline, "full": full, "after": after, "stats": stats}

    figures = asyncio.run(scenario())
    stats = figures["stats"]
    dram = stats["tiers"]["dram"]
    assert dram["objects"] == HELD and dram["used_bytes"] == HELD * room  # full, counted at each chunk's cell
    assert stats["counters"]["evictions"] == HELD and stats["arena"]["fallbacks"] == 0
    key_bytes = sum(len(layerwise_key(i)) for i in range(HELD)) / HELD
    added = HELD - WARM
    per_chunk = (figures["full"] - figures["baseline"] - added * room) / added - key_bytes
    assert per_chunk <= BOOKKEEPING_BYTES, f"{per_chunk:.0f} bytes of bookkeeping per chunk"
    bound = figures["baseline"] + HELD * (room + key_bytes + BOOKKEEPING_BYTES) + NOISE_BYTES
    assert figures["after"]["VmRSS"] <= bound, (figures["after"], bound)
    assert figures["after"]["VmHWM"] <= bound + NOISE_BYTES  # nor at any moment between
