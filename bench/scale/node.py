"""A node's memory per chunk, and what eviction and lookups cost, at 10^4 and at N chunks held.

    python -m bench.scale.node                      # N = 100,000 (about a minute)
    python -m bench.scale.node --chunks 1000000     # the issue's figure (a few minutes)

Three measurements, each a function whose figures come back as a dict (``bench.scale.pool`` folds
them into its report) and are printed beside the issue's targets:

* :func:`measure_node`: real ``kvpool node`` processes (DRAM only, no shared memory, no
  prefault: their arenas' pages come as chunks are written, so RSS grows with what they
  hold) and a real redis-server. Two nodes, one of 10^4 chunks and one of N, each with
  ``--dram`` exactly its chunks' rooms, filled through the real put path (4,096 chunks a
  request) with tiny values (32 bytes: the values cost next to nothing, so what grows is
  the bookkeeping) under LMCache's layerwise key strings
  (``MODEL@WORLD@WORKER@HASH@DTYPE@LAYER``, 70-odd characters). The large node's VmRSS
  (``/proc``) is read once 16,384 chunks are in (the puts in flight have left their
  high-water mark) and at N: the growth per chunk, less the room the DRAM tier counts for
  the value (its 64-byte cell, within ``--dram``) and less the key's own length, is the
  bookkeeping per chunk, beside the 256-byte budget. Then the oldest 10 % of each node's
  chunks are leased, and in interleaved rounds (both sizes see the same machine) each node
  takes a put of 16 new chunks (each evicts one) and answers EXISTS_BATCH and GET_BATCH of
  1,000 held keys sent straight to it (no Redis in the way): p50 at N beside 1.2 times
  the p50 at 10^4.
* :func:`measure_nvme_records`: what an NVMe file costs the node's memory: N records
  handed to ``StoreUpkeep.load_nvme`` in batches of 10,000 as recovery does (records made
  in this process, no file written: the structures are what is measured), RSS growth per
  record less the key's length, and the time per record.
* :func:`measure_eviction`: the tier manager in this process (no socket: only the node's
  own structures are timed), two of them, filled with 10^4 and N chunks to exactly their
  DRAM size, 10 % pinned (half by leases, half landing: inserted by a put that has not
  committed), and those the *oldest*, where a walk from the coldest end meets them first.
  In interleaved rounds, puts that each evict one chunk (reserve, evict, insert) and
  lookups of 1,000 held keys (contains, get): p50 at N beside 1.2 times the p50 at 10^4.
  This is where memory latency shows: at N the structures are hundreds of MB, so every
  operation's few touches of a chunk's slot miss the CPU caches that hold all of 10^4.

Options for what fleets add to a chunk (docs/scale-node.md, "Tenants, pins and events"): ``--tenant
NAME`` fills as a tenant's client does (``tenant=NAME`` in the URL: every key ``~t/NAME/KEY``) with a
quota set that never binds, so the node's tenant accounting runs on every put; ``--event-ring-keys N``
starts both nodes with that event ring; ``--pin-share F`` pins that share of the large node's chunks
(``kvpool pin``'s path) once it is full and reads its RSS again: the growth per pinned key.
``--only node`` runs the first measurement alone (the others do not depend on these options).

What is simulated: the NVMe records (made in this process rather than read from 10^6
files: the scan is measured by ``bench.scale.nvme``; the node's cost per record is what
is measured here). Every DRAM chunk went through a real put (RSS) or the tier manager's
own reserve and insert (eviction). Results: docs/scale-node.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backend import admin
from backend.admin.pinning import PIN_BATCH
from backend.client.chunks import BytesSink, Hit
from backend.embedded import EmbeddedRedis
from backend.errors import CapacityError, ConfigError, PutOutcome
from backend.launch.nodes import NodeProcess
from backend.launch.processes import REPO
from backend.metadata import NodeInfo
from backend.node.memory.arena import room_of
from backend.node.store.dram import StoredChunk
from backend.node.store.eviction import ORDERS
from backend.node.store.nvme_format import NvmeFile
from backend.node.store.tiers import NVME, TierConfig, TierManager
from backend.protocol import ItemMeta, Op, checksum
from backend.protocol.meta import encode_keys
from backend.protocol.reads import GetBatch
from backend.tenants import check_tenant, scoped
from kvpool import Chunk, PoolClient, PoolConfig

__all__ = [
    "measure_eviction",
    "measure_nvme_records",
    "measure_node",
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
EVICTION_PUTS = 3000
ROUNDS = 30  # interleaved rounds on the real nodes, so both sizes see the same machine
EVICT_BATCH = 16  # chunks of a put into a full node (each evicts one)
LEASE_TTL_MS = 600_000
PINNED_SHARE = 0.10
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LAYERS = 32
UNBOUND_QUOTA_BYTES = 1 << 50  # a tenant quota no fill reaches: the accounting runs, it never evicts
PIN_TTL_S = 3600.0
MAX_PIN_SHARE = 0.5  # pins are taken among the chunks no round evicts
MEASURES = ("all", "node")


@dataclasses.dataclass(frozen=True)
class Extras:
    """What a fleet adds to every chunk, measured on the real nodes: a tenant's keys (with a quota that does
    not bind), the node's event ring, a share of the chunks pinned. The default adds nothing."""

    tenant: str = ""
    event_ring_keys: int = 0
    pin_share: float = 0.0

    def node_args(self) -> list[str]:
        return ["--event-ring-keys", str(self.event_ring_keys)] if self.event_ring_keys else []

    def url_query(self) -> str:
        return f"&tenant={self.tenant}" if self.tenant else ""

    def stored_key(self, key: str) -> str:
        """``key`` as the node holds it (a tenant client's keys carry its prefix)."""
        return scoped(self.tenant, key) if self.tenant else key

    def describe(self) -> str:
        parts = [f"tenant {self.tenant} (~t/{self.tenant}/KEY, quota not binding)"] if self.tenant else []
        parts += [f"event ring of {self.event_ring_keys:,} keys"] if self.event_ring_keys else []
        parts += [f"{self.pin_share:.1%} of the large node's chunks pinned"] if self.pin_share else []
        return ", ".join(parts) or "no tenant, no event ring, no pins"


