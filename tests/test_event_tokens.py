"""Token ids and parent hashes in the pool's KV events (docs/fleet-events.md, "Events for routers"), end to end.

A real ``LMCacheEngine`` on CPU, built by ``LMCacheEngineBuilder`` as LMCache's vLLM integration
builds it, stores prompts through its kvpool connector (``event_tokens=on``) into real node
processes that keep an event ring; the endpoint's stream is read by the vLLM-format consumer
(tests/support/vllm_events.py). The engine's GPU connector is LMCache's ``MockGPUConnector``:
on CPU no KV bytes move, which events do not need (the chunks stored are LMCache's allocations,
as they are). The reference is LMCache itself: the same engine runs with its own
``enable_kv_events``, and its ``CacheStoreEvent`` of each chunk (hash, parent, token ids) is what
each ``BlockStored`` must say.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
import zmq.asyncio

from backend.errors import ProtocolError
from backend.events import EndpointConfig, EventsEndpoint, curve_keys
from backend.events.view import sub_block_hashes
from backend.protocol import ItemMeta
from backend.protocol.puts import PutBatch, PutOptions
from backend.protocol.tokens import ChunkTokens, encode_record
from kvpool import Chunk, PoolClient, PoolConfig
from tests.support import vllm_events
from tests.support.waits import until

TOKEN = "event-tokens-token-0123456789abcdef0123"
MODEL = "tokens-test-model"
CHUNK = 16  # LMCache's chunk_size in these engines
RING = ("--event-ring-keys", "10000")
U64 = (1 << 64) - 1
_instances = itertools.count()


def u64(chunk_hash: int) -> int:
    return chunk_hash & U64


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def lmcache_engine(url: str, tmp_path: Path) -> Iterator[Any]:
    """A real LMCacheEngine (LMCacheEngineBuilder.get_or_create + post_init) with the kvpool plugin at ``url``."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import load_engine_config_with_overrides
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    from backend.lmcache.stack import kvpool_lmcache_config

    cfg = kvpool_lmcache_config(url, chunk_size=CHUNK, local_cpu_gib=0.05)
    cfg["enable_kv_events"] = True  # LMCache's own CacheStoreEvents: the reference
    path = tmp_path / f"lmcache-{next(_instances)}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = load_engine_config_with_overrides(config_file_path=str(path))
    shape = (2, 2, CHUNK, 2, 32)  # layers, K/V, tokens, heads, head size
    metadata = LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=shape,
    )
    instance = f"kvpool-event-tokens-{path.stem}"
    engine = LMCacheEngineBuilder.get_or_create(
        instance, config, metadata, MockGPUConnector(shape), lambda *a: None, lambda *a: None
    )
    engine.post_init()
    try:
        yield engine
    finally:
        LMCacheEngineBuilder.destroy(instance)


def connector_of(engine: Any) -> Any:
    """The engine's kvpool connector, inside LMCache's InstrumentedRemoteConnector."""
    return engine.storage_manager.storage_backends["RemoteBackend-kvpool"].connection.getWrappedConnector()


def lmcache_events(engine: Any) -> list[Any]:
    return list(engine.get_kv_events())


