"""A node's memory per chunk, and what eviction and lookups cost, at 10^4 and at N chunks held.

    python -m bench.scale_node                      # N = 100,000 (about a minute)
    python -m bench.scale_node --chunks 1000000     # the issue's figure (a few minutes)

Three measurements, each a function whose figures come back as a dict (``bench.scale`` folds
them into its report) and are printed beside the issue's targets:

* :func:`measure_rss`: a real ``kvpool node`` process (DRAM only, no shared memory, no
  prefault: its arena's pages come as chunks are written, so its RSS grows with what it
  holds) and a real redis-server. It is filled through the real put path, 4,096 chunks a
  request, with tiny values (32 bytes: the values cost next to nothing, so what grows is
  the bookkeeping) under LMCache's layerwise key strings
  (``MODEL@WORLD@WORKER@HASH@DTYPE@LAYER``, 70-odd characters). VmRSS (``/proc``) is read
  at 10^4 chunks and at N; the growth per chunk, less the room the DRAM tier counts for
  the value (its 64-byte cell, within ``--dram``) and less the key's own length, is the
  bookkeeping per chunk, beside the 256-byte budget. At both sizes the node answers
  EXISTS_BATCH and GET_BATCH of 1,000 keys drawn at random from all it holds, sent
  straight to it (no Redis in the way): p50 and p99 of each.
* :func:`measure_eviction`: the tier manager in this process (no socket: only the node's
  own structures are timed), filled with N chunks to exactly its DRAM size, 10 % of them
  pinned (half by leases, half landing: inserted by a put that has not committed), and
  those the *oldest*, where a walk from the coldest end meets them first. Then puts that
  each must evict one chunk: the time per put (reserve, evict, insert), p50 and p99; and
  lookups of 1,000 random held keys (contains, get). The same at 10^4 chunks; each N
  figure beside 1.2 times the 10^4 one.
* :func:`measure_nvme_records`: what an NVMe file costs the node's memory: N records
  handed to ``TierManager.load_nvme`` in batches of 10,000 as recovery does (records made
  in this process, no file written: the structures are what is measured), RSS growth per
  record less the key's length, and the time per record.

What is simulated: the NVMe records (made in this process rather than read from 10^6
files: the scan is measured by ``bench.scale_nvme``; the node's cost per record is what
is measured here). Every DRAM chunk went through a real put (RSS) or the tier manager's
own reserve and insert (eviction). Results: docs/scale-node.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backend import Chunk, PoolClient, PoolConfig
from backend.client.chunks import BytesSink, Hit
from backend.embedded import EmbeddedRedis
from backend.metadata import NodeInfo
from backend.node.arena import room_of
from backend.node.dram import StoredChunk
from backend.node.nvme_format import NvmeFile
from backend.node.tiers import TierConfig, TierManager
from backend.protocol import ItemMeta, Op, checksum, encode_keys
from bench.nodes import NodeProcess

__all__ = [
    "measure_eviction",
    "measure_nvme_records",
    "measure_rss",
    "run",
    "TARGET_OVERHEAD_BYTES",
    "TARGET_RATIO",
    "SMALL_CHUNKS",
]

TARGET_OVERHEAD_BYTES = 256  # node bookkeeping per chunk beyond the key (issue #34)
TARGET_RATIO = 1.2  # eviction and lookup at N held, against 10^4 held
SMALL_CHUNKS = 10_000
DEFAULT_CHUNKS = 100_000
VALUE_BYTES = 32
PUT_BATCH = 4096  # the protocol's max_items per request
PUTS_IN_FLIGHT = 4
LOOKUP_KEYS = 1000
LOOKUP_ROUNDS = 30
EVICTION_PUTS = 3000
PINNED_SHARE = 0.10
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LAYERS = 32


def layerwise_key(i: int) -> str:
    """The i-th chunk's key as LMCache's layerwise mode spells it (``LayerCacheEngineKey.to_string``)."""
    chunk, layer = divmod(i, LAYERS)
    return f"{MODEL}@8@{chunk % 8}@{(chunk * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF:x}@bfloat16@{layer}"


def value_of(i: int) -> bytes:
    return i.to_bytes(8, "little") * (VALUE_BYTES // 8)


def _pcts(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]}


# -- a real node process -------------------------------------------------------------------


async def fill(client: PoolClient, start: int, stop: int) -> None:
    """Put chunks ``start``..``stop`` in requests of PUT_BATCH, PUTS_IN_FLIGHT at a time."""
    batches = [range(b, min(b + PUT_BATCH, stop)) for b in range(start, stop, PUT_BATCH)]
    queue = iter(batches)

    async def worker() -> None:
        for batch in queue:
            await client.put([Chunk(layerwise_key(i), value_of(i)) for i in batch])

    await asyncio.gather(*(worker() for _ in range(PUTS_IN_FLIGHT)))


async def _node_lookups(client: PoolClient, node: NodeInfo, held: int) -> dict[str, dict[str, float]]:
    """EXISTS_BATCH and GET_BATCH of LOOKUP_KEYS random held keys, straight to the node: ms per request."""
    rng = random.Random(held)
    pool = client.connections.pool(node)
    times: dict[str, list[float]] = {"exists": [], "get": []}
    for _ in range(LOOKUP_ROUNDS):
        keys = [layerwise_key(rng.randrange(held)) for _ in range(LOOKUP_KEYS)]
        meta = encode_keys(keys)
        started = time.perf_counter()
        await pool.request(Op.EXISTS_BATCH, meta)
        times["exists"].append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        got = await pool.request(Op.GET_BATCH, meta, keys=keys, sink=BytesSink(), expect_bytes=VALUE_BYTES * len(keys))
        times["get"].append((time.perf_counter() - started) * 1000)
        assert all(isinstance(outcome, Hit) for outcome in got), "a held key was not found"
    return {name: _pcts(samples) for name, samples in times.items()}


def measure_rss(chunks: int = DEFAULT_CHUNKS) -> dict[str, Any]:
    """RSS of a real node per chunk held (bookkeeping beyond value room and key), and node-side lookups,
    at SMALL_CHUNKS and at ``chunks``."""
    dram_bytes = chunks * room_of(VALUE_BYTES) * 11 // 10 + (16 << 20)  # all of them, never an eviction
    redis = EmbeddedRedis().start()
    node = None
    try:
        args = ["--redis", redis.url, "--namespace", "scale-node", "--dram", str(dram_bytes), "--nvme", "0"]
        node = NodeProcess([*args, "--shm-dir", "off", "--prefault", "off", "--node-id", "scale-node"]).start()
        config = PoolConfig.from_url(f"kvpool://127.0.0.1:{redis.port}/scale-node?shm=off&timeout_ms=60000")
        return asyncio.run(_rss_scenario(config, node, chunks))
    finally:
        if node is not None:
            node.stop()
        redis.cleanup()


async def _rss_scenario(config: PoolConfig, node: NodeProcess, chunks: int) -> dict[str, Any]:
    key_bytes = statistics.fmean(len(layerwise_key(i)) for i in range(0, chunks, max(1, chunks // 1000)))
    async with PoolClient(config) as client:
        (info,) = await client.nodes()
        await fill(client, 0, 1000)  # warm: every code path the fill takes has run once
        rss_start = node.memory()["VmRSS"]
        await fill(client, 1000, SMALL_CHUNKS)
        rss_small = node.memory()["VmRSS"]
        lookups_small = await _node_lookups(client, info, SMALL_CHUNKS)
        started = time.perf_counter()
        await fill(client, SMALL_CHUNKS, chunks)
        fill_s = time.perf_counter() - started
        rss_big = node.memory()["VmRSS"]
        stats = await client.node_stats(info)
        lookups_big = await _node_lookups(client, info, chunks)
    dram = stats["tiers"]["dram"]
    assert dram["objects"] == chunks, f"the node holds {dram['objects']} chunks, not {chunks}"
    added = chunks - SMALL_CHUNKS
    growth = (rss_big - rss_small) / added
    room = room_of(VALUE_BYTES)
    return {
        "chunks": chunks,
        "value_bytes": VALUE_BYTES,
        "value_room_bytes": room,
        "key_bytes_mean": key_bytes,
        "fill_chunks_per_s": added / fill_s,
        "rss_start_bytes": rss_start,
        "rss_small_bytes": rss_small,
        "rss_bytes": rss_big,
        "rss_growth_per_chunk_bytes": growth,
        "overhead_per_chunk_bytes": growth - room - key_bytes,  # beyond the value's room and the key
        "overhead_beyond_value_bytes": growth - VALUE_BYTES - key_bytes,  # the cell's slack counted in
        "dram_used_bytes": dram["used_bytes"],
        "lookups_small_ms": lookups_small,
        "lookups_ms": lookups_big,
    }


# -- the tier manager in this process ---------------------------------------------------


async def _filled(held: int) -> tuple[TierManager, list[str]]:
    """A tier manager holding ``held`` chunks (DRAM exactly full), the oldest PINNED_SHARE pinned."""
    room = room_of(VALUE_BYTES)
    tiers = TierManager(TierConfig(dram_bytes=held * room))
    keys = [layerwise_key(i) for i in range(held)]
    landing = int(held * PINNED_SHARE / 2)
    leased = int(held * PINNED_SHARE) - landing
    for i, key in enumerate(keys):
        await tiers.reserve(room)
        buffer = tiers.take_buffer(VALUE_BYTES)
        buffer[:] = value_of(i)
        meta = ItemMeta(key, VALUE_BYTES, checksum(buffer), "uint8", (VALUE_BYTES,), 1)
        tiers.insert(StoredChunk(meta, buffer), put_id=1 if i < landing else 0)  # put 1 never commits
    for start in range(landing, landing + leased, 100):  # leases of 100 keys, as a prefetch takes them
        tiers.leases.grant(keys[start : min(start + 100, landing + leased)], [], 600_000)
    return tiers, keys


async def _eviction_figures(held: int) -> dict[str, Any]:
    tiers, keys = await _filled(held)
    try:
        room = room_of(VALUE_BYTES)
        rng = random.Random(held)
        per_put: list[float] = []
        for n in range(EVICTION_PUTS):
            buffer = memoryview(bytearray(value_of(n)))
            meta = ItemMeta(f"new@{n}", VALUE_BYTES, checksum(buffer), "uint8", (VALUE_BYTES,), 1)
            started = time.perf_counter()
            await tiers.reserve(room)  # DRAM is full: one chunk is evicted
            tiers.insert(StoredChunk(meta, buffer))
            per_put.append((time.perf_counter() - started) * 1e6)
        assert tiers.counters["evictions"] == EVICTION_PUTS and len(tiers) == held  # each put evicted one
        contains: list[float] = []
        gets: list[float] = []
        for _ in range(LOOKUP_ROUNDS):
            sample = [keys[rng.randrange(held)] for _ in range(LOOKUP_KEYS)]
            started = time.perf_counter()
            for key in sample:
                tiers.contains(key)
            contains.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            for key in sample:
                await tiers.get(key)
            gets.append((time.perf_counter() - started) * 1000)
        return {
            "held": held,
            "pinned": int(held * PINNED_SHARE),
            "put_evicting_us": _pcts(per_put),
            "contains_1000_ms": _pcts(contains),
            "get_1000_ms": _pcts(gets),
        }
    finally:
        await tiers.close()


def measure_eviction(chunks: int = DEFAULT_CHUNKS) -> dict[str, Any]:
    """A put's eviction cost and lookups of 1,000 keys in the tier manager at SMALL_CHUNKS and ``chunks`` held,
    10 % pinned; the ratios beside TARGET_RATIO."""
    small = asyncio.run(_eviction_figures(SMALL_CHUNKS))
    big = asyncio.run(_eviction_figures(chunks))
    return {
        "small": small,
        "large": big,
        "put_evicting_ratio": big["put_evicting_us"]["p50"] / small["put_evicting_us"]["p50"],
        "contains_ratio": big["contains_1000_ms"]["p50"] / small["contains_1000_ms"]["p50"],
        "get_ratio": big["get_1000_ms"]["p50"] / small["get_1000_ms"]["p50"],
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_nvme_records(chunks: int = DEFAULT_CHUNKS, batch: int = 10_000) -> dict[str, Any]:
    """What an NVMe file costs the node: ``chunks`` records handed to ``TierManager.load_nvme`` in batches, as
    recovery does (records made here, no file written: only the node's structures are measured); this
    process's RSS growth per record less the key's length, and the time per record."""
    with tempfile.TemporaryDirectory() as root:
        tiers = TierManager(TierConfig(dram_bytes=1 << 20, nvme_dir=Path(root), nvme_bytes=1 << 50))
        key_bytes = statistics.fmean(len(layerwise_key(i)) for i in range(0, chunks, max(1, chunks // 1000)))
        gc.collect()
        before = _rss_bytes()
        spent = 0.0
        for start in range(0, chunks, batch):
            records = [
                NvmeFile("", ItemMeta(layerwise_key(i), 1 << 20, i, "bfloat16", (2, 8, 256, 128), 1), 256)
                for i in range(start, min(start + batch, chunks))
            ]
            started = time.perf_counter()
            tiers.load_nvme(records)
            spent += time.perf_counter() - started
        del records
        gc.collect()
        grown = _rss_bytes() - before
        assert tiers.nvme is not None and tiers.nvme.files == chunks
        asyncio.run(tiers.close())
    return {
        "records": chunks,
        "overhead_per_record_bytes": grown / chunks - key_bytes,
        "load_us_per_record": spent / chunks * 1e6,
        "batch": batch,
        "batch_ms": spent / -(-chunks // batch) * 1000,
    }


# -- the report --------------------------------------------------------------------------


def _row(name: str, measured: str, target: str, ok: bool) -> str:
    return f"  {name:<48} {measured:>22}   target {target:<14} {'ok' if ok else 'OVER'}"


def run(chunks: int = DEFAULT_CHUNKS) -> dict[str, Any]:
    """Both measurements at ``chunks``, printed beside the targets; the figures as a dict."""
    rss = measure_rss(chunks)
    eviction = measure_eviction(chunks)
    nvme = measure_nvme_records(chunks)
    n, s = f"{chunks:,}", f"{SMALL_CHUNKS:,}"
    print(f"node memory and eviction at {n} chunks ({VALUE_BYTES}-byte values, layerwise LMCache keys)")
    print(
        f"  fill through the put path: {rss['fill_chunks_per_s']:,.0f} chunks/s; "
        f"RSS {rss['rss_small_bytes'] / 2**20:.0f} MiB at {s}, {rss['rss_bytes'] / 2**20:.0f} MiB at {n}"
    )
    overhead = rss["overhead_per_chunk_bytes"]
    print(_row("node bookkeeping per chunk (beyond room + key)", f"{overhead:.0f} B", "<= 256 B", overhead <= 256))
    print(
        f"  (RSS growth {rss['rss_growth_per_chunk_bytes']:.0f} B/chunk = value room {rss['value_room_bytes']} B "
        f"+ key {rss['key_bytes_mean']:.0f} B + bookkeeping; beyond the raw value "
        f"{rss['overhead_beyond_value_bytes']:.0f} B)"
    )
    for op in ("exists", "get"):
        small, big = rss["lookups_small_ms"][op]["p50"], rss["lookups_ms"][op]["p50"]
        print(
            _row(
                f"{op.upper()}_BATCH of 1,000 on the node, p50 at {n}",
                f"{big:.2f} ms ({big / small:.2f}x)",
                f"<= 1.2x {small:.2f}",
                big <= TARGET_RATIO * small,
            )
        )
    for label, key, unit in (
        ("a put that evicts, p50", "put_evicting_us", "us"),
        ("contains() of 1,000 keys, p50", "contains_1000_ms", "ms"),
        ("get() of 1,000 keys, p50", "get_1000_ms", "ms"),
    ):
        small, big = eviction["small"][key]["p50"], eviction["large"][key]["p50"]
        print(
            _row(
                f"{label} at {n} ({PINNED_SHARE:.0%} pinned)",
                f"{big:.2f} {unit} ({big / small:.2f}x)",
                f"<= 1.2x {small:.2f}",
                big <= TARGET_RATIO * small,
            )
        )
    records = nvme["overhead_per_record_bytes"]
    print(_row(f"an NVMe file's record (beyond the key), {n} files", f"{records:.0f} B", "<= 256 B", records <= 256))
    print(
        f"  (recovery's records adopted at {nvme['load_us_per_record']:.1f} us each: "
        f"{nvme['batch_ms']:.0f} ms of the node's loop per batch of {nvme['batch']:,})"
    )
    return {"rss": rss, "eviction": eviction, "nvme_records": nvme}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS, help="chunks held at the large size")
    args = parser.parse_args(argv)
    if args.chunks <= SMALL_CHUNKS:
        parser.error(f"--chunks must be more than {SMALL_CHUNKS:,}")
    run(args.chunks)


if __name__ == "__main__":
    main()
