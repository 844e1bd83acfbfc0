"""Layout fingerprints on the wire and on a node: a read gets a chunk's bytes only with the fingerprint it was stored with.

The rule (docs/protocol.md, "Layout fingerprints"): no fingerprint on either side is
today's behaviour; a fingerprint on one side only, or two that differ, is a miss with no
bytes, counted by the node and the client; an older client's read (no fingerprint sent)
is answered in the older form, a chunk of any layout as not found.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
from pathlib import Path

import pytest

from backend.client import BytesSink
from backend.config import PoolConfig
from backend.counters import ClientCounter, NodeCounter
from backend.errors import ProtocolError
from backend.lmcache.layout import CANONICAL_VERSION, KVLayout, fingerprint_of
from backend.node.store.nvme_format import CHUNKS_DIR, read_header
from backend.protocol import ItemMeta, Op
from backend.protocol.channel import ChannelGet
from backend.protocol.meta import ANY_FINGERPRINT, OtherLayout, encode_keys
from backend.protocol.puts import PutBatch, PutOptions, PutStaged
from backend.protocol.reads import GetBatch, Lease
from kvpool import Chunk, PoolClient, SyncPoolClient
from tests.support.recovery import wait_recovered
from tests.support.waits import wait_until

F, G = 0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321
KIB = 1024


def _item(key: str, fingerprint: int = 0, nbytes: int = 8) -> ItemMeta:
    return ItemMeta(key, nbytes, 7, "bfloat16", (2, 2), 1, fingerprint)


# -- the codec ----------------------------------------------------------------------------


def test_a_put_carries_each_items_fingerprint_and_an_older_clients_put_reads_as_none():
    items = [_item("a", F), _item("b"), _item("c", G)]
    decoded, options = PutBatch.decode_request(PutBatch.encode_request(items, PutOptions(9, 50)), 24)
    assert decoded == items and options == PutOptions(9, 50)
    plain = [_item("a"), _item("b")]
    assert (
        len(PutBatch.encode_request(plain, PutOptions(9, 50))) == len(PutBatch.encode_items(plain)) + 12
    )  # no fingerprints sent
    assert PutBatch.decode_request(PutBatch.encode_request(plain, PutOptions(9, 50)), 16)[0] == plain
    assert PutBatch.decode_request(PutBatch.encode_items(plain), 16) == (
        plain,
        PutOptions(),
    )  # an older client: no options
    staged = PutStaged.decode_request(
        PutStaged.encode_request("s", "t" * 32, items, [0, 8, 16], options=PutOptions(3, 10))
    )
    assert staged[2] == items and staged[3] == [0, 8, 16]
    # Bytes after the fingerprints are read as the put's token section (docs/protocol-ops.md, "Put tokens"):
    # one that is not a section is refused naming its version, not skipped.
    with pytest.raises(ProtocolError, match="put tokens of version 0"):
        PutBatch.decode_request(PutBatch.encode_request(items, PutOptions(9, 50)) + b"\0" * 8, 24)
    with pytest.raises(ProtocolError, match="not a stored one"):
        PutBatch.encode_request([_item("a", ANY_FINGERPRINT)], PutOptions())


def test_a_get_carries_the_readers_fingerprint_and_is_answered_in_the_form_it_asked():
    keys = ["a", "b", "c"]
    assert GetBatch.decode_request(GetBatch.encode_request(keys, F)) == (keys, F)
    assert GetBatch.decode_request(encode_keys(keys)) == (keys, None)  # an older client's GET
    found = [_item("a", F), OtherLayout("b"), None]
    assert GetBatch.decode_answer(GetBatch.encode_answer(found), keys, 8) == found
    # The older form: no fingerprints, and a chunk of another layout is plain not found.
    older = GetBatch.decode_answer(GetBatch.encode_answer(found, fingerprints=False), keys, 8, fingerprints=False)
    assert older == [_item("a"), None, None]


def test_a_lease_for_a_read_carries_the_fingerprint_and_a_lock_none():
    keys = ["a", "b"]
    assert Lease.decode_request(Lease.encode_request(keys, 100, 1, fingerprint=F)) == (100, 1, keys, F)
    assert Lease.decode_request(Lease.encode_request(keys, 100, 0)) == (100, 0, keys, None)
    answer = Lease.encode_answer(5, [(_item("a", F), 64), OtherLayout("b")], fingerprints=True)
    assert Lease.decode_answer(answer, keys, fingerprints=True) == (5, [(_item("a", F), 64), OtherLayout("b")])


def test_a_channel_get_carries_the_fingerprint_and_reads_an_older_nodes_rows_as_none():
    request = ChannelGet.decode_request(ChannelGet.encode_request("pair", ["a"], fingerprint=F))
    assert request.fingerprint == F
    assert ChannelGet.decode_request(b'{"session":"pair","keys":["a"]}').fingerprint is None
    assert ChannelGet.decode_answer(ChannelGet.encode_answer([_item("a", F), None]), ["a", "b"]) == [
        _item("a", F),
        None,
    ]
    older = ChannelGet.encode_answer([_item("a", F)], fingerprints=False)
    assert ChannelGet.decode_answer(older, ["a"]) == [_item("a")]
    for bad in ('"F"', "-1", str(2**64), "true", "1.5"):  # the one u64 check every fingerprint goes through
        with pytest.raises(ProtocolError, match=r"CHANNEL_GET: layout fingerprint .* is not a u64"):
            ChannelGet.decode_request(b'{"session":"pair","keys":["a"],"fingerprint":' + bad.encode() + b"}")


# -- the canonical form ---------------------------------------------------------------------

LAYOUT = KVLayout(
    model="org/model",
    world_size=2,
    worker_id=1,
    kv_dtype="bfloat16",
    kv_shape=(4, 2, 256, 8, 64),
    chunk_size=256,
    mla=False,
    layerwise=False,
    groups=(("bfloat16", (2, 4, 256, 512)),),
)


def test_the_canonical_form_is_the_documented_text_and_its_fingerprint_never_changes():
    assert LAYOUT.canonical() == (
        f"{CANONICAL_VERSION}\nmodel=org/model\nworld_size=2\nworker_id=1\nkv_dtype=bfloat16\n"
        "kv_shape=4,2,256,8,64\nchunk_size=256\nmla=0\nlayerwise=0\ngroups=bfloat16:2,4,256,512\n"
    )
    # Pinned: a release that changed it would make every stored chunk a miss for its engines.
    assert LAYOUT.fingerprint == fingerprint_of(LAYOUT.canonical()) == 0x574C812B95EBADFB


@pytest.mark.parametrize(
    "change",
    [
        {"model": "org/other"},
        {"world_size": 4},
        {"worker_id": 0},
        {"kv_dtype": "float16"},
        {"kv_shape": (4, 2, 256, 4, 128)},
        {"chunk_size": 128},
        {"mla": True},
        {"layerwise": True},
        {"groups": (("bfloat16", (2, 4, 256, 512)), ("bfloat16", (1, 4, 256, 512)))},
    ],
    ids=lambda change: next(iter(change)),
)
def test_every_fact_of_the_layout_changes_the_fingerprint(change):
    import dataclasses

    assert dataclasses.replace(LAYOUT, **change).fingerprint != LAYOUT.fingerprint


# -- a node's answers ------------------------------------------------------------------------


def _data(seed: int, size: int = 4 * KIB) -> bytes:
    return random.Random(seed).randbytes(size)


async def _read(client: PoolClient, keys: list[str], fingerprint: int) -> list[bytes | None]:
    got = await client.get(keys, fingerprint=fingerprint)
    return [None if g is None else bytes(g.data) for g in got]


async def test_a_get_returns_bytes_only_to_a_reader_of_the_fingerprint_they_were_stored_with(node_factory, pool_url):
    node_factory()
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        await client.put([Chunk("with-f", _data(1), fingerprint=F), Chunk("without", _data(2))])
        keys = ["with-f", "without"]
        assert await _read(client, keys, F) == [_data(1), None]
        assert await _read(client, keys, G) == [None, None]
        assert await _read(client, keys, 0) == [None, _data(2)]  # no fingerprint on either side: as before
        assert client.counters[ClientCounter.LAYOUT_MISSES] == 4
        assert client.counters[ClientCounter.STALE_ENTRIES] == 0
        assert await client.contains(keys) == [True, True]  # the index keeps both for their own readers
        (node,) = await client.nodes(refresh=True)
        stats = await client.node_stats(node)
        assert stats["counters"][str(NodeCounter.LAYOUT_MISSES)] == 4
        # An admin copy (``kvpool drain``) reads any layout and learns which, to store it with the same.
        copies = await client.fetch_from(node, [("with-f", 4 * KIB), ("without", 4 * KIB)])
        assert [(c.meta.fingerprint, bytes(c.data)) for c in copies if c] == [(F, _data(1)), (0, _data(2))]


async def test_an_older_clients_get_without_a_fingerprint_is_answered_in_the_older_form(
    node_factory, pool_url, monkeypatch
):
    node_factory()
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        await client.put([Chunk("with-f", _data(1), fingerprint=F), Chunk("without", _data(2))])
        (node,) = await client.nodes(refresh=True)
        keys = ["with-f", "without"]
        # A GET as an older build sends it (keys only), its answer read with that build's decoder.
        older = functools.partial(GetBatch.decode_answer, fingerprints=False)
        monkeypatch.setattr(GetBatch, "decode_answer", staticmethod(older))
        answer = await client.connections.to(node).request(
            Op.GET_BATCH, encode_keys(keys), keys=keys, sink=BytesSink(), expect_bytes=8 * KIB
        )
        assert [type(a).__name__ for a in answer] == ["Miss", "Hit"]
        assert bytes(answer[1].handle.data) == _data(2)


async def test_a_put_of_the_same_bytes_with_another_fingerprint_replaces_the_chunks_fingerprint(node_factory, pool_url):
    """Two engines whose chunk has the same bytes under one key (a partial chunk of one is the full chunk of
    the other): the second put is stored, not taken as the same chunk, and the last writer's readers hit."""
    node_factory()
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        await client.put([Chunk("same", _data(3), fingerprint=F)])
        await client.put([Chunk("same", _data(3), fingerprint=G)])
        assert await _read(client, ["same"], G) == [_data(3)]
        assert await _read(client, ["same"], F) == [None]


