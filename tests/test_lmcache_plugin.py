"""kvpool as LMCache sees it: built by LMCache's own CreateStorageBackends from a config.

LMCache hides plugin failures as silent misses, so these tests prove real hits
through LMCache's RemoteBackend, and that every failure stays a bounded miss. Both
forms that enable kvpool are covered: the plugin entry and ``remote_url``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from backend.embedded import EmbeddedRedis, free_port
from backend.lmcache.config import REMOTE_URL_FORM, lmcache_remote_url
from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config
from bench.engine import FIRST_HASH
from kvpool.lmcache_connector import ALLOCATE_TIMEOUT_S
from tests.conftest import REPO
from tests.support.waits import wait_until
from tests.test_put_room import MiB, PutInFlight


def _worker(role: str, url: str, count: int, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine", role, url, "--chunks", str(count), *extra],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_b_in_another_process_reads_what_engine_a_stored(node_factory, pool_url):
    node_factory()
    stored = _worker("put", pool_url, 6)
    assert stored["hit_prefix"] == 6
    assert "RemoteBackend-kvpool" in stored["backends"]
    read = _worker("get", pool_url, 6)
    assert read["hit_prefix"] == 6
    assert read["hits"] == 6 and read["identical"] == 6
    assert read["shape"] == [2, 4, 256, 512]
    assert read["dtype"] == "torch.bfloat16" and read["fmt"] == "KV_2LTD"
    assert read["close_s"] < 1.0 and stored["close_s"] < 1.0


def test_engine_on_the_nodes_host_reads_through_shared_memory_and_gets_the_same_bytes(node_factory, pool_url):
    node_factory(shm=True)
    _worker("put", pool_url, 6)
    mapped = _worker("get", pool_url, 6)
    assert mapped["hits"] == 6 and mapped["identical"] == 6
    assert mapped["shm_get_bytes"] == 6 * mapped["chunk_bytes"]
    over_tcp = _worker("get", pool_url + "?shm=off", 6)
    assert over_tcp["hits"] == 6 and over_tcp["identical"] == 6
    assert over_tcp["shm_get_bytes"] == 0


def test_batched_async_contains_counts_the_prefix_before_a_missing_key(node_factory, pool_url, stack_factory):
    node_factory()
    stack = stack_factory(pool_url)
    keys = [stack.key(100 + i) for i in range(5)]
    objs = [stack.make_object(i) for i in range(5)]
    stack.put(keys[:2] + keys[3:], objs[:2] + objs[3:])
    assert stack.contains_prefix(keys) == 2
    assert stack.contains_prefix(keys[3:]) == 2
    assert stack.remote.batched_contains(keys) == 2  # the sync variant, from this thread
    got = stack.get(keys)
    assert [g is not None for g in got] == [True, True, False, True, True]
    stack.release(objs + got)


def test_remove_and_list_go_through_the_pool(node_factory, pool_url, stack_factory):
    node_factory()
    stack = stack_factory(pool_url)
    keys = [stack.key(7 + i) for i in range(3)]
    objs = [stack.make_object(i) for i in range(3)]
    stack.put(keys, objs)
    stack.release(objs)
    listed = asyncio.run_coroutine_threadsafe(stack.connector().list(), stack.loop).result(10)
    assert sorted(listed) == sorted(k.to_string() for k in keys)
    assert stack.remote.remove(keys[0]) is True
    assert stack.contains_prefix(keys) == 0 and stack.contains_prefix(keys[1:]) == 2


def _max_loop_gap_while(stack: LMCacheStack, action) -> tuple[float, object]:
    """Run ``action`` while ticking LMCache's loop; returns the longest gap between ticks."""
    gaps: list[float] = []
    stop = threading.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    future = asyncio.run_coroutine_threadsafe(ticker(), stack.loop)
    try:
        result = action()
    finally:
        stop.set()
        future.result(5)
    return max(gaps), result


