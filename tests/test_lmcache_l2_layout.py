"""Never a wrong hit across layouts in multiprocess mode: two L2 adapters of one model whose objects differ in layout.

An L2 object key carries the model, KV rank, object group and salt, not the dtype or shape
of the object LMCache's L1 allocates for it: two ``lmcache server``s of one model name whose
engines register another dtype (bf16, fp16) or another shape of the same byte size make the
same keys for objects of the same size. The adapter stores each chunk with its object's
layout fingerprint (``backend.lmcache.layout.ObjectLayout``) and reads with the fingerprint
of the object it loads into: another layout's chunk is a miss, no byte of it lands in the
object, and ``layout_misses`` counts it. Before this, such a load returned the other
adapter's bytes as its own (each test below that reads across layouts failed so).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backend.client import SyncPoolClient
from backend.config import PoolConfig
from backend.lmcache.chunks import to_chunk
from backend.lmcache.layout import CANONICAL_VERSION, L2_CANONICAL_VERSION, ObjectLayout, object_layout
from tests.support.mp_stack import MPStack, server_args
from tests.support.waits import wait_until
from tests.test_lmcache_l2 import (
    CHUNK_BYTES,
    WAIT_S,
    adapter_key,
    await_result,
    hybrid_obj,
    memory_obj,
    object_key,
    store,
)

SHAPE = (2, 2, 16, 1024)  # the tests' object: [kv, layers, tokens, hidden]
# Other layouts of the same model name and the same bytes per object.
OTHER_LAYOUTS = {
    "dtype": (SHAPE, torch.float16),
    "shape": ((2, 4, 16, 512), torch.bfloat16),  # twice the layers at half the hidden size
}


def tensor(seed: int, shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def load_into(
    adapter: Any, keys: list[Any], shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[list[bool], list[Any]]:
    """Load ``keys`` into fresh zeroed objects of one layout; what loaded, and the tensors."""
    targets = [torch.zeros(shape, dtype=dtype) for _ in keys]
    task_id = adapter.submit_load_task(keys, [memory_obj(t) for t in targets])
    bitmap = await_result(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task_id))
    return [bitmap.test(i) for i in range(len(keys))], targets


def untouched(t: torch.Tensor) -> bool:
    return not t.view(torch.uint8).any().item()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def layout_misses(adapter: Any) -> int:
    return int(adapter.report_status()["counters"]["layout_misses"])


# -- the description ------------------------------------------------------------------
def test_the_l2_canonical_form_is_the_documented_text_and_its_fingerprint_never_changes():
    obj = memory_obj(torch.zeros(SHAPE, dtype=torch.bfloat16))
    layout = object_layout(obj)
    assert layout == ObjectLayout("KV_2LTD", (("bfloat16", SHAPE),))
    assert layout.canonical() == "kvpool-l2-layout/1\nfmt=KV_2LTD\ngroups=bfloat16:2,2,16,1024\n"
    assert layout.fingerprint == 0x7751B0F550A7F1AA
    assert L2_CANONICAL_VERSION != CANONICAL_VERSION  # never equal to an in-process engine's description
    # Each fact counts: dtype, shape of the same size, memory format, a second group.
    others = [memory_obj(torch.zeros(shape, dtype=dtype)) for shape, dtype in OTHER_LAYOUTS.values()]
    hybrid = object_layout(hybrid_obj(None))
    assert hybrid.canonical().endswith("groups=bfloat16:2,2,16,1024;float16:2,1,16,512\n")
    unformatted = ObjectLayout("UNDEFINED", layout.groups)
    prints = {layout.fingerprint, hybrid.fingerprint, unformatted.fingerprint}
    prints |= {object_layout(o).fingerprint for o in others}
    assert len(prints) == 5 and 0 not in prints


# -- two adapters, one model, one object size, another layout --------------------------
@pytest.mark.parametrize("other", sorted(OTHER_LAYOUTS))
def test_two_adapters_of_another_layout_each_miss_the_others_chunks_and_hit_their_own(
    node_factory, pool_url, adapters, other
):
    node_factory()
    shape, dtype = OTHER_LAYOUTS[other]
    mine, theirs = adapters(pool_url), adapters(pool_url)
    my_keys, their_keys = [object_key(200 + i) for i in range(3)], [object_key(300 + i) for i in range(3)]
    my_data = [tensor(200 + i) for i in range(3)]
    their_data = [tensor(300 + i, shape, dtype) for i in range(3)]
    assert all(t.numel() * t.element_size() == CHUNK_BYTES for t in my_data + their_data)
    assert store(mine, my_keys, [memory_obj(t) for t in my_data]).is_successful()
    assert store(theirs, their_keys, [memory_obj(t) for t in their_data]).is_successful()

    # Across layouts: not loaded, no byte written into the object, counted.
    hits, got = load_into(theirs, my_keys, shape, dtype)
    assert hits == [False] * 3 and all(untouched(t) for t in got)
    assert layout_misses(theirs) == 3
    hits, got = load_into(mine, their_keys, SHAPE, torch.bfloat16)
    assert hits == [False] * 3 and all(untouched(t) for t in got)
    assert layout_misses(mine) == 3

    # Each its own: every byte.
    hits, got = load_into(mine, my_keys, SHAPE, torch.bfloat16)
    assert hits == [True] * 3 and all(same_bytes(g, e) for g, e in zip(got, my_data))
    hits, got = load_into(theirs, their_keys, shape, dtype)
    assert hits == [True] * 3 and all(same_bytes(g, e) for g, e in zip(got, their_data))
    assert layout_misses(mine) == layout_misses(theirs) == 3
    # A lookup is Redis and the node's lease, and knows no layouts: it answers hit, the load then misses.
    assert [bool(x) for x in _lookup(theirs, my_keys)] == [True] * 3


def _lookup(adapter: Any, keys: list[Any]) -> list[bool]:
    from tests.test_lmcache_l2 import lookup_and_lock

    found = lookup_and_lock(adapter, keys)
    adapter.submit_unlock(keys)
    return found


def test_one_load_of_objects_of_two_layouts_reads_each_with_its_own(node_factory, pool_url, adapters):
    """Object groups may differ in layout (hybrid models): one load task holds objects of several."""
    node_factory()
    adapter = adapters(pool_url)
    shape, dtype = OTHER_LAYOUTS["dtype"]
    bf16, fp16 = object_key(400), object_key(401)
    data = [tensor(400), tensor(401, shape, dtype)]
    assert store(adapter, [bf16, fp16], [memory_obj(t) for t in data]).is_successful()
    targets = [torch.zeros(SHAPE, dtype=torch.bfloat16), torch.zeros(shape, dtype=dtype)]
    crossed = [torch.zeros(shape, dtype=dtype), torch.zeros(SHAPE, dtype=torch.bfloat16)]
    keys = [bf16, fp16, bf16, fp16]
    task_id = adapter.submit_load_task(keys, [memory_obj(t) for t in targets + crossed])
    bitmap = await_result(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task_id))
    assert [bitmap.test(i) for i in range(4)] == [True, True, False, False]
    assert same_bytes(targets[0], data[0]) and same_bytes(targets[1], data[1])
    assert untouched(crossed[0]) and untouched(crossed[1])
    assert layout_misses(adapter) == 2


# -- a store after a layout miss replaces that copy --------------------------------------
def test_a_store_after_a_layout_miss_replaces_the_copy_so_the_last_layout_to_store_hits(
    node_factory, pool_url, adapters
):
    node_factory()
    shape, dtype = OTHER_LAYOUTS["dtype"]
    first, second = adapters(pool_url), adapters(pool_url)
    key = object_key(500)
    first_data, second_data = tensor(500), tensor(501, shape, dtype)
    assert store(first, [key], [memory_obj(first_data)]).is_successful()
    # Without a miss, a store of a key the pool holds sends nothing (as before).
    again = store(second, [key], [memory_obj(second_data)])
    assert again.is_successful() and again.bytes_transferred() == 0
    assert load_into(second, [key], shape, dtype)[0] == [False]
    # The engine recomputes the chunk; this store replaces the copy its load could not read.
    replaced = store(second, [key], [memory_obj(second_data)])
    assert replaced.is_successful() and replaced.bytes_transferred() == CHUNK_BYTES
    assert second.counters["store_replaced"] == 1
    hits, got = load_into(second, [key], shape, dtype)
    assert hits == [True] and same_bytes(got[0], second_data)
    hits, got = load_into(first, [key], SHAPE, torch.bfloat16)
    assert hits == [False] and untouched(got[0])
    assert layout_misses(first) == 1 and layout_misses(second) == 1
    # The name is taken once: a later store of a chunk it can read is skipped again.
    assert store(second, [key], [memory_obj(second_data)]).bytes_transferred() == 0


def test_a_chunk_an_older_adapter_stored_without_a_fingerprint_is_a_miss_then_replaced(
    node_factory, pool_url, adapters
):
    """An adapter before fingerprints stored ``to_chunk(name, obj)``: fingerprint 0. One side only is a miss
    (docs/upgrade.md); the new adapter's next store of that key replaces it."""
    node_factory()
    adapter = adapters(pool_url)
    key = object_key(600)
    old, new = tensor(600), tensor(601)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as pool:
        pool.put([to_chunk(adapter_key(key), memory_obj(old))])  # what the adapter stored before
        hits, got = load_into(adapter, [key], SHAPE, torch.bfloat16)
        assert hits == [False] and untouched(got[0]) and layout_misses(adapter) == 1
        assert store(adapter, [key], [memory_obj(new)]).bytes_transferred() == CHUNK_BYTES
        hits, got = load_into(adapter, [key], SHAPE, torch.bfloat16)
        assert hits == [True] and same_bytes(got[0], new)
        # A reader without a fingerprint (an older adapter, kvpool get) does not get the new chunk either.
        assert pool.get([adapter_key(key)]) == [None]


