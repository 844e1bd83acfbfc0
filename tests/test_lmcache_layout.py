"""Never a wrong hit across KV layouts: LMCache engines that make the same keys for differently laid-out bytes.

LMCache's in-process key carries the model name, TP size, worker id and dtype, not the
KV shape or the chunk size: two engines that differ only there ask for each other's keys.
Each test stores with one engine (LMCache's own RemoteBackend through the kvpool plugin)
and reads with another; the reader of another layout must get no bytes at all, and say so
in its counters and the node's, while an engine of the writer's layout still hits.
"""

from __future__ import annotations

import pytest
import torch

from backend.config import PoolConfig
from backend.counters import ClientCounter, NodeCounter
from kvpool import SyncPoolClient

SEEDS = range(4)


def _node_counter(url: str, name: NodeCounter) -> int:
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        return sum(int(client.node_stats(node)["counters"].get(str(name), 0)) for node in client.nodes())


def _stored_by(stack, first_hash: int) -> list:
    keys = [stack.key(first_hash + i) for i in SEEDS]
    objs = [stack.make_object(seed) for seed in SEEDS]
    stack.put(keys, objs)
    stack.release(objs)
    return keys


@pytest.mark.parametrize(
    ("other", "config"),
    [
        # The same memory-object shape [2, 4, 256, 512] and size: only the KV heads and head size differ.
        ({"hidden": (4, 128)}, {}),
        # Twice the layers at half the hidden size: the same bytes per chunk, another shape.
        ({"num_layers": 8, "hidden": (4, 64)}, {}),
        # A 128-token engine: a 128-token prompt's chunk hash is the same as a 256-token engine's partial chunk.
        ({}, {"chunk_size": 128}),
    ],
    ids=["kv-heads", "layers", "chunk-size"],
)
def test_an_engine_of_another_kv_layout_gets_no_bytes_of_the_same_keys_and_counts_a_layout_miss(
    node_factory, pool_url, stack_factory, other, config
):
    node_factory()
    writer = stack_factory(pool_url)
    keys = _stored_by(writer, 0x51)
    reader = stack_factory(pool_url, engine=other, **config)
    assert reader.key(0x51) == keys[0]  # the keys LMCache makes cannot tell the two engines apart

    got = reader.get(keys)
    assert got == [None] * len(keys)
    assert reader.connector().counters[str(ClientCounter.LAYOUT_MISSES)] == len(keys)
    assert _node_counter(pool_url, NodeCounter.LAYOUT_MISSES) == len(keys)

    # An engine of the writer's layout still gets every chunk, byte for byte.
    same = stack_factory(pool_url)
    hits = same.get(keys)
    assert all(h is not None for h in hits)
    assert all(torch.equal(h.tensor, writer.expected_tensor(seed)) for h, seed in zip(hits, SEEDS))
    assert same.connector().counters[str(ClientCounter.LAYOUT_MISSES)] == 0
    same.release(hits)


def test_a_lookup_from_another_layout_finds_the_keys_and_the_get_that_follows_misses(
    node_factory, pool_url, stack_factory
):
    """The lookup is Redis alone and knows no layouts: it answers hit, and the get then reads as misses,
    which LMCache's retrieve treats as the end of the hit prefix (as for a chunk evicted in between)."""
    node_factory()
    writer = stack_factory(pool_url)
    keys = _stored_by(writer, 0x77)
    reader = stack_factory(pool_url, engine={"hidden": (4, 128)})
    assert reader.contains_prefix(keys) == len(keys)
    assert reader.get(keys) == [None] * len(keys)
    # The chunks stay indexed for the engines of their layout: a layout miss is no stale entry.
    assert writer.contains_prefix(keys) == len(keys)
    assert reader.connector().counters[str(ClientCounter.STALE_ENTRIES)] == 0


def test_an_engine_reading_through_the_nodes_shared_memory_gets_no_bytes_of_another_layout(
    node_factory, pool_url, stack_factory
):
    node_factory(shm=True)
    writer = stack_factory(pool_url)
    keys = _stored_by(writer, 0x91)
    reader = stack_factory(pool_url, engine={"hidden": (4, 128)})
    assert reader.get(keys) == [None] * len(keys)
    assert reader.connector().counters[str(ClientCounter.LAYOUT_MISSES)] == len(keys)
    assert reader.connector().counters[str(ClientCounter.SHM_GET_BYTES)] == 0
    same = stack_factory(pool_url)
    hits = same.get(keys)
    assert all(h is not None for h in hits)
    assert same.connector().counters[str(ClientCounter.SHM_GET_BYTES)] == len(keys) * writer.chunk_bytes
    same.release(hits)