def test_killed_node_gives_misses_within_the_timeout_and_never_blocks_the_loop(node_factory, pool_url, stack_factory):
    node = node_factory()
    stack = stack_factory(pool_url + "?progress_timeout_s=0.5")
    keys = [stack.key(200 + i) for i in range(4)]
    objs = [stack.make_object(i) for i in range(4)]
    stack.put(keys, objs)
    stack.release(objs)
    node.kill()
    start = time.monotonic()
    gap, got = _max_loop_gap_while(stack, lambda: stack.get(keys))
    assert got == [None] * 4
    assert time.monotonic() - start < 1.5
    assert gap < 0.5
    # put after the node died: no exception escapes into LMCache either
    more = [stack.make_object(9)]
    stack.put([stack.key(999)], more)
    stack.release(more)
    assert stack.connector().counters["miss_put"] == 1


def test_a_put_the_busy_pool_refuses_is_a_skipped_put_not_a_failure(node_factory, pool_url, stack_factory, caplog):
    node = node_factory(dram="8MiB")
    stack = stack_factory(pool_url + "?progress_timeout_s=1")  # a put may wait 0.5 s for room
    skipped, later = [stack.make_object(1)], [stack.make_object(2)]
    in_flight = PutInFlight(node, 8 * MiB)  # all of the node's DRAM, for longer than that
    try:
        with caplog.at_level(logging.WARNING, logger="backend"):
            stack.put([stack.key(700)], skipped)  # LMCache's put completes: no exception escapes
    finally:
        in_flight.land()
    counters = stack.connector().counters
    assert counters["put_skipped_busy"] == 1 and counters["miss_put"] == 0  # skipped, not failed
    assert not [r for r in caplog.records if r.name.startswith("backend") and r.levelno >= logging.WARNING]
    assert stack.contains_prefix([stack.key(700)]) == 0
    stack.put([stack.key(701)], later)  # room again: stored
    assert stack.contains_prefix([stack.key(701)]) == 1
    assert stack.connector().counters["put_chunks"] == 1
    stack.release(skipped + later)


def test_redis_down_during_the_run_misses_then_recovers(node_factory, redis_factory, stack_factory):
    redis = EmbeddedRedis().start()
    redis_factory.append(redis)
    node_factory(redis_url=redis.url, ns="lmc")
    stack = stack_factory(f"kvpool://127.0.0.1:{redis.port}/lmc?progress_timeout_s=0.5")
    keys = [stack.key(300 + i) for i in range(3)]
    objs = [stack.make_object(i) for i in range(3)]
    stack.put(keys, objs)
    redis.kill()
    assert stack.contains_prefix(keys) == 0
    assert stack.get(keys) == [None] * 3
    restarted = EmbeddedRedis(redis.port)
    redis_factory.append(restarted)
    restarted.start()
    assert wait_until(lambda: stack.contains_prefix(keys) == 3, 15.0)
    got = stack.get(keys)
    assert all(g is not None for g in got)
    stack.release(objs + got)


def test_pool_down_at_start_is_reported_once_at_error_with_the_fix(stack_factory, caplog):
    caplog.set_level(logging.WARNING)
    stack = stack_factory(f"kvpool://127.0.0.1:{free_port()}/none?progress_timeout_s=0.3")
    assert wait_until(lambda: any("not usable at start" in r.message for r in caplog.records), 5.0)
    keys = [stack.key(1), stack.key(2)]
    assert stack.contains_prefix(keys) == 0
    assert stack.contains_prefix(keys) == 0
    assert stack.get(keys) == [None, None]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("backend")]
    assert len(errors) == 1
    assert "Fix:" in errors[0].message and "kvpool up" in errors[0].message


def test_bad_pool_url_is_reported_at_error_with_the_fix(caplog):
    caplog.set_level(logging.WARNING)
    stack = LMCacheStack(kvpool_lmcache_config("kvpool://127.0.0.1/no-port"))
    try:
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("backend")]
        assert len(errors) == 1
        assert "missing Redis port" in errors[0].message and "Fix:" in errors[0].message
        assert stack.remote.connection is None  # LMCache itself only logs and runs without it
    finally:
        stack.close()