@contextlib.asynccontextmanager
async def stream(pool_url: str, **options: object) -> AsyncIterator[tuple[EventsEndpoint, vllm_events.Subscriber]]:
    ep = EventsEndpoint(
        PoolConfig.from_url(pool_url, {"KVPOOL_TOKEN": TOKEN}),
        EndpointConfig(
            model=MODEL, publish="tcp://127.0.0.1:*", replay="tcp://127.0.0.1:*", **{"poll_interval_s": 0.05, **options}
        ),  # type: ignore[arg-type]
    )
    ep.bind()
    task = asyncio.create_task(ep.run())
    ctx = zmq.asyncio.Context()
    k = curve_keys(TOKEN, ep.pool.namespace)
    sub = vllm_events.Subscriber(
        ctx, ep.publish_address, ep.replay_address, ep.topic, (k.server_public, k.client_public, k.client_secret)
    )
    try:
        await asyncio.sleep(0.3)  # ZMQ's slow joiner
        await sub.replay(0)
        yield ep, sub
    finally:
        sub.close()
        ctx.destroy(linger=0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ep.close()


async def stored_blocks(
    sub: vllm_events.Subscriber, count: int, timeout_s: float = 20.0
) -> list[vllm_events.BlockStored]:
    async def enough() -> bool:
        await sub.drain()
        return sum(len(e.block_hashes) for e in sub.mirror.stored_events) >= count

    await until(enough, timeout_s=timeout_s)
    return list(sub.mirror.stored_events)


def by_last_hash(events: list[vllm_events.BlockStored]) -> dict[int, vllm_events.BlockStored]:
    return {int(e.block_hashes[-1]): e for e in events}


async def test_blockstored_carries_each_chunks_token_ids_and_parent_as_lmcaches_own_event_says(
    node_factory, pool_url, token_file, tmp_path
):
    env = {"KVPOOL_TOKEN": TOKEN}
    node_factory(*RING, env=env)
    node_factory(*RING, env=env)  # a put's chunks are spread over both: the chain is rebuilt across nodes
    url = f"{pool_url}?token_file={token_file}&event_tokens=on"
    prompt = [1000 + 7 * i for i in range(5 * CHUNK + 3)]  # five chunks and a tail LMCache does not store
    async with stream(pool_url) as (_, sub):
        with lmcache_engine(url, tmp_path) as engine:
            engine.lookup(prompt)  # as vLLM's scheduler asks first
            await asyncio.to_thread(engine.store, prompt)
            reference = lmcache_events(engine)
            assert len(reference) == 5
            events = by_last_hash(await stored_blocks(sub, 5))
            counters = connector_of(engine).counters
        for i, want in enumerate(reference):
            got = events[u64(want.block_hashes[0])]
            assert list(got.token_ids) == prompt[i * CHUNK : (i + 1) * CHUNK]  # the tokens the chunk hash covers
            # LMCache 0.5.6's own event slices tokens[start:end + 1] (lmcache.utils.convert_tokens_to_list): one
            # token past its chunk, which the chunk's hash does not cover; the chunk's own tokens come first.
            assert list(want.token_ids)[:CHUNK] == list(got.token_ids)
            want_parent = None if want.parent_block_hash is None else u64(want.parent_block_hash)
            assert got.parent_block_hash == want_parent
            assert (got.block_size, len(got.block_hashes)) == (CHUNK, 1)
        assert (
            reference[0].parent_block_hash is None
            and events[u64(reference[0].block_hashes[0])].parent_block_hash is None
        )
        assert counters["event_tokens_bound"] == 5 and counters["event_tokens_unbound"] == 0


async def test_a_masked_store_names_the_real_parent_of_its_first_chunk(node_factory, pool_url, token_file, tmp_path):
    """LMCache's own event says 0 for the first chunk of a masked store; the chunk before it is its parent."""
    import torch
    from lmcache.v1.token_database import ChunkedTokenDatabase

    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})
    url = f"{pool_url}?token_file={token_file}&event_tokens=on"
    prompt = list(range(50_000, 50_000 + 4 * CHUNK))
    async with stream(pool_url) as (_, sub):
        with lmcache_engine(url, tmp_path) as engine:
            engine.lookup(prompt)
            mask = torch.ones(len(prompt), dtype=torch.bool)
            mask[: 2 * CHUNK] = False  # the first two chunks are stored already (by another request)
            await asyncio.to_thread(engine.store, torch.tensor(prompt), mask=mask)
            reference = lmcache_events(engine)
            events = by_last_hash(await stored_blocks(sub, 2))
            hashes = [
                u64(key.chunk_hash)
                for _, _, key in ChunkedTokenDatabase(engine.config, engine.metadata).process_tokens(prompt)
            ]
    assert len(reference) == 2 and reference[0].parent_block_hash == 0  # LMCache's own word for it
    third, fourth = events[hashes[2]], events[hashes[3]]
    assert third.parent_block_hash == hashes[1] and fourth.parent_block_hash == hashes[2]
    assert list(third.token_ids) == prompt[2 * CHUNK : 3 * CHUNK] and list(fourth.token_ids) == prompt[3 * CHUNK :]