def layerwise_key(i: int) -> str:
    """The i-th chunk's key as LMCache's layerwise mode spells it (``LayerCacheEngineKey.to_string``)."""
    chunk, layer = divmod(i, LAYERS)
    return f"{MODEL}@8@{chunk % 8}@{(chunk * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF:x}@bfloat16@{layer}"


# Every chunk carries a layout fingerprint, as an LMCache engine's do: what it costs a node is in the figures.
LAYOUT_FINGERPRINT = 0x6B76_706F_6F6C_0001


def value_of(i: int) -> bytes:
    return i.to_bytes(8, "little") * (VALUE_BYTES // 8)


def _pcts(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]}


# -- real node processes ------------------------------------------------------------------


async def fill(
    client: PoolClient, start: int, stop: int, *, node_id: str = "", in_flight: int = PUTS_IN_FLIGHT
) -> None:
    """Put chunks ``start``..``stop`` (to ``node_id`` alone, if named) in requests of PUT_BATCH, ``in_flight``
    at a time."""
    batches = [range(b, min(b + PUT_BATCH, stop)) for b in range(start, stop, PUT_BATCH)]
    queue = iter(batches)
    only = [node_id] if node_id else None

    async def worker() -> None:
        for batch in queue:
            chunks = [Chunk(layerwise_key(i), value_of(i), fingerprint=LAYOUT_FINGERPRINT) for i in batch]
            await client.put(chunks, only=only)

    await asyncio.gather(*(worker() for _ in range(in_flight)))


class _Held:
    """A node filled with ``held`` chunks, the oldest PINNED_SHARE of them under leases: which keys it holds
    while ROUNDS x EVICT_BATCH new chunks evict the oldest unpinned ones."""

    def __init__(self, info: NodeInfo, first: int, held: int, in_flight: int) -> None:
        self.info = info
        self.first = first  # its keys are layerwise_key(first) .. layerwise_key(first + held - 1)
        self.held = held
        self.pinned = int(held * PINNED_SHARE)
        # Requests in flight land in any order: past them, and past what the rounds evict, every key stays.
        self.first_kept = self.pinned + in_flight * PUT_BATCH + ROUNDS * EVICT_BATCH
        assert self.first_kept < held, f"{held} chunks are too few to measure"
        self.rng = random.Random(held)
        self.new = 0

    def sample(self) -> list[str]:
        """LOOKUP_KEYS keys the node holds: pinned ones and ones no round can have evicted, at random."""
        kept = self.pinned + (self.held - self.first_kept)
        picks = self.rng.sample(range(kept), LOOKUP_KEYS)  # distinct: a key asked twice is answered once
        return [self.key(i if i < self.pinned else i - self.pinned + self.first_kept) for i in picks]

    def key(self, i: int) -> str:
        return layerwise_key(self.first + i)

    def fresh(self) -> list[Chunk]:
        """EVICT_BATCH chunks the node never held: each one it takes evicts one."""
        self.new += EVICT_BATCH
        return [
            Chunk(f"fresh@{self.held}@{n}", value_of(n), fingerprint=LAYOUT_FINGERPRINT)
            for n in range(self.new - EVICT_BATCH, self.new)
        ]