def test_get_waits_a_bounded_time_when_lmcaches_buffer_is_full(node_factory, pool_url, stack_factory):
    node_factory()
    stack = stack_factory(pool_url, max_local_cpu_size=0.02)  # ~20 MiB: ten 2 MiB chunks
    keys = [stack.key(400 + i) for i in range(2)]
    objs = [stack.make_object(i) for i in range(2)]
    stack.put(keys, objs)
    hog = [o for o in iter(lambda: stack.local.allocate(stack.shape, stack.dtype, busy_loop=False), None)]
    assert hog, "the buffer should have had room before"
    start = time.monotonic()
    gap, got = _max_loop_gap_while(stack, lambda: stack.get(keys))
    elapsed = time.monotonic() - start
    assert got == [None, None]
    assert stack.connector().counters["miss_allocate"] >= 1
    assert ALLOCATE_TIMEOUT_S <= elapsed < ALLOCATE_TIMEOUT_S + 1.5
    assert gap < 0.5
    stack.release(hog)
    got = stack.get(keys)  # room again: real hits
    assert all(g is not None for g in got)
    stack.release(objs + got)


def test_a_process_using_kvpool_exits_cleanly(node_factory, pool_url):
    node_factory()
    code = (
        "from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config\n"
        f"s = LMCacheStack(kvpool_lmcache_config({pool_url!r}))\n"
        "o = [s.make_object(1)]; s.put([s.key(1)], o); s.release(o)\n"
        "assert s.contains_prefix([s.key(1)]) == 1\n"
        "s.close()\n"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - start < 60


def test_connector_counters_reach_prometheus_in_process(node_factory, pool_url, stack_factory):
    from prometheus_client import REGISTRY

    node_factory()
    stack = stack_factory(pool_url)
    keys = [stack.key(600 + i) for i in range(3)]
    objs = [stack.make_object(i) for i in range(3)]
    stack.put(keys, objs)
    got = stack.get([*keys, stack.key(699)])
    stack.release(objs + got)
    hits = REGISTRY.get_sample_value("kvpool_connector_get_hits_total", {"plugin": "kvpool"})
    misses = REGISTRY.get_sample_value("kvpool_connector_get_misses_total", {"plugin": "kvpool"})
    assert hits is not None and hits >= 3 and misses is not None and misses >= 1


# -- the remote_url form ----------------------------------------------------------------


def _remote_backends(backends: list[str]) -> list[str]:
    return [name for name in backends if name.startswith("RemoteBackend")]


def test_remote_url_alone_builds_one_remote_backend_and_engine_b_reads_what_engine_a_stored(node_factory, pool_url):
    node_factory()
    stored = _worker("put", pool_url, 6, "--form", REMOTE_URL_FORM)
    assert _remote_backends(stored["backends"]) == ["RemoteBackend"]
    assert stored["hit_prefix"] == 6
    read = _worker("get", pool_url, 6, "--form", REMOTE_URL_FORM)
    assert _remote_backends(read["backends"]) == ["RemoteBackend"]
    assert read["hit_prefix"] == 6 and read["hits"] == 6 and read["identical"] == 6
    assert read["shape"] == [2, 4, 256, 512] and read["fmt"] == "KV_2LTD"


def test_lmcache_remote_url_in_the_environment_alone_reads_what_a_plugin_engine_stored(
    node_factory, pool_url, monkeypatch
):
    node_factory()
    _worker("put", pool_url, 4)  # the plugin form, in another process: same keys, same pool
    config = kvpool_lmcache_config(pool_url, form=REMOTE_URL_FORM)
    del config["remote_url"]  # the file says nothing about kvpool: the environment does, as Helm charts set it
    monkeypatch.setenv("LMCACHE_REMOTE_URL", lmcache_remote_url(pool_url))
    stack = LMCacheStack(config)
    try:
        assert _remote_backends(list(stack.backends)) == ["RemoteBackend"]
        assert stack.config.remote_url == lmcache_remote_url(pool_url)
        keys = [stack.key(FIRST_HASH + i) for i in range(4)]
        assert stack.contains_prefix(keys) == 4
        got = stack.get(keys)
        assert all(
            g is not None and torch.equal(g.tensor.view(torch.uint8), stack.expected_tensor(i).view(torch.uint8))
            for i, g in enumerate(got)
        )
        stack.release(got)
    finally:
        stack.close()


def test_a_malformed_remote_url_is_refused_at_error_once_naming_the_bad_part(caplog):
    caplog.set_level(logging.WARNING)
    remote_url = lmcache_remote_url(f"kvpool://127.0.0.1:{free_port()}/ns") + "&replicas=lots"
    stack = LMCacheStack({**kvpool_lmcache_config("kvpool://unused:1", form=REMOTE_URL_FORM), "remote_url": remote_url})
    try:
        assert stack.remote.connection is None  # LMCache itself only logs and runs without it
        stack.remote.failure_time = -1e9  # LMCache's health check retries the connection: no second ERROR
        stack.remote.init_connection()
        assert stack.remote.connection is None
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("backend")]
        assert len(errors) == 1
        message = errors[0].getMessage()
        assert "replicas: 'lots' is not an integer" in message and "remote_url" in message
        assert "Fix:" in message and "--form remote_url" in message
    finally:
        stack.close()