async def test_a_block_size_below_the_chunk_size_splits_each_chunk_into_chained_blocks_and_removes_them_all(
    node_factory, pool_url, token_file, tmp_path
):
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN}, shm=True)  # the same-host path: PUT_STAGED carries them too
    url = f"{pool_url}?token_file={token_file}&event_tokens=on"
    prompt = [20 + i for i in range(3 * CHUNK)]
    block = 4
    async with stream(pool_url, chunk_size=CHUNK, block_size=block) as (ep, sub):
        with lmcache_engine(url, tmp_path) as engine:
            engine.lookup(prompt)
            await asyncio.to_thread(engine.store, prompt)
            reference = lmcache_events(engine)
            events = await stored_blocks(sub, 3 * CHUNK // block)
        chunk_hashes = [u64(e.block_hashes[0]) for e in reference]
        assert [list(e.block_hashes) for e in events] == [sub_block_hashes(h, CHUNK // block) for h in chunk_hashes]
        parent = None
        for event, chunk_hash in zip(events, chunk_hashes):
            assert (
                event.block_size == block
                and list(event.token_ids)
                == prompt[: len(prompt)][
                    chunk_hashes.index(chunk_hash) * CHUNK : (chunk_hashes.index(chunk_hash) + 1) * CHUNK
                ]
            )
            assert event.parent_block_hash == parent  # the first block's parent: the parent chunk's last block
            assert event.block_hashes[-1] == chunk_hash  # a chunk's last block is the chunk's own hash
            parent = chunk_hash
        assert len({h for e in events for h in e.block_hashes}) == 3 * CHUNK // block
        assert ep.view.unsplit == 0

        async with PoolClient(PoolConfig.from_url(pool_url, {"KVPOOL_TOKEN": TOKEN})) as client:
            keys = [
                key
                for node in await client.nodes()
                async for page in client.node_admin.inventory_pages(node)
                for key in (r.key for r in page)
            ]
            await client.delete(keys)

        async def all_gone() -> bool:
            await sub.drain()
            return not sub.mirror.blocks

        await until(all_gone, timeout_s=15.0)
        removed = {h for batch in sub.mirror.removed for h in batch}
        assert removed == {h for e in events for h in e.block_hashes}  # every block of every chunk


def test_a_block_size_that_does_not_divide_the_chunk_size_is_refused_at_start():
    with pytest.raises(Exception, match=r"--block-size.*does not divide the chunk size 16"):
        EndpointConfig(model=MODEL, chunk_size=CHUNK, block_size=5)
    assert EndpointConfig(model=MODEL, block_size=512).chunk_size == 0  # one chunk, one block, as before


async def test_chunks_without_tokens_are_stored_counted_and_announced_whole(
    node_factory, pool_url, token_file, tmp_path, stack_factory
):
    """A connector with no engine (LMCache's storage built alone) finds no token database: its puts are stored
    as ever, counted, and announced as one block of the chunk size even where the endpoint splits."""
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})
    url = f"{pool_url}?token_file={token_file}&event_tokens=on"
    async with stream(pool_url, chunk_size=CHUNK, block_size=4) as (ep, sub):
        stack = stack_factory(url, engine={"model": MODEL, "num_layers": 2, "hidden": (2, 32)}, chunk_size=CHUNK)
        keys = [stack.key(0xABC0 + i) for i in range(3)]
        objs = [stack.make_object(i) for i in range(3)]
        try:
            await asyncio.to_thread(stack.put, keys, objs)
        finally:
            stack.release(objs)
        events = await stored_blocks(sub, 3)
        assert all(list(e.token_ids) == [] and e.block_size == CHUNK and len(e.block_hashes) == 1 for e in events)
        assert ep.view.unsplit == 3
        connector = stack.connector()
        assert connector.counters["event_tokens_no_database"] == 3 and connector.counters["put_chunks"] == 3
        got = await asyncio.to_thread(stack.get, keys)
        assert all(obj is not None for obj in got)  # stored as ever
        stack.release(got)


async def test_a_put_of_keys_the_engine_never_hashed_is_stored_and_counted_unbound(
    node_factory, pool_url, token_file, tmp_path
):
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})
    url = f"{pool_url}?token_file={token_file}&event_tokens=on"
    import torch
    from lmcache.utils import CacheEngineKey

    with lmcache_engine(url, tmp_path) as engine:
        engine.lookup([1] * CHUNK)  # finds the database
        connector = connector_of(engine)
        manager = engine.storage_manager
        keys = [CacheEngineKey(MODEL, 1, 0, 0x5EED0 + i, torch.bfloat16) for i in range(2)]
        objs = [
            manager.allocate(engine.metadata.get_shapes(CHUNK), engine.metadata.get_dtypes(), fmt=engine.fmt)
            for _ in keys
        ]
        fut = asyncio.run_coroutine_threadsafe(connector.batched_put(keys, objs), connector.loop)
        await asyncio.wrap_future(fut)
        for obj in objs:
            obj.ref_count_down()
        assert connector.counters["event_tokens_unbound"] == 2 and connector.counters["put_chunks"] == 2