async def _round(client: PoolClient, node: _Held, times: dict[str, list[float]], extras: Extras) -> None:
    """One put that evicts EVICT_BATCH chunks, then EXISTS_BATCH and GET_BATCH of LOOKUP_KEYS held keys sent
    straight to the node (no Redis in the way): milliseconds each."""
    started = time.perf_counter()
    try:
        await client.put(node.fresh(), only=[node.info.node_id])
    except CapacityError as exc:  # ``prefix`` refuses newcomers that would evict a chunk read as often
        assert set(exc.outcomes.values()) <= {PutOutcome.STORED, PutOutcome.NO_ROOM}, exc
    times["put_evicting"].append((time.perf_counter() - started) * 1000)
    keys = [extras.stored_key(key) for key in node.sample()]  # straight to the node: as it holds them
    meta = encode_keys(keys)
    conns = client.connections.to(node.info)
    started = time.perf_counter()
    flags = await conns.request(Op.EXISTS_BATCH, meta)
    times["exists"].append((time.perf_counter() - started) * 1000)
    started = time.perf_counter()
    get = GetBatch.encode_request(keys, LAYOUT_FINGERPRINT)
    sink = BytesSink(LAYOUT_FINGERPRINT)
    got = await conns.request(Op.GET_BATCH, get, keys=keys, sink=sink, expect_bytes=VALUE_BYTES * len(keys))
    times["get"].append((time.perf_counter() - started) * 1000)
    assert all(isinstance(outcome, Hit) for outcome in got) and len(flags), "a held key was not found"


def measure_node(chunks: int = DEFAULT_CHUNKS, eviction: str = "lru", extras: Extras = Extras()) -> dict[str, Any]:
    """Real nodes full of tiny chunks, one of SMALL_CHUNKS and one of ``chunks``: the large one's RSS per chunk
    (bookkeeping beyond each value's room and its key), and on both, with the oldest 10 % leased, puts that
    evict and EXISTS/GET of 1,000 keys, in interleaved rounds. ``extras``: a tenant, an event ring, pins."""
    room = room_of(VALUE_BYTES)
    redis = EmbeddedRedis().start()
    nodes: list[NodeProcess] = []
    try:
        config = PoolConfig.from_url(
            f"kvpool://127.0.0.1:{redis.port}/scale-node?shm=off&connect_timeout_s=60&progress_timeout_s=60"
            + extras.url_query()
        )
        if extras.tenant:  # before the nodes start: their first heartbeat reads it
            asyncio.run(_set_quota(config, extras.tenant))
        for node_id, held in (("small", SMALL_CHUNKS), ("large", chunks)):
            args = ["--redis", redis.url, "--namespace", "scale-node", "--dram", str(held * room), "--nvme", "0"]
            args += ["--eviction", eviction, *extras.node_args()]
            nodes.append(NodeProcess([*args, "--shm-dir", "off", "--prefault", "off", "--node-id", node_id]).start())
        return asyncio.run(_node_scenario(config, nodes[0], nodes[1], chunks, extras))
    finally:
        for node in nodes:
            node.stop()
        redis.cleanup()


async def _set_quota(config: PoolConfig, tenant: str) -> None:
    async with PoolClient(config) as client:
        await admin.set_quota(client, tenant, UNBOUND_QUOTA_BYTES)


async def _wait_quota(client: PoolClient, nodes: Sequence[NodeInfo], tenant: str) -> None:
    """Until every node has read the tenant's quota (at most a few heartbeats)."""
    deadline = time.monotonic() + 30
    for node in nodes:
        while (await client.node_admin.stats(node)).tenants.get(tenant) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node.node_id} did not read tenant {tenant}'s quota in 30 s")
            await asyncio.sleep(0.2)