# -- memory objects of several shape groups (hybrid models) -----------------------------


class HybridEngine:
    """LMCache's storage for an engine whose KV cache has two groups (other layers, heads and dtype).

    The groups come from LMCache's own ``KVLayerGroupsManager`` over vLLM-shaped CPU KV
    tensors, as an engine registers them; LMCache builds its backends from the config.
    """

    def __init__(self, config: dict, config_path: Path) -> None:
        import yaml
        from lmcache.utils import EngineType
        from lmcache.v1.config import load_engine_config_with_overrides
        from lmcache.v1.gpu_connector.utils import normalize_and_discover_per_layer_formats
        from lmcache.v1.kv_layer_groups import KVLayerGroupsManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend import CreateStorageBackends

        from backend.threads import LoopThread

        blocks = 5
        kv_caches = [torch.zeros(2, blocks, 16, 8, 64, dtype=torch.bfloat16) for _ in range(2)]
        kv_caches.append(torch.zeros(2, blocks, 16, 4, 32, dtype=torch.float16))
        normalized, formats = normalize_and_discover_per_layer_formats(kv_caches, [], EngineType.VLLM, None)
        groups = KVLayerGroupsManager(list(normalized), engine_kv_formats=formats, lmcache_tokens_per_chunk=256)
        self.metadata = LMCacheMetadata(
            model_name="kvpool-test/hybrid",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(3, 2, 256, 8, 64),
            kv_layer_groups_manager=groups,
        )
        assert self.metadata.get_num_groups() == 2
        config_path.write_text(yaml.safe_dump(config))
        self.config = load_engine_config_with_overrides(config_file_path=str(config_path))
        self.loop = LoopThread("lmcache-hybrid")
        self.backends = CreateStorageBackends(self.config, self.metadata, self.loop.loop)
        self.local = self.backends["LocalCPUBackend"]
        (self.remote,) = [b for name, b in self.backends.items() if name.startswith("RemoteBackend")]

    def make_object(self, tokens: int, seed: int) -> object:
        from lmcache.v1.memory_management import MemoryFormat

        obj = self.local.allocate(self.metadata.get_shapes(tokens), self.metadata.get_dtypes(), MemoryFormat.KV_2LTD)
        assert obj is not None and len(obj.get_shapes()) == 2
        generator = torch.Generator().manual_seed(seed)
        view = memoryview(obj.byte_array).cast("B")
        view[:] = torch.randint(0, 256, (len(view),), dtype=torch.uint8, generator=generator).numpy().tobytes()
        return obj

    def key(self, chunk_hash: int) -> object:
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey("kvpool-test/hybrid", 1, 0, chunk_hash, torch.bfloat16)

    def close(self) -> None:
        from tests.support.waits import run_with_timeout

        run_with_timeout(lambda: [b.close() for b in self.backends.values()], 5.0)
        self.loop.stop(5.0, close=False)


