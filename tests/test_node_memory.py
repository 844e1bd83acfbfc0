"""A node's memory per chunk: packed bookkeeping, tiny chunks counted at the room they take, O(1) eviction.

In-process parts (the key index, the chunk table's layouts, the arena's holds, the tier
manager's eviction with pinned chunks) and real node processes (a shared arena of tiny
chunks). The RSS bound of a node filled with tiny chunks is ``tests/faults/test_scale_node.py``.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import pytest

from backend.node.store.dram import StoredChunk
from backend.node.store.tiers import NVME, TierConfig, TierManager
from backend.protocol import ItemMeta, checksum
from kvpool import Chunk, PoolConfig, SyncPoolClient

KIB = 1024
VALUE_BYTES = 64  # a chunk whose room is its size, before and after rooms were counted


def _chunk(key: str, seed: int, nbytes: int = VALUE_BYTES) -> StoredChunk:
    data = memoryview(bytearray(random.Random(seed).randbytes(nbytes)))
    return StoredChunk(ItemMeta(key, nbytes, checksum(data), "uint8", (nbytes,), 0), data)


async def _fill(tiers: TierManager, count: int, *, landing: int = 0) -> list[str]:
    """``count`` chunks, oldest first; the first ``landing`` inserted by puts that never commit."""
    keys = [f"fill@{i}" for i in range(count)]
    for i, key in enumerate(keys):
        await tiers.reserve(VALUE_BYTES)
        tiers.insert(_chunk(key, i), put_id=1_000_000 + i if i < landing else 0)
    return keys


# -- the key index -----------------------------------------------------------------------


def test_the_key_index_finds_every_key_and_no_other_through_adds_removes_and_rebuilds():
    """Against a dict doing the same: removals shift runs back (no tombstones), rebuilds keep every key."""
    from backend.node.store.keys import NO_SLOT, KeyIndex

    rng = random.Random(11)
    keys: list[str | None] = []
    index, reference = KeyIndex(keys), {}
    free: list[int] = []
    for step in range(40_000):
        key = f"k{rng.randrange(6000)}"
        if key in reference and rng.random() < 0.5:
            slot = reference.pop(key)
            assert index.remove(key) == slot
            keys[slot] = None
            free.append(slot)
        elif key not in reference:
            slot = free.pop() if free else len(keys)
            if slot == len(keys):
                keys.append(key)
            keys[slot] = key
            index.add(key, slot)
            reference[key] = slot
        if step % 997 == 0:
            assert all(index.get(k) == s for k, s in reference.items())
    assert len(index) == len(reference)
    assert all(index.get(k) == s for k, s in reference.items())
    assert all(index.get(f"k{i}") == NO_SLOT for i in range(6000) if f"k{i}" not in reference)
    assert index.remove("never-there") == NO_SLOT


def test_slots_share_one_layout_and_a_layout_no_chunk_uses_any_more_is_forgotten():
    from backend.node.store.bookkeeping import IN_DRAM, ChunkTable

    table = ChunkTable()
    for i in range(100):
        table.enter(ItemMeta(f"k{i}", 8, i, "bfloat16", (2, 2), 1), IN_DRAM)
    odd = table.enter(ItemMeta("odd", 6, 1, "float16", (3,), 0), IN_DRAM)
    assert len(table.layouts) == 2
    assert table.meta(table.slot("k7")) == ItemMeta("k7", 8, 7, "bfloat16", (2, 2), 1)
    table.leave(odd, IN_DRAM)
    assert len(table.layouts) == 1 and "odd" not in table


# -- the arena: who holds a region --------------------------------------------------------


def test_a_region_the_tier_let_go_outlives_it_while_a_view_is_out_and_is_freed_after():
    from backend.node.memory.arena import PrivateArena

    arena = PrivateArena(1 << 20, populate=False)
    try:
        buffer = arena.alloc(3000)
        assert buffer is not None
        buffer[:] = b"x" * 3000
        offset = arena.adopt(buffer)
        assert offset is not None and arena.adopt(buffer) is None  # adopted once only
        del buffer
        gc.collect()
        assert arena.report().allocated_bytes == 4096  # the tier holds it with no object
        view = arena.view(offset, 3000)  # a reply being sent
        arena.disown(offset, 3000)  # evicted meanwhile
        assert arena.report().allocated_bytes == 4096 and bytes(view[:3]) == b"xxx"
        del view
        gc.collect()
        assert arena.report().allocated_bytes == 0
    finally:
        arena.close()


def test_tiny_buffers_share_pages_of_cells_and_a_page_goes_back_when_its_cells_are_free():
    from backend.node.memory.arena import PrivateArena, room_of

    arena = PrivateArena(1 << 20, populate=False)
    try:
        held = [arena.alloc(40) for _ in range(128)]  # 64-byte cells: two pages
        offsets = {arena.offset_of(b) for b in held if b is not None}
        assert len(offsets) == 128 and all(o % 64 == 0 for o in offsets)
        assert len({o // 4096 for o in offsets}) == 2
        assert arena.report().allocated_bytes == 128 * room_of(40) == 2 * 4096
        del held
        gc.collect()
        assert arena.report().allocated_bytes == 0
        whole = arena.alloc(1 << 20)  # only if both pages went back and merged with the rest
        assert whole is not None
    finally:
        arena.close()


# -- eviction with pinned chunks ------------------------------------------------------------


async def _evicting_put_us(tiers: TierManager, puts: int) -> float:
    """The median time of a put into a full DRAM: reserve (one chunk evicted) and insert."""
    times = []
    for n in range(puts):
        chunk = _chunk(f"new@{n}", -n)
        started = time.perf_counter()
        await tiers.reserve(VALUE_BYTES)
        tiers.insert(chunk)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


async def test_a_put_that_evicts_never_walks_past_the_chunks_leases_and_landing_puts_pin():
    """Half of a full DRAM pinned, the oldest half (a walk from the coldest end meets them first): a put's
    eviction costs what it costs with nothing pinned, not a walk over 10,000 pinned chunks."""
    held, puts = 20_000, 300
    free_tiers = TierManager(TierConfig(dram_bytes=held * VALUE_BYTES))
    pinned_tiers = TierManager(TierConfig(dram_bytes=held * VALUE_BYTES))
    try:
        await _fill(free_tiers, held)
        keys = await _fill(pinned_tiers, held, landing=held // 4)
        for start in range(held // 4, held // 2, 100):
            pinned_tiers.leasing.lock(keys[start : start + 100], 600_000)
        unpinned_us = await _evicting_put_us(free_tiers, puts)
        pinned_us = await _evicting_put_us(pinned_tiers, puts)
        assert all(pinned_tiers.contains(key) for key in keys[: held // 2])  # every pinned chunk stayed
        assert not any(pinned_tiers.contains(key) for key in keys[held // 2 : held // 2 + puts])
        assert pinned_us < 3 * unpinned_us, (pinned_us, unpinned_us)
    finally:
        await free_tiers.close()
        await pinned_tiers.close()


async def test_a_chunk_whose_lease_ends_comes_back_as_the_most_recent_not_the_oldest():
    """A lease is taken to read: the chunk it pinned was just used, so eviction takes the others first."""
    tiers = TierManager(TierConfig(dram_bytes=4 * VALUE_BYTES))
    try:
        keys = await _fill(tiers, 4)
        lease = tiers.leasing.lock([keys[0]], 60_000)
        await tiers.reserve(VALUE_BYTES)  # full: the oldest unpinned goes
        tiers.insert(_chunk("e", 5))
        assert tiers.contains(keys[0]) and not tiers.contains(keys[1])
        tiers.leasing.release(lease)
        await tiers.reserve(VALUE_BYTES)
        tiers.insert(_chunk("f", 6))
        assert tiers.contains(keys[0]) and not tiers.contains(keys[2])  # keys[2] was colder than it now
    finally:
        await tiers.close()


async def test_pinned_nvme_files_stay_and_the_coldest_unpinned_one_is_evicted(tmp_path):
    size = 64 * KIB
    tiers = TierManager(TierConfig(dram_bytes=size, nvme_dir=tmp_path, nvme_bytes=3 * (size + 4 * KIB)))
    try:
        for i in range(4):  # each demotes the one before it to NVMe, which holds three
            await tiers.reserve(size)
            tiers.insert(_chunk(f"n{i}", i, size))
        assert [tiers.tier_of(f"n{i}") for i in range(4)] == ["nvme", "nvme", "nvme", "dram"]
        tiers.leasing.lock(["n0"], 60_000)
        await tiers.reserve(size)
        tiers.insert(_chunk("n4", 4, size))  # n3 goes to NVMe, which drops a file for it
        assert tiers.tier_of("n0") == "nvme" and tiers.tier_of("n1") is None
        assert tiers.counters["nvme_evictions"] == 1
        assert (await tiers.get("n0")) is not None  # the pinned file still reads back
    finally:
        await tiers.close()


async def test_recovered_files_are_adopted_in_batches_and_never_over_a_newer_put(tmp_path):
    from backend.node.store.nvme_format import write_chunk

    tiers = TierManager(TierConfig(dram_bytes=64 * KIB, nvme_dir=tmp_path, nvme_bytes=1 << 20))
    try:
        records = [write_chunk(tmp_path, _chunk(f"r{i}", i).meta, bytes(VALUE_BYTES), durable=False) for i in range(6)]
        await tiers.reserve(VALUE_BYTES)
        newer = _chunk("r4", 99)
        tiers.insert(newer)  # a put landed while recovery was still scanning
        assert tiers.upkeep.load_nvme(records[:3]) == records[:3]
        assert tiers.upkeep.load_nvme(records[3:]) == [records[3], records[5]]  # r4's file is older than the put
        assert len(tiers) == 6 and tiers.tier_of("r4") == "dram"
        assert tiers.meta_of("r4") == newer.meta and tiers.tier_reports()[NVME].objects == 5
    finally:
        await tiers.close()


# -- a real node ----------------------------------------------------------------------------


def test_tiny_chunks_fill_a_shared_arena_at_their_cells_and_never_spill_into_private_memory(node_factory, pool_url):
    """4 MiB of DRAM and 40,000 chunks of 100 bytes: each takes a 128-byte cell and is counted so; the
    arena (DRAM plus its slack) always has room, so no chunk becomes a private buffer of its own."""
    node_factory(shm=True, dram="4MiB")
    count, size = 40_000, 100
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?progress_timeout_s=30")) as client:
        for start in range(0, count, 4000):
            client.put([Chunk(f"tiny@{i}", i.to_bytes(4, "little") * (size // 4)) for i in range(start, start + 4000)])
        (info,) = client.nodes()
        stats = client.node_stats(info)
        dram = stats["tiers"]["dram"]
        assert stats["arena"]["fallbacks"] == 0
        assert dram["objects"] == 4 * 1024 * 1024 // 128  # full, at 128 bytes a chunk: the rest evicted
        assert dram["used_bytes"] == dram["objects"] * 128 == stats["arena"]["allocated_bytes"]
        newest = [f"tiny@{i}" for i in range(count - 100, count)]
        got = client.get(newest)
        assert [bytes(g.data) for g in got] == [
            i.to_bytes(4, "little") * (size // 4) for i in range(count - 100, count)
        ]


@pytest.mark.parametrize("pinned_by", ["lease", "landing"])
async def test_a_pinned_chunk_is_neither_evicted_nor_walked_and_moves_once_unpinned(pinned_by):
    tiers = TierManager(TierConfig(dram_bytes=3 * VALUE_BYTES))
    try:
        await tiers.reserve(VALUE_BYTES)
        first = _chunk("first", 1)
        tiers.insert(first, put_id=7 if pinned_by == "landing" else 0)
        if pinned_by == "lease":
            lease = tiers.leasing.lock(["first"], 60_000)
        await _fill(tiers, 2)
        for n in range(3):  # each put evicts one: never the pinned one
            await tiers.reserve(VALUE_BYTES)
            tiers.insert(_chunk(f"more@{n}", 10 + n))
        assert tiers.contains("first") and len(tiers) == 3
        if pinned_by == "lease":
            tiers.leasing.release(lease)
        else:
            tiers.settle([first])
        for n in range(3):
            await tiers.reserve(VALUE_BYTES)
            tiers.insert(_chunk(f"last@{n}", 20 + n))
        assert not tiers.contains("first")  # unpinned, it is a chunk like any other
    finally:
        await tiers.close()


def test_the_eviction_structure_takes_another_order():
    """A policy plugs in behind the order's interface (``eviction.EvictionOrder``): here, newest first."""
    from backend.node.store.bookkeeping import ChunkTable
    from backend.node.store.dram import DramTier

    class NewestFirst:
        def __init__(self) -> None:
            self.slots: list[int] = []

        def __len__(self) -> int:
            return len(self.slots)

        def add(self, slot: int) -> None:
            self.slots.append(slot)

        def remove(self, slot: int) -> None:
            self.slots.remove(slot)

        def touch(self, slot: int) -> None:
            pass

        def coldest(self):
            return iter(reversed(self.slots))

    dram = DramTier(3 * VALUE_BYTES, ChunkTable(), order=NewestFirst())
    for i in range(3):
        dram.reserve(VALUE_BYTES)
        dram.insert(_chunk(f"o{i}", i))
    assert dram.coldest() == "o2"
    dram.delete("o2")
    assert dram.coldest() == "o1" and len(dram) == 2


