"""DRAM -> NVMe tiering, safetensors files, restart recovery and integrity."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from backend.config import format_size, parse_size
from backend.metadata import MetadataStore
from backend.node.index.recovery import scan
from backend.node.store.dram import StoredChunk
from backend.node.store.nvme_format import CHUNKS_DIR, chunk_path, read_header, write_chunk
from backend.node.store.tiers import DRAM, NVME, TierConfig, TierManager
from backend.protocol import ItemMeta, checksum
from kvpool import CapacityError, Chunk, NodeUnavailable, PoolConfig, SyncPoolClient
from tests.support.recovery import wait_recovered
from tests.support.waits import until, wait_until

KIB = 1024


def _chunks(prefix: str, count: int, size: int, seed: int = 0) -> list[Chunk]:
    rng = random.Random(seed)
    return [Chunk(f"{prefix}@{i}", rng.randbytes(size)) for i in range(count)]


def _stored(key: str, size: int, seed: int = 0) -> StoredChunk:
    data = bytearray(random.Random(seed).randbytes(size))
    return StoredChunk(ItemMeta(key, size, checksum(data), "uint8", (size,), 0), data)


def _index(redis_url: str, namespace: str, keys: list[str]) -> list[list]:
    async def lookup() -> list[list]:
        store = MetadataStore(redis_url, namespace)
        try:
            return await store.index.lookup(keys)
        finally:
            await store.close()

    return asyncio.run(lookup())


def _nvme_node(node_factory, tmp_path: Path, dram: str = "1MiB", nvme: str = "64MiB", **kw):
    return node_factory("--nvme-dir", str(tmp_path / "nvme"), "--nvme", nvme, dram=dram, **kw)


# -- through real node processes ------------------------------------------------------


def test_puts_larger_than_dram_spill_to_nvme_and_all_read_back(
    node_factory, pool_url, redis_server, namespace, tmp_path
):
    _nvme_node(node_factory, tmp_path)
    chunks = _chunks("spill", 24, 128 * KIB)  # 3 MiB into 1 MiB of DRAM
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        for chunk in chunks:
            client.put([chunk])
        keys = [c.key for c in chunks]

        def tiers() -> list[str]:
            return [entry[0].tier if entry else "missing" for entry in _index(redis_server.url, namespace, keys)]

        assert wait_until(lambda: tiers().count(NVME) >= 16, 5.0), tiers()
        assert "missing" not in tiers()
        stats = client.node_stats(client.nodes()[0])
        assert stats["counters"]["demotions"] >= 16
        assert stats["tiers"]["nvme"]["objects"] >= 16
        got = client.get(keys)
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]


def test_flipped_byte_on_disk_is_a_miss_quarantined_and_unindexed(
    node_factory, pool_url, redis_server, namespace, tmp_path
):
    _nvme_node(node_factory, tmp_path)
    chunks = _chunks("flip", 16, 128 * KIB)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        for chunk in chunks:
            client.put([chunk])
        victim = chunks[0]  # the oldest: demoted first, no longer in DRAM
        path = chunk_path(tmp_path / "nvme", victim.key)
        assert wait_until(path.exists, 5.0)
        record = read_header(path)
        with open(path, "r+b") as f:
            f.seek(record.data_offset + 1000)
            byte = f.read(1)
            f.seek(record.data_offset + 1000)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert client.get([victim.key]) == [None]
        assert not path.exists()
        assert (tmp_path / "nvme" / "quarantine" / path.name).exists()
        assert wait_until(lambda: _index(redis_server.url, namespace, [victim.key]) == [[]], 5.0)
        stats = client.node_stats(client.nodes()[0])
        assert stats["counters"]["integrity_failures"] == 1
        others = client.get([c.key for c in chunks[1:]])
        assert [bytes(g.data) for g in others] == [bytes(c.data) for c in chunks[1:]]


def test_kill_9_mid_writes_then_restart_serves_every_acknowledged_nvme_chunk(node_factory, pool_url, tmp_path):
    nvme_dir = tmp_path / "nvme"
    node = _nvme_node(node_factory, tmp_path, dram="2MiB", nvme="256MiB")
    config = PoolConfig.from_url(pool_url + "?progress_timeout_s=1")
    acked: dict[str, bytes] = {}
    stop = threading.Event()

    def writer() -> None:
        with SyncPoolClient(config) as client:
            for i in range(2000):
                if stop.is_set():
                    return
                batch = _chunks(f"kill{i}", 4, 64 * KIB, seed=i)
                try:
                    client.put(batch)
                except (CapacityError, NodeUnavailable, Exception):  # the node dies under us
                    return
                acked.update({c.key: bytes(c.data) for c in batch})

    thread = threading.Thread(target=writer)
    thread.start()
    assert wait_until(lambda: len(acked) >= 200, 30.0)
    node.kill()  # SIGKILL, mid-write
    stop.set()
    thread.join(30)
    on_disk = {}
    for path in (nvme_dir / CHUNKS_DIR).rglob("*.safetensors"):
        try:
            on_disk[read_header(path).meta.key] = path
        except ValueError:
            pass  # a torn file: must not be served (checked below)
    # debris a crash can leave: a temp file and a truncated chunk file
    planted_tmp = nvme_dir / CHUNKS_DIR / "00" / "deadbeef.tmp"
    planted_tmp.parent.mkdir(parents=True, exist_ok=True)
    planted_tmp.write_bytes(b"partial")
    torn_key = "torn@key"
    torn = Path(write_chunk(nvme_dir, ItemMeta(torn_key, 4096, 0, "uint8", (4096,), 0), bytes(4096)).path)
    with open(torn, "r+b") as f:
        f.truncate(torn.stat().st_size - 100)

    survivors = [k for k in acked if k in on_disk]
    assert len(survivors) >= 100  # most acknowledged chunks had reached the disk
    restarted = _nvme_node(node_factory, tmp_path, dram="2MiB", nvme="256MiB")
    assert restarted.node_id == node.node_id and restarted.epoch > node.epoch
    with SyncPoolClient(config) as client:
        assert wait_recovered(client)  # it serves while recovery runs: keys become hits as they are indexed
        assert client.hit_prefix(survivors) == len(survivors)
        got = client.get(survivors)
        assert all(g is not None and bytes(g.data) == acked[k] for k, g in zip(survivors, got, strict=True))
        assert client.get([torn_key]) == [None]
        stats = client.node_stats(client.nodes()[0])
    assert stats["recovery"]["files"] == len(on_disk)
    assert stats["recovery"]["temp_removed"] >= 1 and stats["recovery"]["quarantined"] == 1
    assert not planted_tmp.exists()
    assert not list((nvme_dir / CHUNKS_DIR).rglob("*.tmp"))
    assert (nvme_dir / "quarantine" / torn.name).exists()


@pytest.fixture
def tiny_disk(tmp_path):
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip("mounting a 3 MiB tmpfs needs root (CI runs as root)")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


class _Writer(threading.Thread):
    """Puts one new 128 KiB chunk every ``interval_s`` until stopped; keeps every chunk and every error."""

    def __init__(self, pool_url: str, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pool_url, self.interval_s = pool_url, interval_s
        self.stored: list[Chunk] = []
        self.errors: list[BaseException] = []
        self._halt = threading.Event()

    def run(self) -> None:
        with SyncPoolClient(PoolConfig.from_url(self.pool_url)) as client:
            n = 0
            while not self._halt.is_set():
                chunk = _chunks(f"w{n}", 1, 128 * KIB, seed=n)[0]
                n += 1
                try:
                    client.put([chunk])
                    self.stored.append(chunk)
                except Exception as exc:  # every failure is the finding
                    self.errors.append(exc)
                self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def test_a_full_disk_keeps_dram_writable_and_pauses_demotion_until_a_chunk_and_a_margin_are_free(
    node_factory, pool_url, tiny_disk
):
    """A 3 MiB tmpfs under a 64 MiB NVMe tier and a writer that never stops: every put succeeds (DRAM
    evicts its oldest chunks while the disk is full), one episode is one counter step and one log line,
    freeing less than a chunk plus the margin does not end it, freeing more does, and demotion resumes."""
    from backend.node.store.nvme_tier import DISK_RECHECK_S, DISK_RESUME_MARGIN_BYTES

    node = node_factory("--nvme-dir", str(tiny_disk), "--nvme", "64MiB", "--node-id", "tiny", dram="1MiB")
    writer = _Writer(pool_url)
    writer.start()
    try:
        with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
            info = client.nodes()[0]

            def counters() -> dict:
                return client.node_stats(info)["counters"]

            assert wait_until(lambda: counters().get("disk_full", 0) == 1, 60.0), counters()
            stats = client.node_stats(info)
            assert stats["tiers"]["nvme"]["disk_full"] is True
            assert wait_until(lambda: counters().get("evictions", 0) >= 4, 30.0)  # puts keep landing meanwhile
            assert node.log.count("disk full") == 1

            # Free less than one chunk plus the margin: two files of the oldest chunks, which went to disk.
            first = writer.stored[:16]
            assert client.delete([c.key for c in first[:2]]) == 2
            assert 2 * 128 * KIB < 128 * KIB + DISK_RESUME_MARGIN_BYTES
            writes_before = counters().get("nvme_writes", 0)
            # Two rechecks after the delete (the first may have read the disk before it): both saw too little room.
            rechecks = counters().get("disk_rechecks", 0)
            assert wait_until(lambda: counters().get("disk_rechecks", 0) >= rechecks + 2, 30 * DISK_RECHECK_S)
            assert client.node_stats(info)["tiers"]["nvme"]["disk_full"] is True, "the episode ended too early"
            assert counters()["disk_full"] == 1 and counters().get("nvme_writes", 0) == writes_before
            assert "free again" not in node.log

            # Free well past it: demotion resumes, in one log line.
            client.delete([c.key for c in first[2:]])
            assert wait_until(lambda: "free again" in node.log, 10 * DISK_RECHECK_S)
            assert wait_until(lambda: counters().get("nvme_writes", 0) > writes_before, 30.0)
            assert node.log.count("free again") == 1
            episodes = counters()["disk_full"]
            assert node.log.count("disk full") == episodes  # a new episode, if the writer filled it again
        writer.stop()
        assert writer.errors == [], writer.errors[:3]
        with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
            kept = writer.stored[16:]
            got = client.get([c.key for c in kept])
            assert all(g is None or bytes(g.data) == bytes(c.data) for g, c in zip(got, kept))  # never wrong bytes
            assert all(g is not None for g in got[-4:])  # the newest are in DRAM
    finally:
        writer.stop()
    assert node.alive()


def test_nvme_file_loads_with_safetensors_and_equals_what_lmcache_stored(node_factory, pool_url, tmp_path):
    from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config

    _nvme_node(node_factory, tmp_path, dram="3MiB")
    stack = LMCacheStack(kvpool_lmcache_config(pool_url))
    try:
        keys = [stack.key(900 + i) for i in range(3)]
        objs = [stack.make_object(i) for i in range(3)]  # 2 MiB each: the first must be demoted
        stack.put(keys, objs)
        stack.release(objs)
        path = chunk_path(tmp_path / "nvme", keys[0].to_string())
        assert wait_until(path.exists, 5.0)
        tensors = load_file(str(path))
        assert list(tensors) == ["kv"]
        assert tensors["kv"].dtype == torch.bfloat16 and tensors["kv"].shape == stack.shape
        assert torch.equal(tensors["kv"].view(torch.uint8), stack.expected_tensor(0).view(torch.uint8))
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        assert meta["key"] == keys[0].to_string() and meta["fmt"] == "1" and meta["kvpool_format"] == "1"
        got = stack.get(keys[:1])  # read back from NVMe through LMCache
        assert torch.equal(got[0].tensor.view(torch.uint8), stack.expected_tensor(0).view(torch.uint8))
        stack.release(got)
    finally:
        stack.close()


# -- the tier manager in-process, for exact LRU scripts -------------------------------


async def test_lru_demotes_the_least_recently_used_and_promotes_an_nvme_hit(tmp_path):
    tiers = TierManager(TierConfig(dram_bytes=4 * 64 * KIB, nvme_dir=tmp_path, nvme_bytes=16 * 64 * KIB))
    try:
        for i, key in enumerate("ABCD"):
            await tiers.reserve(64 * KIB)
            tiers.insert(_stored(key, 64 * KIB, seed=i))
        await tiers.get("A")  # A is now the most recent; B the least
        await tiers.reserve(64 * KIB)
        tiers.insert(_stored("E", 64 * KIB, seed=5))
        assert [tiers.tier_of(k) for k in "ABCDE"] == [DRAM, NVME, DRAM, DRAM, DRAM]
        assert tiers.upkeep.take_changes() == (set(), {"B": NVME})
        chunk = await tiers.get("B")  # an NVMe hit: verified and promoted, C (now LRU) demoted
        assert chunk is not None and bytes(chunk.buffer) == bytes(_stored("B", 64 * KIB, seed=1).buffer)
        assert [tiers.tier_of(k) for k in "ABCDE"] == [DRAM, DRAM, NVME, DRAM, DRAM]
        assert tiers.counters["promotions"] == 1 and tiers.counters["demotions"] == 2
        assert tiers.tier_reports()[NVME].objects == 2  # B's file stays beside C's: re-demotion is free
        assert len(tiers) == 5  # B is in DRAM and on disk: one key
        page, more = tiers.page("", 3)
        assert [(item.key, tier) for item, tier in page] == [("A", DRAM), ("B", DRAM), ("C", NVME)] and more
        page, more = tiers.page("C", 3)
        assert [item.key for item, _ in page] == ["D", "E"] and not more
    finally:
        await tiers.close()


async def test_nvme_evicts_its_oldest_file_when_full_and_reports_it(tmp_path):
    tiers = TierManager(TierConfig(dram_bytes=64 * KIB, nvme_dir=tmp_path, nvme_bytes=3 * (64 + 4) * KIB))
    try:
        for i in range(5):
            await tiers.reserve(64 * KIB)
            tiers.insert(_stored(f"k{i}", 64 * KIB, seed=i))
        # k0..k3 went to disk in turn; disk holds 3, so k0 was evicted
        assert tiers.tier_of("k0") is None and tiers.counters["nvme_evictions"] == 1
        assert "k0" in tiers.upkeep.take_changes()[0]
        assert [tiers.tier_of(f"k{i}") for i in range(1, 5)] == [NVME, NVME, NVME, DRAM]
        assert await tiers.get("k0") is None
    finally:
        await tiers.close()


async def test_background_demotion_keeps_dram_under_the_high_watermark(tmp_path):
    tiers = TierManager(TierConfig(dram_bytes=10 * 64 * KIB, nvme_dir=tmp_path, nvme_bytes=64 * 64 * KIB))
    tiers.start()
    try:
        for i in range(10):
            await tiers.reserve(64 * KIB)
            tiers.insert(_stored(f"w{i}", 64 * KIB, seed=i))
        # 100% > 90% high watermark: the demoter brings DRAM down to the 80% low one
        await until(lambda: tiers.dram_used_bytes <= 8 * 64 * KIB, timeout_s=30.0)  # two fsyncs, on a loaded disk
        assert tiers.dram_used_bytes == 8 * 64 * KIB
        assert [tiers.tier_of(f"w{i}") for i in range(3)] == [NVME, NVME, DRAM]
    finally:
        await tiers.close()


def test_recovery_scan_reads_headers_orders_by_age_and_quarantines_garbage(tmp_path):
    records = []
    for i in range(5):
        records.append(write_chunk(tmp_path, _stored(f"r{i}", 1000 + i, seed=i).meta, bytes(1000 + i)))
        os.utime(records[-1].path, (1_000_000 + i, 1_000_000 + i))
    garbage = chunk_path(tmp_path, "garbage")
    garbage.parent.mkdir(parents=True, exist_ok=True)
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    found, report = scan(tmp_path)
    assert [r.meta.key for r in found] == [f"r{i}" for i in range(5)]
    assert report.files == 5 and report.quarantined == 1
    assert (tmp_path / "quarantine" / garbage.name).exists()


def test_buffer_factory_hands_out_prefaulted_buffers_of_recent_sizes_within_budget():
    import time as _time

    from backend.node.memory.buffers import BufferFactory

    factory = BufferFactory(budget_bytes=4 * 64 * KIB)
    try:
        first = factory.take(64 * KIB)  # cold: allocated inline
        assert len(first) == 64 * KIB and factory.misses == 1
        deadline = _time.monotonic() + 5
        while factory._ready_bytes < 4 * 64 * KIB and _time.monotonic() < deadline:
            _time.sleep(0.01)
        assert factory._ready_bytes == 4 * 64 * KIB  # filled up to the budget, no further
        warm = factory.take(64 * KIB)
        assert factory.hits == 1 and len(warm) == 64 * KIB
        warm[:3] = b"abc"  # writable, exactly the size asked for
        assert bytes(warm[:3]) == b"abc"
        for size in (1000, 2000, 3000, 4000):  # newer sizes push the oldest out of the pool
            factory.take(size)
        assert 64 * KIB not in factory._ready
    finally:
        factory.close()


def test_a_batch_larger_than_the_node_is_refused_whole_naming_the_sizes_and_evicts_nothing(node_factory, pool_url):
    node_factory(dram="1MiB")  # no NVMe tier: 1 MiB is all the node can ever hold
    earlier = _chunks("earlier", 1, 256 * KIB)
    chunks = _chunks("too-large", 8, 256 * KIB)
    # One connection: the batch reaches the node as one request of 2 MiB.
    with SyncPoolClient(PoolConfig.from_url(f"{pool_url}?connections_per_node=1")) as client:
        client.put(earlier)
        with pytest.raises(CapacityError, match=r"8 chunks, 2097152 bytes in all, is larger than .* \(1048576 bytes"):
            client.put(chunks)
        assert client.contains([c.key for c in chunks]) == [False] * 8  # none stored, none acknowledged
        got = client.get([earlier[0].key])[0]
        assert got is not None and bytes(got.data) == bytes(earlier[0].data)  # nothing evicted for it
        client.put(chunks[:3])  # the connection stayed in step: the next put is stored
        assert client.contains([c.key for c in chunks[:3]]) == [True] * 3


async def test_a_delete_during_an_nvme_read_is_not_undone_by_promotion(tmp_path, monkeypatch):
    import backend.node.store.nvme_tier as tiers_module

    tiers = TierManager(TierConfig(dram_bytes=64 * KIB, nvme_dir=tmp_path, nvme_bytes=1 << 20))
    try:
        for i, key in enumerate("PQ"):
            await tiers.reserve(64 * KIB)
            tiers.insert(_stored(key, 64 * KIB, seed=i))
        assert tiers.tier_of("P") == NVME
        real_read = tiers_module.read_payload

        def slow_read(record, into):  # the bytes are read; the thread is slow to return
            import time as _time

            real_read(record, into)
            _time.sleep(0.2)

        monkeypatch.setattr(tiers_module, "read_payload", slow_read)
        reading = asyncio.ensure_future(tiers.get("P"))
        await asyncio.sleep(0.05)
        assert await tiers.delete("P")
        assert await reading is None
        assert not tiers.contains("P")
    finally:
        await tiers.close()


async def test_a_delete_during_a_demotion_leaves_no_file_behind(tmp_path, monkeypatch):
    import backend.node.store.nvme_tier as tiers_module

    tiers = TierManager(TierConfig(dram_bytes=64 * KIB, nvme_dir=tmp_path, nvme_bytes=1 << 20))
    try:
        await tiers.reserve(64 * KIB)
        tiers.insert(_stored("D", 64 * KIB))
        real_write = tiers_module.write_chunk

        def slow_write(*args, **kwargs):
            import time as _time

            _time.sleep(0.2)
            return real_write(*args, **kwargs)

        monkeypatch.setattr(tiers_module, "write_chunk", slow_write)
        demoting = asyncio.ensure_future(tiers.reserve(64 * KIB))  # D must move to disk first
        await asyncio.sleep(0.05)
        assert await tiers.delete("D")
        await demoting
        tiers.release(64 * KIB)
        assert not tiers.contains("D")
        assert not list((tmp_path / "chunks").rglob("*.safetensors"))
    finally:
        await tiers.close()


def test_a_put_striped_over_two_connections_fills_a_small_dram_without_refusals(node_factory, pool_url, tmp_path):
    """The node receives both stripes of a put at once; their windows' reservations can fill a small
    DRAM, and a chunk that finds nothing evictable waits for the other window to land (and become
    demotable) instead of being refused."""
    _nvme_node(node_factory, tmp_path, dram="4MiB")
    chunks = _chunks("striped", 8, 1024 * KIB)  # twice the DRAM, in one call
    with SyncPoolClient(PoolConfig.from_url(f"{pool_url}?connections_per_node=2")) as client:
        for _ in range(3):
            client.put(chunks)  # raised CapacityError for the chunks of one stripe
        got = client.get([c.key for c in chunks])
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]


def test_the_chunk_table_counts_in_o1_and_pages_in_key_order_through_adds_and_removes():
    """A reference set of the same operations, sorted from scratch, gives every page: the incremental
    order never drifts, even across bucket splits, emptied buckets and reused slots, and a key in two
    tiers counts once."""
    import random

    from backend.node.store.bookkeeping import IN_DRAM, NO_SLOT, ON_NVME, ChunkTable
    from backend.node.store.keys import BUCKET_KEYS

    rng = random.Random(7)
    table, where = ChunkTable(), {}
    for _ in range(20 * BUCKET_KEYS):
        key = f"k{rng.randrange(4 * BUCKET_KEYS):05d}"
        tier = rng.choice((IN_DRAM, ON_NVME))
        if rng.random() < 0.6:
            table.enter(ItemMeta(key, 8, hash(key) & 0xFFFF, "uint8", (8,), 0), tier)
            where[key] = where.get(key, 0) | tier
        else:
            slot = table.slot(key)
            if slot != NO_SLOT and table.where[slot] & tier:
                table.leave(slot, tier)
            if where.get(key, 0) & ~tier:
                where[key] &= ~tier
            else:
                where.pop(key, None)
    assert len(table) == len(where)
    assert {key: table.where[table.slot(key)] for key in where} == where
    assert all(table.meta(table.slot(key)).checksum == hash(key) & 0xFFFF for key in where)
    assert len(table.layouts) == 1  # one layout, shared by every slot
    expected = sorted(where)
    cursor, seen = "", []
    while True:
        page, more = table.page(cursor, 97)
        seen += page
        if not more:
            break
        cursor = page[-1]
    assert seen == expected
    assert table.page(expected[len(expected) // 2], 3)[0] == expected[len(expected) // 2 + 1 : len(expected) // 2 + 4]
    assert table.page(expected[-1], 10) == ([], False)


def test_an_empty_value_neither_wedges_demotion_nor_stops_sigterm(node_factory, pool_url, tmp_path):
    # An empty chunk's file once made the NVMe writer spin on writev(fd, [header, b""]) with the
    # demoter's lock held: every later put that needed room timed out and SIGTERM did not stop the node.
    node = _nvme_node(node_factory, tmp_path, dram="32MiB", nvme="256MiB")
    big = _chunks("after-empty", 6, 8 * 1024 * KIB)
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?progress_timeout_s=5")) as client:
        client.put([Chunk("empty", b"")])
        for chunk in big:
            client.put([chunk])
        assert [bytes(f.data) for f in client.get(["empty"])] == [b""]
        assert [bytes(f.data) for f in client.get([c.key for c in big])] == [c.data for c in big]
    # A demotion may still be writing its file (a .tmp until renamed): it finishes, never wedges.
    assert wait_until(lambda: not list((tmp_path / "nvme" / CHUNKS_DIR).rglob("*.tmp")), 10)
    assert node.terminate(timeout_s=10) == 0


def test_an_nvme_tier_larger_than_its_disk_is_said_at_start(node_factory, tmp_path):
    (tmp_path / "nvme").mkdir()
    disk = shutil.disk_usage(tmp_path / "nvme")
    too_big = f"{disk.total // (1 << 30) + 100}GiB"
    node = _nvme_node(node_factory, tmp_path, dram="16MiB", nvme=too_big)
    assert wait_until(lambda: "is more than the disk holding" in node.log, 5.0), node.log
    line = next(line for line in node.output if "is more than the disk holding" in line)
    assert f"--nvme {format_size(parse_size(too_big))} is more" in line and "WARNING" in line
    fits = _nvme_node(node_factory, tmp_path / "second", dram="16MiB", nvme="64MiB")
    assert not any("more than the disk" in line for line in fits.output)