def test_an_object_of_two_shape_groups_is_stored_and_read_back_whole_by_another_engine(
    node_factory, pool_url, tmp_path
):
    from backend.protocol.meta import ANY_FINGERPRINT
    from kvpool import Chunk, PoolConfig, SyncPoolClient

    node_factory()
    config = kvpool_lmcache_config(pool_url)
    writer, reader = HybridEngine(config, tmp_path / "writer.yaml"), HybridEngine(config, tmp_path / "reader.yaml")
    try:
        full, partial = writer.make_object(256, 1), writer.make_object(100, 2)  # a last chunk holds fewer tokens
        expected = [bytes(full.byte_array), bytes(partial.byte_array)]
        keys = [writer.key(1), writer.key(2)]
        done = threading.Semaphore(0)
        writer.remote.batched_submit_put_task(keys, [full, partial], on_complete_callback=lambda _k: done.release())
        assert all(done.acquire(timeout=30) for _ in keys)
        LMCacheStack.release([full, partial])
        with SyncPoolClient(PoolConfig.from_url(pool_url)) as pool:  # stored as its bytes, with its format
            # Read as an admin copy does (any layout fingerprint): a reader of none would miss them.
            stored = pool.get([k.to_string() for k in keys], fingerprint=ANY_FINGERPRINT)
            assert [(s.meta.dtype, s.meta.shape, s.meta.fmt) for s in stored] == [
                ("uint8", (len(e),), int(full.get_memory_format().value)) for e in expected
            ]
            fingerprint = stored[0].meta.fingerprint
            assert fingerprint and fingerprint == stored[1].meta.fingerprint  # the engine's layout, both groups
            odd = Chunk(
                writer.key(3).to_string(), bytes(10240 * 7 + 1), fmt=stored[0].meta.fmt, fingerprint=fingerprint
            )
            pool.put([odd])
        # Bytes that are no whole number of this engine's tokens (10240 bytes each) are a miss, not a wrong
        # object; that key alone: the others of its batch still hit, and the node is not held suspect.
        mixed = reader.remote.batched_get_blocking([writer.key(3), *keys])
        assert mixed[0] is None and [g is not None for g in mixed[1:]] == [True, True]
        LMCacheStack.release(mixed[1:])
        got = reader.remote.batched_get_blocking(keys)
        assert [g is not None for g in got] == [True, True]
        for obj, tokens, data in zip(got, (256, 100), expected):
            assert obj.get_shapes() == reader.metadata.get_shapes(tokens)
            assert obj.get_dtypes() == [torch.bfloat16, torch.float16]
            assert bytes(obj.byte_array) == data
            obj.ref_count_down()
        connector = reader.remote.connection
        connector = connector.getWrappedConnector() if hasattr(connector, "getWrappedConnector") else connector
        assert connector.counters["get_hits"] == 4 and connector.counters["miss_size"] == 1
    finally:
        writer.close()
        reader.close()


def test_lmcaches_own_create_connector_without_metadata_builds_a_connector_that_hits(
    node_factory, pool_url, stack_factory
):
    from lmcache.v1.storage_backend.connector import CreateConnector

    node_factory()
    stack = stack_factory(pool_url)
    keys = [stack.key(300)]
    objs = [stack.make_object(3)]
    expected = objs[0].tensor.clone()
    stack.put(keys, objs)
    stack.release(objs)
    # As LMCache's own tests call it: no metadata (the engine's is the local CPU backend's).
    connector = CreateConnector("plugin://kvpool", stack.loop, stack.local, stack.config)

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, stack.loop).result(10)

    try:
        assert on_loop(connector.exists(keys[0])) is True
        got = on_loop(connector.get(keys[0]))
        assert got is not None and torch.equal(got.tensor.view(torch.uint8), expected.view(torch.uint8))
        got.ref_count_down()
    finally:
        on_loop(connector.close())