async def test_a_client_with_tokens_puts_to_a_node_without_a_ring_as_to_any_other(node_factory, pool_url):
    """A node without a ring (or of an older build) says nothing of event tokens in its registry entry, so no
    client sends it any: the put is the older form, stored as ever."""
    node_factory(env={"KVPOOL_TOKEN": TOKEN})
    async with PoolClient(PoolConfig.from_url(pool_url, {"KVPOOL_TOKEN": TOKEN})) as client:
        (node,) = await client.nodes(refresh=True)
        assert node.event_tokens is False
        chunk = Chunk(f"{MODEL}@1@0@abc@bfloat16", b"x" * 4096, tokens=ChunkTokens(None, [1, 2, 3]))
        await client.put([chunk])
        assert await client.hit_prefix([chunk.key]) == 1


def test_an_older_put_decodes_and_a_put_with_tokens_round_trips_and_a_bad_section_is_refused():
    items = [ItemMeta("a", 3, 1, "uint8", (3,), 0), ItemMeta("b", 2, 1, "uint8", (2,), 0, 7)]
    record = encode_record(ChunkTokens(0xFFFF_FFFF_FFFF_FFFE, [5, 6, 7]))
    with_tokens = PutBatch.encode_request(items, PutOptions(9, 100, {"a": record}))
    decoded, options = PutBatch.decode_request(with_tokens, 5)
    assert (
        options.tokens == {"a": record}
        and decoded[1].fingerprint == 7
        and (options.put_id, options.wait_ms) == (9, 100)
    )
    older = PutBatch.encode_request(items, PutOptions(9, 100))  # no records: byte for byte the older form
    assert older == with_tokens[: len(older)] and PutBatch.decode_request(older, 5)[1].tokens is None
    assert PutBatch.decode_request(older[:-16], 5)[1] == PutOptions(9, 100)  # options only, no fingerprints
    bad_version = bytearray(with_tokens)
    bad_version[len(older)] = 2
    with pytest.raises(ProtocolError, match="put tokens of version 2"):
        PutBatch.decode_request(bytes(bad_version), 5)
    with pytest.raises(ProtocolError, match=r"malformed|truncated"):
        PutBatch.decode_request(with_tokens[:-1], 5)
    with pytest.raises(ValueError, match=r"outside 0\.\.2\^32-1"):
        encode_record(ChunkTokens(None, [1 << 32]))


