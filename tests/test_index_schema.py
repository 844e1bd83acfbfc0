"""The index's key schema (``backend.metadata``): what an entry costs Redis, and the contracts it keeps.

An entry is ``kvp:NS/<key>``: a hash of node slot -> ``varint(epoch) varint(nbytes << 2 | tier)
checksum[8]``. Memory is measured on a real redis-server with LMCache's own key strings
(``bench.scale.redis_memory``); the contracts -- a commit drops copies of other bytes, a removal or a
tier move by an ended run changes nothing, a slot is kept across restarts -- on real Redis too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from backend.errors import MetadataError
from backend.metadata import Location, MetadataStore, NodeInfo
from backend.metadata.records import varint
from backend.node.store.nvme_format import chunk_path
from backend.protocol import checksum
from bench.scale.redis_memory import TARGET_BEYOND_KEY, inprocess_keys, layerwise_keys, measure_case
from kvpool import Chunk, PoolConfig, SyncPoolClient
from tests.support.chunks import all_read_back, seeded_chunks
from tests.support.cli import kvpool
from tests.support.index import copies, index_key, legacy_index_key, slots
from tests.support.waits import wait_until

# 16,000 keys fill Redis's key table (16,384 buckets) as 10^6 keys fill theirs (2^20): the
# bucket array costs the same 8 bytes per key in both, so the figure is the one at 10^6.
MEMORY_KEYS = 16_000
LONGEST_NODE_ID = "n" + "x" * 127  # the node id rule allows 128 characters


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("kind", ["inprocess", "layerwise"])
def test_an_index_entry_costs_at_most_120_bytes_of_redis_beyond_an_lmcache_key(kind):
    keys = list((inprocess_keys if kind == "inprocess" else layerwise_keys)(MEMORY_KEYS))
    one = measure_case(keys, copies=1)
    two = measure_case(keys, copies=2)
    print(kind, one, two)
    assert one["beyond_key"] <= TARGET_BEYOND_KEY, one
    assert two["bytes_per_chunk"] - one["bytes_per_chunk"] <= 24, (one, two)  # a second copy: 16 bytes here


async def test_entries_stay_compact_with_the_longest_node_ids_and_many_copies(redis_server, namespace):
    """A field is a node's slot, not its id: an id of 128 characters (over hash-max-listpack-value, 64)
    would turn every entry it touches into a real hash table, several times the size."""
    store = MetadataStore(redis_server.url, namespace)
    ids = [LONGEST_NODE_ID[:-1] + str(i) for i in range(4)]
    try:
        await store.index.commit(
            [("k", Location(node_id, 10_000 + i, "nvme", 1 << 30, 7)) for i, node_id in enumerate(ids)]
        )
        with redis.Redis(port=redis_server.port) as r:
            assert r.object("encoding", index_key(namespace, "k")) == b"listpack"
            assert r.memory_usage(index_key(namespace, "k"), samples=0) < 256  # 168 here; as a hash table, ~1 KB
            assert set(copies(r, namespace, "k")) == set(ids)
    finally:
        await store.close()


def test_a_location_is_its_epoch_then_its_size_and_tier_then_its_checksum():
    loc = Location("n", 300, "nvme", 1 << 20, (1 << 64) - 1)
    value = loc.encode()
    assert value == varint(300) + varint((1 << 20) << 2 | 1) + b"\xff" * 8
    assert len(value) == 14
    assert Location.decode("n", value, 3) == loc and Location.decode("n", value, 3).slot == 3
    assert Location.decode("n", value.decode("utf-8", "surrogateescape")) == loc  # as redis-py hands it back
    # A varint is prefix-free: the value of epoch 2 does not start with the bytes of epoch 1, or of 300 of 3.
    assert not Location("n", 2, "dram", 1, 1).encode().startswith(varint(1))
    assert not value.startswith(varint(3))
    for bad in (b"", b"\x81", b"not|a|location", value[:-1], value + b"\x00", varint(1) + varint(3) + b"\x00" * 8):
        with pytest.raises(MetadataError, match="malformed"):
            Location.decode("n", bad)
    with pytest.raises(MetadataError, match="tier 'tape'"):
        Location("n", 1, "tape", 1, 1).encode()


async def test_commit_remove_and_move_keep_their_contracts_under_slots(redis_server, namespace):
    store = MetadataStore(redis_server.url, namespace)
    try:
        await store.index.commit([("k", Location("a", 5, "dram", 10, 111)), ("k", Location("b", 6, "dram", 10, 111))])
        # Other bytes under the key: the copy of the old bytes on the other node goes (readers never mix two).
        await store.index.commit([("k", Location("a", 5, "dram", 12, 222))])
        assert [(loc.node_id, loc.checksum) for loc in (await store.index.lookup(["k"]))[0]] == [("a", 222)]
        # An ended run's removal or tier move changes nothing of a newer run's copy (never resurrects).
        await store.index.commit([("k", Location("a", 7, "dram", 12, 222))])
        await store.index.remove("a", 5, ["k"])
        await store.index.move([("k", Location("a", 5, "nvme", 12, 222))])
        assert (await store.index.lookup(["k"]))[0] == [Location("a", 7, "dram", 12, 222)]
        await store.index.move([("k", Location("a", 7, "nvme", 12, 222))])
        assert (await store.index.lookup(["k"]))[0] == [Location("a", 7, "nvme", 12, 222)]
        # A removal of another value (it changed since it was read) leaves it; the exact one goes.
        await store.index.remove_stale([("k", Location("a", 7, "dram", 12, 222))])
        assert (await store.index.lookup(["k"]))[0] != []
        await store.index.remove("a", 7, ["k"])
        assert (await store.index.lookup(["k"]))[0] == [] and not await store.connection.redis.exists(
            index_key(namespace, "k")
        )
        # A removal for an id that holds no slot touches nothing, and gives it no slot.
        await store.index.remove("never-seen", 1, ["k"])
        with redis.Redis(port=redis_server.port) as r:
            assert set(slots(r, namespace)) == {"a", "b"}
    finally:
        await store.close()


async def test_a_reader_that_does_not_know_a_slot_names_it_and_learns_it_from_the_registry(redis_server, namespace):
    writer = MetadataStore(redis_server.url, namespace)
    reader = MetadataStore(redis_server.url, namespace)
    try:
        await writer.index.commit([("k", Location("a", 3, "dram", 1, 1))])
        await writer.registry.heartbeat(NodeInfo("a", "127.0.0.1", 1, 3), ttl_ms=60_000)
        slot = writer.connection.slots.slot_of("a")
        found = await reader.lookup.lookup_live(["k"], {}, prefix=False, copies=True)
        assert [(loc.node_id, loc.slot, loc.attributed) for _, loc in found.others] == [(f"#{slot}", slot, False)]
        assert [loc.node_id for loc in (await reader.index.lookup(["k"]))[0]] == [
            "a"
        ]  # a full read reads the slots too
        assert (await reader.registry.nodes())[0].slot == slot
        found = await reader.lookup.lookup_live(["k"], {"a": 3}, prefix=False, copies=True)
        assert found.hits == [True] and found.copies[0][0].node_id == "a"
    finally:
        await writer.close()
        await reader.close()


def test_a_node_keeps_its_slot_across_restarts_and_republishes_when_redis_lost_it(node_factory, pool_url, namespace):
    """A restart under the same id writes the same field (the old run's copies are overwritten, not
    doubled); a slot Redis lost is given anew at the next beat, and the node republishes under it."""
    node = node_factory("--node-id", "keeper")
    chunks = [Chunk(f"keep@{i}", bytes([i]) * 1000) for i in range(20)]
    keys = [c.key for c in chunks]
    r = redis.Redis.from_url(PoolConfig.from_url(pool_url).redis_url)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        first = slots(r, namespace)["keeper"]
        node.stop()
        node = node_factory("--node-id", "keeper")
        assert slots(r, namespace)["keeper"] == first
        client.nodes(refresh=True)  # its new address
        client.put(chunks)
        assert all(list(copies(r, namespace, k)) == ["keeper"] for k in keys)
        r.hdel(f"kvp:{{{namespace}}}:slots", "keeper")  # Redis lost the id's slot (a partial loss)
        assert wait_until(lambda: slots(r, namespace).get("keeper", first) != first, 10.0)
        assert wait_until(lambda: client.contains(keys) == [True] * len(keys), 10.0)
        assert [bytes(g.data) for g in client.get(keys)] == [bytes(c.data) for c in chunks]
    assert "republished" in node.log
    r.close()


async def test_a_namespace_with_the_previous_schema_left_is_flushed_whole(redis_server, namespace):
    store = MetadataStore(redis_server.url, namespace)
    try:
        r = store.connection.redis
        await r.hset(f"kvp:{namespace}:k:{{old}}", "n", "1|dram|1|1|1")
        await store.index.commit([("new", Location("n", 1, "dram", 1, 1))])
        assert await store.index.legacy_entries() == 1
        await store.index.flush_namespace()
        assert await store.index.legacy_entries() == 0 and await store.index.lookup(["new"]) == [[]]
    finally:
        await store.close()


async def test_the_index_key_is_the_namespace_and_the_pool_key_after_a_slash():
    store = MetadataStore("redis://127.0.0.1:1/0", "ns")
    try:
        assert store.connection.index_key("model@1@0@ab@bfloat16") == "kvp:ns/model@1@0@ab@bfloat16"
        assert store.connection.key_from_index("kvp:ns/a{b}c") == "a{b}c"
    finally:
        await store.close()


async def test_the_store_is_four_parts_over_one_connection_none_holding_another():
    """The registry, the index, the lookup and the rendezvous are separate objects sharing the
    store's one connection (by composition: no part is a subclass of another or of the connection),
    and no part can reach another, so a caller handed one part holds only that one."""
    store = MetadataStore("redis://127.0.0.1:1/0", "ns")
    try:
        parts = [store.registry, store.index, store.lookup, store.rendezvous]
        assert len({type(part) for part in parts}) == 4 and type(store).__mro__ == (type(store), object)
        for part in parts:
            held = list(vars(part).values())
            assert store.connection in held
            assert not any(other is value for other in [store, *parts] for value in held), type(part).__name__
            assert type(part).__mro__ == (type(part), object), type(part).__name__
        surfaces = [{n for n in dir(type(part)) if not n.startswith("_")} for part in parts]
        assert all(a.isdisjoint(b) for i, a in enumerate(surfaces) for b in surfaces[i + 1 :]), surfaces
    finally:
        await store.close()


def test_an_index_left_by_the_previous_release_is_never_read_and_check_fix_deletes_it(
    node_factory, pool_url, namespace, tmp_path
):
    """An upgrade: Redis still holds the previous schema (``kvp:NS:k:{key}``, node ids, text values).
    Nothing reads it -- a key indexed only there is a miss, never an error -- the upgraded node
    republishes what its NVMe tier holds in the current schema, and ``kvpool check --fix`` deletes the
    old keys (``flush`` does too)."""
    nvme = tmp_path / "nvme"
    args = ("--node-id", "upgraded", "--nvme-dir", str(nvme), "--nvme", "64MiB")
    node = node_factory(*args, dram="1MiB")
    chunks = seeded_chunks("upgrade", 12, 256 * 1024)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        epoch = client.nodes()[0].epoch
    assert wait_until(lambda: sum(chunk_path(nvme, c.key).exists() for c in chunks) >= 6, 10.0)
    node.stop()  # withdraws its entries; what is on NVMe stays
    on_disk = [c for c in chunks if chunk_path(nvme, c.key).exists()]
    r = redis.Redis.from_url(PoolConfig.from_url(pool_url).redis_url)
    for c in [*chunks, Chunk("upgrade-ghost", b"")]:  # as the previous release left them, and one never stored
        value = f"{epoch}|dram|{len(c.data)}|{checksum(c.data)}|1790000000"
        r.hset(legacy_index_key(namespace, c.key), "upgraded", value)

    node_factory(*args, dram="1MiB")  # the new release, on the same NVMe directory
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        assert wait_until(lambda: client.hit_prefix([c.key for c in on_disk]) == len(on_disk), 10.0)
        assert all_read_back(client, on_disk)
        assert client.get(["upgrade-ghost"]) == [None]  # only the old schema names it: a miss
        report = _check_json(pool_url)
        assert report["legacy_entries"] == len(chunks) + 1
        fixed = _check_json(pool_url, "--fix")["fixed"]
        assert fixed["legacy_entries_removed"] == len(chunks) + 1
        assert not list(r.scan_iter(match=legacy_index_key(namespace, "*")))
        assert _check_json(pool_url)["legacy_entries"] == 0
        assert all_read_back(client, on_disk)  # the current entries were left alone
    r.close()


def _check_json(pool_url: str, *extra: str) -> dict[str, Any]:
    out = kvpool("check", "--url", pool_url, "--json", *extra)
    assert out.returncode in (0, 3), out.stderr  # 3: problems found
    return dict(json.loads(out.stdout))
