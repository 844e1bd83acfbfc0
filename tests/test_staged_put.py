"""Same-host puts through the client's shared-memory stage (PUT_STAGED), with real node processes."""

from __future__ import annotations

import glob
import os
import random
import tempfile

import pytest

import backend.client.stage as stage_module
from backend.client import Chunk, SyncPoolClient
from backend.config import PoolConfig
from backend.errors import KVPoolError, ProtocolError
from backend.metadata import NodeInfo
from backend.protocol import ItemMeta, Op, checksum
from backend.protocol.meta import decode_flags
from backend.protocol.puts import PutStaged
from backend.shm import PutStage
from tests.conftest import raw_request

MiB = 1024 * 1024


def _chunks(prefix: str, count: int, size: int, seed: int = 0) -> list[Chunk]:
    rng = random.Random(seed)
    return [Chunk(f"{prefix}@{i}", rng.randbytes(size), "bfloat16", (size // 2,), 1) for i in range(count)]


def _node(client: SyncPoolClient) -> NodeInfo:
    (node,) = client.nodes()
    return node


def _stages() -> set[str]:
    """This process's stages (the name carries the pid): other processes' come and go meanwhile."""
    return set(glob.glob(f"/dev/shm/kvpool-{os.getpid()}-*.stage"))


def test_a_same_host_put_goes_through_the_stage_and_reads_back_identical_everywhere(node_factory, pool_url):
    node_factory(shm=True)
    before = _stages()
    chunks = _chunks("staged", 8, MiB + 4096, seed=1)  # 8 MiB: two stripes, copied on threads
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        assert client.counters["staged_put_bytes"] == sum(len(c.data) for c in chunks)
        stats = client.node_stats(_node(client))
        assert stats["counters"]["staged_put_bytes"] == sum(len(c.data) for c in chunks)
        assert stats["counters"]["puts"] == 8
        mapped = client.get([c.key for c in chunks])  # through the arena
        assert [bytes(g.data) for g in mapped] == [c.data for c in chunks]
        assert [(g.meta.dtype, g.meta.shape, g.meta.fmt) for g in mapped] == [
            ("bfloat16", (c.data.__len__() // 2,), 1) for c in chunks
        ]
        assert len(_stages() - before) == 1  # this client's stage, while it is open
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?shm=off")) as remote:
        over_tcp = remote.get([c.key for c in chunks])  # as another host reads them
        assert [bytes(g.data) for g in over_tcp] == [c.data for c in chunks]
        assert remote.counters.get("staged_put_bytes", 0) == 0
    assert _stages() == before  # closing the client removed its stage


def test_a_put_larger_than_the_stage_goes_through_it_in_parts(node_factory, pool_url, monkeypatch):
    monkeypatch.setattr(stage_module, "STAGE_BYTES", 3 * MiB)
    node_factory(shm=True)
    chunks = _chunks("parts", 7, MiB, seed=2)  # 7 MiB through a 3 MiB stage: three parts
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        assert client.counters["staged_put_bytes"] == 7 * MiB
        assert [bytes(g.data) for g in client.get([c.key for c in chunks])] == [c.data for c in chunks]


def test_a_staged_chunk_that_does_not_match_its_checksum_is_refused_and_not_stored(node_factory, pool_url, monkeypatch):
    node_factory(shm=True)

    original = PutStage.write_checked

    def changed_after_hashing(self: PutStage, offset: int, data: memoryview) -> int:
        digest = original(self, offset, data)
        self._array[offset] ^= 0xFF  # the client's bytes changed after they were hashed
        return digest

    monkeypatch.setattr(PutStage, "write_checked", changed_after_hashing)
    chunk = _chunks("torn", 1, MiB, seed=3)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        with pytest.raises(KVPoolError, match="not stored"):
            client.put(chunk)
        assert client.contains([chunk[0].key]) == [False]
        assert client.node_stats(_node(client))["counters"]["integrity_failures"] == 1


def test_a_client_that_cannot_make_a_stage_puts_over_tcp(node_factory, pool_url, monkeypatch):
    def no_room(directory: str, size_bytes: int) -> PutStage:
        raise OSError(28, "No space left on device")  # /dev/shm full: cannot be caused here without root

    monkeypatch.setattr(stage_module, "PutStage", no_room)
    node_factory(shm=True)
    chunks = _chunks("tcp", 4, MiB, seed=4)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        assert client.counters.get("staged_put_bytes", 0) == 0
        assert [bytes(g.data) for g in client.get([c.key for c in chunks])] == [c.data for c in chunks]


def test_the_node_maps_only_a_stage_of_its_own_with_the_right_token(node_factory, pool_url):
    node_factory(shm=True)
    item = ItemMeta("k", 4096, checksum(bytes(4096)), "uint8", (4096,), 0)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        node = _node(client)
        arena_dir = os.path.dirname(node.shm_path)
        stage = PutStage(arena_dir, 64 * 1024)
        elsewhere = PutStage(tempfile.gettempdir(), 64 * 1024)  # a stage, but not in the arena's directory
        try:

            def put_staged(name: str, token: str, offset: int = 4096) -> bytes:
                meta = PutStaged.encode_request(name, token, [item], [offset])
                return client._call(raw_request(client._client, node, Op.PUT_STAGED, meta))

            assert decode_flags(put_staged(stage.name, stage.token), 1) == [0]  # stored (the stage holds zeros)
            assert client.contains(["k"]) == [True]
            refusals = [
                (lambda: put_staged(stage.name, "0" * 32), "not the arena"),  # wrong token
                (lambda: put_staged("../../etc/passwd", stage.token), "not a kvpool stage name"),
                (lambda: put_staged(os.path.basename(node.shm_path), stage.token), "not a kvpool stage name"),
                (lambda: put_staged(elsewhere.name, elsewhere.token), "cannot be used"),  # not in its directory
                (lambda: put_staged(stage.name, stage.token, 64 * 1024 + 4096), "outside"),  # ends past the file
            ]
            for attempt, reason in refusals:
                with pytest.raises(ProtocolError, match=reason):
                    attempt()
        finally:
            stage.close()
            elsewhere.close()