def test_the_ring_keeps_records_only_in_their_entries_and_an_answer_is_bounded_by_their_bytes():
    from backend.node.events import ENTRY_TOKEN_BYTES, EventRing
    from backend.protocol.events import MAX_EVENTS_TOKEN_BYTES, Events, EventsEntry, EventsPage

    record = encode_record(ChunkTokens(7, list(range(256))))  # 1,038 bytes: a 256-token chunk
    per_entry = ENTRY_TOKEN_BYTES // len(record)
    ring = EventRing(6 * per_entry)
    keys = [f"k{i}" for i in range(5 * per_entry)]
    ring.stored(keys, [record] * len(keys))
    ring.stored(["plain"])  # a put without records: its entry holds none
    entries = ring.since(0, 100_000).entries
    assert [len(e.keys) for e in entries] == [per_entry] * 5 + [1]  # cut by the records' bytes, not only by keys
    assert entries[-1].records is None and all(e.records == (record,) * per_entry for e in entries[:-1])
    page = ring.since(0, 100_000, max_token_bytes=MAX_EVENTS_TOKEN_BYTES)
    assert sum(e.token_bytes for e in page.entries) <= MAX_EVENTS_TOKEN_BYTES < sum(e.token_bytes for e in entries)
    ring.stored([f"j{i}" for i in range(6 * per_entry)])  # the records leave with their entries
    assert all(e.records is None for e in ring.since(0, 100_000).entries)

    # EVENTS: an older reader's request is the older bytes, and it is answered without records.
    assert Events.decode_request(Events.encode_request(3, 10)) == (3, 10, False)
    assert Events.decode_request(Events.encode_request(3, 10, tokens=True)) == (3, 10, True)
    answer = Events.decode_answer(
        Events.encode_answer(EventsPage((EventsEntry(0, 1, ("a", "b"), (record, None)),), 1, False))
    )
    assert answer.entries[0].tokens == (ChunkTokens(7, tuple(range(256))), None)


def test_a_runs_children_follow_their_parents_whatever_node_reported_them_first():
    from backend.events.view import parents_first
    from backend.events.wire import BlockRemoved, BlockStored

    def stored(h: int, parent: int | None) -> BlockStored:
        return BlockStored([h], parent, [], 16, None, "CPU", None)

    removed = BlockRemoved([99], "CPU")
    events = [stored(3, 2), stored(1, None), stored(2, 1), removed, stored(5, 4), stored(4, 3), stored(7, 6)]
    ordered = parents_first(events)
    # Within a run a parent comes first; across a removal nothing moves (it may be about the same block).
    assert [e.block_hashes[0] if isinstance(e, BlockStored) else "x" for e in ordered] == [1, 2, 3, "x", 4, 5, 7]


async def test_a_store_whose_parent_is_not_announced_yet_waits_one_poll_for_it(node_factory, pool_url):
    """A put's chunks reach the endpoint node by node: a child read a poll before its parent waits for it once
    (routers that rehash tokens attach a block to its parent's), and goes alone if the parent does not come."""
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})

    def chunk(h: int, parent: int | None) -> Chunk:
        return Chunk(f"{MODEL}@1@0@{h:x}@bfloat16", bytes([h & 0xFF]) * 4096, tokens=ChunkTokens(parent, [h, h + 1]))

    async with stream(pool_url, poll_interval_s=60) as (ep, sub):  # the endpoint's own loop polls once, at start
        async with PoolClient(PoolConfig.from_url(pool_url, {"KVPOOL_TOKEN": TOKEN})) as client:

            async def announced(count: int) -> list[int]:
                """The hashes announced once ``count`` are (what a poll published takes a moment to arrive)."""

                async def arrived() -> bool:
                    await sub.drain()
                    return sum(len(e.block_hashes) for e in sub.mirror.stored_events) >= count

                await until(arrived, timeout_s=10.0)
                return [int(h) for e in sub.mirror.stored_events for h in e.block_hashes]

            await client.put([chunk(0xC2, 0xC1)])
            before = ep.last_seq
            await ep.poll(client)
            assert ep.last_seq == before  # its parent is not announced: it waits, nothing is published
            await client.put([chunk(0xC1, None)])
            await ep.poll(client)
            assert await announced(2) == [0xC1, 0xC2]  # the parent came: both, parent first

            await client.put([chunk(0xD2, 0xD1)])  # a parent that never comes
            await ep.poll(client)
            await ep.poll(client)
            assert (await announced(3))[-1] == 0xD2  # waited once, then alone
            assert sub.mirror.stored_events[-1].parent_block_hash == 0xD1