async def _pin_share(client: PoolClient, node: _Held, extras: Extras) -> int:
    """Pin ``extras.pin_share`` of ``node``'s chunks, among those no round evicts, as ``kvpool pin KEY...``
    does (the operator's verb names keys as the nodes hold them: a tenant's with its prefix)."""
    count = int(node.held * extras.pin_share)
    assert node.first_kept + count <= node.held, f"--pin-share {extras.pin_share} is more than the kept chunks"
    keys = [extras.stored_key(node.key(i)) for i in range(node.first_kept, node.first_kept + count)]
    for start in range(0, len(keys), PIN_BATCH):
        await admin.pin(client, keys[start : start + PIN_BATCH], ttl_s=PIN_TTL_S, owner="bench")
    return count


async def _node_scenario(
    config: PoolConfig, small: NodeProcess, large: NodeProcess, chunks: int, extras: Extras
) -> dict[str, Any]:
    room = room_of(VALUE_BYTES)
    sampled = range(0, chunks, max(1, chunks // 1000))
    key_bytes = statistics.fmean(len(extras.stored_key(layerwise_key(i))) for i in sampled)
    async with PoolClient(config) as client:
        infos = {info.node_id: info for info in await client.nodes()}
        if extras.tenant:
            await _wait_quota(client, list(infos.values()), extras.tenant)
        await fill(client, chunks, chunks + SMALL_CHUNKS, node_id="small", in_flight=1)  # keys of its own
        warm = PUTS_IN_FLIGHT * PUT_BATCH  # the requests in flight leave their high-water mark: before the baseline
        await fill(client, 0, warm, node_id="large")
        rss_warm = large.memory()["VmRSS"]
        started = time.perf_counter()
        await fill(client, warm, chunks, node_id="large")
        fill_s = time.perf_counter() - started
        rss_full = large.memory()["VmRSS"]
        held = [_Held(infos["small"], chunks, SMALL_CHUNKS, 1), _Held(infos["large"], 0, chunks, PUTS_IN_FLIGHT)]
        pinned_chunks, rss_pinned = 0, rss_full
        if extras.pin_share:
            pinned_chunks = await _pin_share(client, held[1], extras)
            rss_pinned = large.memory()["VmRSS"]
        leases = []
        for node in held:
            pinned = [node.key(i) for i in range(node.pinned)]
            for start in range(0, len(pinned), PUT_BATCH):
                leases += await client.lock(pinned[start : start + PUT_BATCH], LEASE_TTL_MS)
        assert all(lease is not None for lease in leases), "a chunk to pin was not found"
        times: list[dict[str, list[float]]] = [{"put_evicting": [], "exists": [], "get": []} for _ in held]
        for r in range(ROUNDS):  # interleaved, each size first in every other round
            for node, samples in list(zip(held, times))[:: 1 if r % 2 else -1]:
                await _round(client, node, samples, extras)
        stats = await client.node_stats(infos["large"])
        await client.unlock([lease for lease in leases if lease is not None])
    dram = stats["tiers"]["dram"]
    answered = stats["counters"].get("evictions", 0) + stats["counters"].get("put_rejected_capacity", 0)
    assert dram["objects"] == chunks and answered == ROUNDS * EVICT_BATCH  # each new chunk evicted one, or was refused
    growth = (rss_full - rss_warm) / (chunks - warm)
    if pinned_chunks:
        assert stats["pinned_chunks"] == pinned_chunks, stats["pinned_chunks"]
    if extras.tenant:  # the accounting ran: every chunk the large node holds is the tenant's
        assert stats["tenants"][extras.tenant]["held_bytes"] == dram["objects"] * VALUE_BYTES, stats["tenants"]
    figures = {name: (_pcts(times[0][name]), _pcts(times[1][name])) for name in times[0]}
    return {
        "extras": dataclasses.asdict(extras),
        "pinned_chunks": pinned_chunks,
        "pin_rss_per_pinned_key_bytes": (rss_pinned - rss_full) / pinned_chunks if pinned_chunks else 0.0,
        "chunks": chunks,
        "value_bytes": VALUE_BYTES,
        "value_room_bytes": room,
        "key_bytes_mean": key_bytes,
        "fill_chunks_per_s": (chunks - warm) / fill_s,
        "rss_small_node_bytes": small.memory()["VmRSS"],
        "rss_warm_bytes": rss_warm,
        "rss_bytes": rss_full,
        "rss_growth_per_chunk_bytes": growth,
        "overhead_per_chunk_bytes": growth - room - key_bytes,  # beyond the value's room and the key
        "overhead_beyond_value_bytes": growth - VALUE_BYTES - key_bytes,  # the cell's slack counted in
        "dram_used_bytes": dram["used_bytes"],
        "small_ms": {name: small_figures for name, (small_figures, _) in figures.items()},
        "large_ms": {name: large_figures for name, (_, large_figures) in figures.items()},
    }


# -- the tier manager in this process ---------------------------------------------------


async def _filled(held: int, eviction: str) -> tuple[TierManager, list[str]]:
    """A tier manager holding ``held`` chunks (DRAM exactly full), the oldest PINNED_SHARE pinned."""
    room = room_of(VALUE_BYTES)
    tiers = TierManager(TierConfig(dram_bytes=held * room, eviction=eviction))
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
        tiers.leasing.lock(keys[start : min(start + 100, landing + leased)], 600_000)
    return tiers, keys


async def _evicting_puts(tiers: TierManager, start: int, count: int, times: list[float]) -> None:
    """``count`` puts into a full DRAM, each evicting one chunk (reserve, evict, insert): microseconds each."""
    room = room_of(VALUE_BYTES)
    for n in range(start, start + count):
        buffer = memoryview(bytearray(value_of(n)))
        meta = ItemMeta(f"new@{n}", VALUE_BYTES, checksum(buffer), "uint8", (VALUE_BYTES,), 1)
        started = time.perf_counter()
        await tiers.reserve(room)
        tiers.insert(StoredChunk(meta, buffer))
        times.append((time.perf_counter() - started) * 1e6)


async def _lookups(tiers: TierManager, keys: list[str], rng: random.Random, times: dict[str, list[float]]) -> None:
    """contains() and get() of LOOKUP_KEYS of ``keys`` (all held) at random: milliseconds per 1,000."""
    sample = rng.sample(keys, LOOKUP_KEYS)
    started = time.perf_counter()
    found = sum(tiers.contains(key) for key in sample)
    times["contains"].append((time.perf_counter() - started) * 1000)
    started = time.perf_counter()
    for key in sample:
        await tiers.get(key)
    times["get"].append((time.perf_counter() - started) * 1000)
    assert found == LOOKUP_KEYS, "a held key was not found"


async def _eviction_scenario(chunks: int, eviction: str) -> dict[str, Any]:
    sizes = (SMALL_CHUNKS, chunks)
    managers = [await _filled(held, eviction) for held in sizes]
    try:
        pinned = [int(held * PINNED_SHARE) for held in sizes]
        # The puts evict the oldest unpinned chunks, in order: past them, every key stays.
        kept = [keys[:p] + keys[p + EVICTION_PUTS :] for (_, keys), p in zip(managers, pinned)]
        rngs = [random.Random(held) for held in sizes]
        puts: list[list[float]] = [[], []]
        lookups: list[dict[str, list[float]]] = [{"contains": [], "get": []}, {"contains": [], "get": []}]
        per_round = EVICTION_PUTS // ROUNDS
        for r in range(ROUNDS):  # interleaved, each size first in every other round: both see the same machine
            for i in (0, 1) if r % 2 else (1, 0):
                tiers = managers[i][0]
                await _evicting_puts(tiers, r * per_round, per_round, puts[i])
                await _lookups(tiers, kept[i], rngs[i], lookups[i])
        for (tiers, _), held in zip(managers, sizes):
            assert tiers.counters["evictions"] == per_round * ROUNDS and len(tiers) == held  # each put evicted one
        figures = [
            {
                "held": held,
                "pinned": p,
                "put_evicting_us": _pcts(puts[i]),
                "contains_1000_ms": _pcts(lookups[i]["contains"]),
                "get_1000_ms": _pcts(lookups[i]["get"]),
            }
            for i, (held, p) in enumerate(zip(sizes, pinned))
        ]
    finally:
        for tiers, _ in managers:
            await tiers.close()
    small, large = figures
    return {
        "small": small,
        "large": large,
        "put_evicting_ratio": large["put_evicting_us"]["p50"] / small["put_evicting_us"]["p50"],
        "contains_ratio": large["contains_1000_ms"]["p50"] / small["contains_1000_ms"]["p50"],
        "get_ratio": large["get_1000_ms"]["p50"] / small["get_1000_ms"]["p50"],
    }


def measure_eviction(chunks: int = DEFAULT_CHUNKS, eviction: str = "lru") -> dict[str, Any]:
    """A put's eviction cost and lookups of 1,000 keys in the tier manager at SMALL_CHUNKS and ``chunks`` held,
    10 % pinned (the oldest), measured in interleaved rounds; the ratios beside TARGET_RATIO."""
    return asyncio.run(_eviction_scenario(chunks, eviction))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_nvme_records(chunks: int = DEFAULT_CHUNKS, batch: int = 10_000) -> dict[str, Any]:
    """What an NVMe file costs the node: ``chunks`` records handed to ``StoreUpkeep.load_nvme`` in batches, as
    recovery does (records made there, no file written: only the node's structures are measured), in a fresh
    Python process (one whose heap held other things would grow less); its RSS growth per record less the
    key's length, and the time per record."""
    code = f"import json, bench.scale.node as b; print(json.dumps(b.nvme_records_here({chunks}, {batch})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    figures: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return figures


def nvme_records_here(chunks: int, batch: int) -> dict[str, Any]:
    """:func:`measure_nvme_records` in this process. RSS is read once the first batch is in (a batch's
    records and their objects leave their high-water mark, whatever the tier then holds) and at the end."""
    assert chunks > batch, f"--chunks must be more than a batch of {batch:,} records"
    with tempfile.TemporaryDirectory() as root:
        tiers = TierManager(TierConfig(dram_bytes=1 << 20, nvme_dir=Path(root), nvme_bytes=1 << 50))
        key_bytes = statistics.fmean(len(layerwise_key(i)) for i in range(0, chunks, max(1, chunks // 1000)))
        spent = 0.0
        before = 0
        for start in range(0, chunks, batch):
            records = [
                NvmeFile("", ItemMeta(layerwise_key(i), 1 << 20, i, "bfloat16", (2, 8, 256, 128), 1), 256)
                for i in range(start, min(start + batch, chunks))
            ]
            started = time.perf_counter()
            tiers.upkeep.load_nvme(records)
            spent += time.perf_counter() - started
            if not start:
                gc.collect()
                before = _rss_bytes()
        del records
        gc.collect()
        grown = _rss_bytes() - before
        assert tiers.tier_reports()[NVME].objects == chunks
        asyncio.run(tiers.close())
    return {
        "records": chunks,
        "overhead_per_record_bytes": grown / (chunks - batch) - key_bytes,
        "load_us_per_record": spent / chunks * 1e6,
        "batch": batch,
        "batch_ms": spent / -(-chunks // batch) * 1000,
    }


# -- the report --------------------------------------------------------------------------


def _row(name: str, measured: str, target: str, ok: bool) -> str:
    return f"  {name:<48} {measured:>22}   target {target:<14} {'ok' if ok else 'OVER'}"


def _ratio_row(label: str, small: float, large: float, unit: str, n: str) -> str:
    return _row(
        f"{label} at {n}",
        f"{large:.2f} {unit} ({large / small:.2f}x)",
        f"<= 1.2x {small:.2f}",
        large <= TARGET_RATIO * small,
    )


def run(
    chunks: int = DEFAULT_CHUNKS, eviction: str = "lru", extras: Extras = Extras(), only: str = "all"
) -> dict[str, Any]:
    """The three measurements at ``chunks`` (``only="node"``: the real nodes' alone), printed beside the targets;
    the figures as a dict."""
    node = measure_node(chunks, eviction, extras)
    n, s = f"{chunks:,}", f"{SMALL_CHUNKS:,}"
    print(
        f"node memory and eviction at {n} chunks ({VALUE_BYTES}-byte values, layerwise LMCache keys), --eviction "
        f"{eviction}; {extras.describe()}"
    )
    print(
        f"  fill through the put path: {node['fill_chunks_per_s']:,.0f} chunks/s; node RSS "
        f"{node['rss_small_node_bytes'] / 2**20:.0f} MiB holding {s}, {node['rss_bytes'] / 2**20:.0f} MiB holding {n}"
    )
    overhead = node["overhead_per_chunk_bytes"]
    print(_row("node bookkeeping per chunk (beyond room + key)", f"{overhead:.0f} B", "<= 256 B", overhead <= 256))
    print(
        f"  (RSS growth {node['rss_growth_per_chunk_bytes']:.0f} B/chunk = value room {node['value_room_bytes']} B "
        f"+ key {node['key_bytes_mean']:.0f} B + bookkeeping; beyond the raw value "
        f"{node['overhead_beyond_value_bytes']:.0f} B)"
    )
    if node["pinned_chunks"]:
        print(
            f"  {node['pinned_chunks']:,} chunks pinned: RSS grew {node['pin_rss_per_pinned_key_bytes']:.0f} B per "
            f"pinned key ({node['pin_rss_per_pinned_key_bytes'] * node['pinned_chunks'] / chunks:.1f} B per chunk held)"
        )
    nvme: dict[str, Any] = {}
    if only == "all":
        nvme = measure_nvme_records(chunks)
        records = nvme["overhead_per_record_bytes"]
        print(
            _row(f"an NVMe file's record (beyond the key), {n} files", f"{records:.0f} B", "<= 256 B", records <= 256)
        )
        print(
            f"  (recovery's records adopted at {nvme['load_us_per_record']:.1f} us each: "
            f"{nvme['batch_ms']:.0f} ms of the node's loop per batch of {nvme['batch']:,})"
        )
    print(
        f"  real nodes full at {s} and {n}, the oldest {PINNED_SHARE:.0%} leased, p50 of {ROUNDS} interleaved rounds:"
    )
    for label, name in (
        (f"a put of {EVICT_BATCH} chunks that evicts {EVICT_BATCH}", "put_evicting"),
        ("EXISTS_BATCH of 1,000 keys, to the node", "exists"),
        ("GET_BATCH of 1,000 keys, from the node", "get"),
    ):
        print(_ratio_row(label, node["small_ms"][name]["p50"], node["large_ms"][name]["p50"], "ms", n))
    if only != "all":
        return {"node": node}
    evicting = measure_eviction(chunks, eviction)
    print(f"  the tier manager alone (no socket), the oldest {PINNED_SHARE:.0%} pinned (leases and landing puts):")
    for label, name, unit in (
        ("a put that evicts one chunk", "put_evicting_us", "us"),
        ("contains() of 1,000 keys", "contains_1000_ms", "ms"),
        ("get() of 1,000 keys", "get_1000_ms", "ms"),
    ):
        small, large = evicting["small"][name]["p50"], evicting["large"][name]["p50"]
        print(_ratio_row(label, small, large, unit, n))
    return {"node": node, "eviction": evicting, "nvme_records": nvme}


def _share(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= share <= MAX_PIN_SHARE:
        raise argparse.ArgumentTypeError(f"{share:g} is not a share in [0, {MAX_PIN_SHARE}] (0.01: 1 %)")
    return share


def _tenant(text: str) -> str:
    try:
        return check_tenant(text, "--tenant")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS, help="chunks held at the large size")
    parser.add_argument("--eviction", choices=sorted(ORDERS), default="lru", help="the nodes' eviction order")
    parser.add_argument(
        "--tenant", type=_tenant, help="fill as this tenant's client (~t/NAME/KEY), its quota not binding"
    )
    parser.add_argument("--event-ring-keys", type=int, default=0, metavar="N", help="the nodes' event ring (0: off)")
    parser.add_argument(
        "--pin-share", type=_share, default=0.0, metavar="F", help="pin this share of the large node's chunks (0.01)"
    )
    parser.add_argument(
        "--only", choices=MEASURES, default="all", help="node: the real nodes alone (what the options above change)"
    )
    args = parser.parse_args(argv)
    if args.chunks <= SMALL_CHUNKS:
        parser.error(f"--chunks must be more than {SMALL_CHUNKS:,}")
    if args.event_ring_keys < 0:
        parser.error(f"--event-ring-keys {args.event_ring_keys} is negative (0: off)")
    run(args.chunks, args.eviction, Extras(args.tenant or "", args.event_ring_keys, args.pin_share), args.only)


if __name__ == "__main__":
    main()