# -- through LMCache's own multiprocess storage ------------------------------------------
def test_lmcache_servers_of_another_dtype_read_no_bytes_of_each_others_chunks(node_factory, pool_url):
    """Two ``lmcache server`` storage managers, one model name, one object size, bf16 and fp16: a prefetch
    through the other's keys loads nothing from L2; once the fp16 server stores them, an fp16 server hits."""
    node_factory()
    made: list[MPStack] = []

    def stack(dtype: torch.dtype) -> MPStack:
        made.append(MPStack(server_args(pool_url), dtype=dtype))
        return made[-1]

    try:
        bf16 = stack(torch.bfloat16)
        keys = [bf16.key(i) for i in range(4)]
        assert bf16.put(keys, [bf16.payload(i, 5) for i in range(4)]) == 4
        assert wait_until(lambda: bf16.adapter.counters["stored_chunks"] >= 4, WAIT_S)
        fp16 = stack(torch.float16)
        assert fp16.chunk_bytes == bf16.chunk_bytes
        hits, l2_hits = fp16.prefetch(keys)
        assert (hits, l2_hits) == (0, 0)
        assert fp16.adapter.report_status()["counters"]["layout_misses"] == 4
        assert fp16.put(keys, [fp16.payload(i, 6) for i in range(4)]) == 4  # recomputed, stored over the miss
        assert wait_until(lambda: fp16.adapter.counters["stored_chunks"] >= 4, WAIT_S)
        assert fp16.adapter.counters["store_replaced"] == 4
        fresh = stack(torch.float16)
        assert fresh.prefetch(keys) == (4, 4)
        got = fresh.read(keys)
        assert got is not None and all(same_bytes(g, fp16.payload(i, 6)) for i, g in enumerate(got))
    finally:
        for made_stack in made:
            made_stack.close()


def test_the_names_a_load_missed_are_bounded_and_each_is_taken_once():
    from backend.lmcache.l2.unreadable import Unreadable

    names = Unreadable(limit=3)
    names.add(["a", "b", "c"])
    names.add(["a", "d"])  # "a" again is the newest; "b", the oldest, is forgotten
    assert len(names) == 3
    assert not names.take("b")
    assert names.take("a") and not names.take("a")
    assert names.take("c") and names.take("d") and len(names) == 0