def test_the_fingerprint_survives_a_node_restart_from_its_nvme_tier(node_factory, pool_url, tmp_path: Path):
    nvme = tmp_path / "nvme"
    args = ("--node-id", "disk", "--nvme-dir", str(nvme), "--nvme", "64MiB")
    node = node_factory(*args, dram="1MiB")
    chunks = [Chunk(f"disk@{i}", _data(i, 128 * KIB), fingerprint=F) for i in range(16)]  # 2 MiB into 1 MiB
    keys = [c.key for c in chunks]
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        for chunk in chunks:
            client.put([chunk])
        assert wait_until(lambda: len(list((nvme / CHUNKS_DIR).rglob("*.safetensors"))) >= 8, 10.0)
    on_disk = {read_header(path).meta for path in (nvme / CHUNKS_DIR).rglob("*.safetensors")}
    assert on_disk and {meta.fingerprint for meta in on_disk} == {F}
    node.kill()
    node_factory(*args, dram="1MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        assert wait_recovered(client)
        recovered = [meta.key for meta in on_disk]
        assert wait_until(lambda: client.hit_prefix(recovered) == len(recovered), 10.0)
        assert client.get(recovered, fingerprint=G) == [None] * len(recovered)
        assert client.counters[str(ClientCounter.LAYOUT_MISSES)] == len(recovered)
        by_key = {c.key: bytes(c.data) for c in chunks}
        got = client.get(recovered, fingerprint=F)
        assert [bytes(g.data) for g in got] == [by_key[k] for k in recovered]
        assert set(recovered) <= set(keys)


async def test_every_tier_asks_one_rule_whether_a_copy_is_the_same_chunk(tmp_path: Path):
    """The table, DRAM, the manager and the demoter agree (``backend/node/store/same_chunk.py``): equal bytes under
    another fingerprint are another chunk, and the file a pin gets is of the DRAM chunk's fingerprint."""
    from backend.node.store.dram import StoredChunk
    from backend.node.store.same_chunk import same_meta
    from backend.node.store.tiers import TierConfig, TierManager
    from backend.protocol import checksum

    data = _data(4)
    stored_f = ItemMeta("k", len(data), checksum(data), "uint8", (len(data),), 0, F)
    as_g = dataclasses.replace(stored_f, fingerprint=G)
    tiers = TierManager(TierConfig(dram_bytes=1 << 20, nvme_dir=tmp_path, nvme_bytes=1 << 20))
    try:
        await tiers.reserve(tiers.room_of(len(data)))
        tiers.insert(StoredChunk(stored_f, bytearray(data)))
        # The store's own parts, asked one by one (nothing outside the store reaches them: tests/test_store_door.py).
        table, dram, demoter = tiers._table, tiers._dram, tiers._demoter
        slot = table.slot("k")
        for fingerprint, same in ((F, True), (G, False), (0, False)):
            assert tiers.holds("k", stored_f.checksum, fingerprint) is same
            assert dram.holds("k", stored_f.checksum, fingerprint) is same
        assert table.same_bytes(slot, stored_f) and not table.same_bytes(slot, as_g)
        assert same_meta(stored_f, stored_f) and not same_meta(stored_f, as_g)
        await demoter.save_copy("k")
        (path,) = (tmp_path / CHUNKS_DIR).rglob("*.safetensors")
        assert read_header(path).meta.fingerprint == F and tiers.tier_of("k") == "dram"
    finally:
        await tiers.close()


@pytest.mark.parametrize("demoted_by", ["pressure", "pin"])
def test_a_chunk_put_again_with_another_fingerprint_is_that_one_on_disk_after_a_restart(
    node_factory, pool_url, tmp_path: Path, demoted_by: str
):
    """The same bytes under one key, put with F, on disk, read back into DRAM (the file stays), then put with G:
    the copy that outlives a restart is G's (its header says G), never the earlier file taken as the same chunk
    because its bytes match."""
    from backend import admin

    nvme = tmp_path / "nvme"
    args = ("--node-id", "disk", "--nvme-dir", str(nvme), "--nvme", "64MiB")
    node = node_factory(*args, dram="1MiB")
    same = _data(9, 128 * KIB)
    filler = [Chunk(f"filler@{i}", _data(100 + i, 128 * KIB)) for i in range(24)]  # 3 MiB through 1 MiB of DRAM
    on_disk = nvme / CHUNKS_DIR

    def headers() -> list[int]:
        return [
            read_header(p).meta.fingerprint for p in on_disk.rglob("*.safetensors") if read_header(p).meta.key == "same"
        ]

    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put([Chunk("same", same, fingerprint=F)])
        for chunk in filler[:10]:
            client.put([chunk])
        assert wait_until(lambda: headers() == [F], 10.0)  # demoted with F
        assert [bytes(g.data) for g in client.get(["same"], fingerprint=F)] == [same]  # promoted; the file stays
        client.put([Chunk("same", same, fingerprint=G)])
        if demoted_by == "pin":  # a pinned DRAM chunk gets its file at once (Demoter.save_copy)
            client._call(admin.pin(client._client, ["same"], ttl_s=600))
        else:  # 14 chunks after it, 1.75 MiB: more than DRAM holds, so it goes to disk whatever the demoter's pace
            for chunk in filler[10:]:
                client.put([chunk])
        assert wait_until(lambda: headers() == [G], 10.0)
    node.kill()
    node_factory(*args, dram="1MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        assert wait_recovered(client)
        assert client.get(["same"], fingerprint=F) == [None]
        assert [bytes(g.data) for g in client.get(["same"], fingerprint=G)] == [same]


def test_drain_moves_a_chunk_with_its_fingerprint(node_factory, pool_url):
    from backend.admin.draining import drain

    node_factory("--node-id", "from")
    node_factory("--node-id", "to")

    async def run() -> list[bytes | None]:
        async with PoolClient(PoolConfig.from_url(pool_url)) as client:
            await client.put([Chunk("moved", _data(5), fingerprint=F)], only=["from"])
            report = await drain(client, "from", to="to")
            assert report.moved == 1
            return await _read(client, ["moved"], F) + await _read(client, ["moved"], 0)

    assert asyncio.run(run()) == [_data(5), None]