def test_a_node_that_only_serves_reads_keeps_no_record_of_the_views_it_handed_out():
    from backend.node.memory.arena import PrivateArena

    arena = PrivateArena(1 << 20, populate=False)
    try:
        buffer = arena.alloc(100)
        assert buffer is not None
        offset = arena.adopt(buffer)
        assert offset is not None
        del buffer
        for _ in range(10_000):  # a GET each: the view is sent, then dropped
            view = arena.view(offset, 100)
            del view
        assert len(arena._watched) <= 2 and len(arena._views) <= 1
    finally:
        arena.close()


def test_a_chunks_meta_made_from_its_slot_is_the_item_meta_it_was_stored_with():
    from backend.node.store.bookkeeping import item_meta

    made = item_meta("k@1", 32, 7, "bfloat16", (2, 8), 1, 0xFEED)
    assert made == ItemMeta("k@1", 32, 7, "bfloat16", (2, 8), 1, 0xFEED) and hash(made) == hash(
        ItemMeta("k@1", 32, 7, "bfloat16", (2, 8), 1, 0xFEED)
    )
    assert type(made) is ItemMeta and made.shape == (2, 8)
    with pytest.raises(AttributeError):
        made.nbytes = 3  # still frozen


def test_past_the_table_of_layouts_a_chunk_keeps_its_own_and_it_goes_with_the_chunk(monkeypatch):
    """A client inventing a shape per chunk cannot grow the shared table of layouts without bound."""
    from backend.node.store import bookkeeping
    from backend.node.store.bookkeeping import IN_DRAM, ChunkTable

    monkeypatch.setattr(bookkeeping, "MAX_LAYOUTS", 2)
    table = ChunkTable()
    slots = [table.enter(ItemMeta(f"s{i}", 8, i, "uint8", (i + 1,), 0), IN_DRAM) for i in range(4)]
    assert len(table.layouts) == 2 and len(table._own_layouts) == 2
    assert [table.meta(s).shape for s in slots] == [(1,), (2,), (3,), (4,)]
    for slot in slots[2:]:
        table.leave(slot, IN_DRAM)
    assert not table._own_layouts and len(table) == 2
