"""kvpool as an L2 adapter of LMCache's multiprocess mode, built the way LMCache builds it.

The round trip goes through LMCache's own ``StorageManager`` made from the server
arguments ``kvpool lmcache-config --mode mp`` prints; the adapter-level tests build
the adapter with LMCache's ``--l2-adapter`` parser and plugin factory, and drive it
through its event fds as LMCache's controllers do.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from backend.client import Chunk, SyncPoolClient
from backend.config import PoolConfig
from backend.errors import ConfigError, KVPoolError
from backend.lmcache.config import lmcache_mp_server_args, render_mp_command
from backend.lmcache.layout import object_fingerprint
from tests.conftest import REPO
from tests.support.lmcache import build_adapter
from tests.support.mp_stack import MPStack, parse_server_args, server_args
from tests.support.waits import wait_until
from tests.test_put_room import MiB, PutInFlight

WAIT_S = 30.0  # bound of every wait on an event fd or on the pool
CHUNK_BYTES = 2 * 2 * 16 * 1024 * 2  # MPStack's chunk: [2, 2 layers, 16 tokens, 1024] bfloat16


# -- helpers -------------------------------------------------------------------------
@pytest.fixture
def mp_stacks(processes: None) -> Iterator[Callable[..., MPStack]]:
    made: list[MPStack] = []

    def make(url: str, **kwargs: Any) -> MPStack:
        stack = MPStack(server_args(url), **kwargs)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close()


def object_key(index: int, salt: str = "", model: str = "kvpool-test/model") -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(index.to_bytes(8, "big") * 4, model, ObjectKey.ComputeKVRank(1, 0, 1, 0), 0, salt)


def memory_obj(tensor: torch.Tensor) -> Any:
    """A standalone LMCache memory object over ``tensor`` (what L1 hands an adapter)."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    raw = tensor.contiguous()
    metadata = MemoryObjMetadata(
        shape=raw.shape,
        dtype=raw.dtype,
        address=0,
        phy_size=raw.numel() * raw.element_size(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
        shapes=[raw.shape],
        dtypes=[raw.dtype],
    )
    return TensorMemoryObj(raw_data=raw, metadata=metadata, parent_allocator=None)


def payload(index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(index)
    return torch.randn((2, 2, 16, 1024), generator=generator).to(torch.bfloat16)


def await_result(fd: int, query: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Wait on an adapter event fd, as LMCache's controllers poll it, until ``query`` has a result."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = query()
        if result is not None:
            return result
        readable, _, _ = select.select([fd], [], [], max(0.0, min(0.5, deadline - time.monotonic())))
        if readable:
            os.read(fd, 8)  # an eventfd: reading resets it
    raise AssertionError(f"no result on event fd {fd} within {timeout_s} s")


def store(adapter: Any, keys: list[Any], objs: list[Any]) -> Any:
    task_id = adapter.submit_store_task(keys, objs)
    return await_result(adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task_id))


def lookup_and_lock(adapter: Any, keys: list[Any]) -> list[bool]:
    task_id = adapter.submit_lookup_and_lock_task(keys, {})
    bitmap = await_result(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(task_id))
    return [bitmap.test(i) for i in range(len(keys))]


def load(adapter: Any, keys: list[Any]) -> tuple[list[bool], list[torch.Tensor]]:
    targets = [torch.zeros((2, 2, 16, 1024), dtype=torch.bfloat16) for _ in keys]
    task_id = adapter.submit_load_task(keys, [memory_obj(t) for t in targets])
    bitmap = await_result(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task_id))
    return [bitmap.test(i) for i in range(len(keys))], targets


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _mp_worker(role: str, url: str, count: int, seed: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.mp_stack", role, url, "--chunks", str(count), "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the round trip through LMCache's own multiprocess storage ------------------------
def test_lmcache_mp_storage_stores_through_kvpool_and_a_fresh_process_loads_identical_bytes(node_factory, pool_url):
    node_factory()
    stored = _mp_worker("put", pool_url, 6, seed=7)
    assert stored["adapter"] == "KVPoolL2Adapter"
    assert stored["accepted"] == 6 and stored["stored"] is True
    read = _mp_worker("get", pool_url, 6, seed=7)
    assert read["hits"] == 6 and read["l2_hits"] == 6  # nothing was in the fresh process's L1
    assert read["identical"] == 6
    assert read["counters"]["loaded_chunks"] == 6


@pytest.mark.usefixtures("processes")
def test_the_printed_mp_config_is_what_lmcache_server_parses_and_what_the_quickstart_shows(pool_url, tmp_path):
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

    from tests.support.cli import QUICKSTART_PASSWORD_FILE, quickstart_url

    url, password_file = quickstart_url(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "backend.cli", "lmcache-config", "--mode", "mp", "--url", url, "--offline"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == render_mp_command(lmcache_mp_server_args(url))
    words = shlex.split(proc.stdout.replace("\\\n", " "))
    assert words[:2] == ["lmcache", "server"]
    config = parse_server_args(words[2:])
    (adapter,) = config.l2_adapter_config.adapters
    assert isinstance(adapter, PluginL2AdapterConfig)
    assert (adapter.module_path, adapter.class_name) == ("kvpool.lmcache_l2_adapter", "KVPoolL2Adapter")
    assert adapter.adapter_params == {"url": url}
    assert adapter.eviction_config is None  # the pool evicts on its own nodes
    quickstart = (REPO / "docs" / "quickstart.md").read_text()
    assert proc.stdout.replace(password_file, QUICKSTART_PASSWORD_FILE) in quickstart


# -- lookup-and-lock really locks -----------------------------------------------------
def _pressure(pool: SyncPoolClient, tag: str, count: int = 48) -> None:
    """Write ``count`` other chunks, one at a time: several times the node's DRAM."""
    filler = bytes(CHUNK_BYTES)
    for i in range(count):
        try:
            pool.put([Chunk(f"pressure-{tag}-{i}", filler)])
        except Exception:  # a full node may refuse some; pressure is what counts
            pass


def test_a_locked_chunk_survives_eviction_pressure_and_goes_once_unlocked(node_factory, pool_url, adapters):
    node_factory("--nvme", "0", dram="2MiB")
    adapter = adapters(pool_url)
    locked, unlocked = object_key(1), object_key(2)
    result = store(adapter, [locked, unlocked], [memory_obj(payload(1)), memory_obj(payload(2))])
    assert result.is_successful()
    assert lookup_and_lock(adapter, [locked]) == [True]
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as pool:
        names = [adapter_key(locked), adapter_key(unlocked)]
        _pressure(pool, "a")
        assert wait_until(lambda: pool.contains(names[1:]) == [False], WAIT_S), "the pressure evicted nothing"
        assert pool.contains(names[:1]) == [True]
        hits, got = load(adapter, [locked])
        assert hits == [True] and same_bytes(got[0], payload(1))
        adapter.submit_unlock([locked])
        assert wait_until(lambda: adapter.report_status()["locked_keys"] == 0, WAIT_S)

        def evicted_after_more_pressure() -> bool:
            _pressure(pool, f"b{time.monotonic_ns()}", 24)
            return pool.contains(names[:1]) == [False]

        assert wait_until(evicted_after_more_pressure, WAIT_S, interval_s=0.2)


def test_each_lookup_takes_its_own_lease_and_each_unlock_returns_one(node_factory, pool_url, adapters):
    node_factory()
    adapter = adapters(pool_url)
    key = object_key(3)
    assert store(adapter, [key], [memory_obj(payload(3))]).is_successful()
    assert lookup_and_lock(adapter, [key, object_key(99)]) == [True, False]
    assert lookup_and_lock(adapter, [key]) == [True]
    assert adapter.report_status()["locked_keys"] == 2
    adapter.submit_unlock([key])
    assert adapter.report_status()["locked_keys"] == 1
    adapter.submit_unlock([key, object_key(99)])  # a key never locked is ignored
    assert adapter.report_status()["locked_keys"] == 0


def adapter_key(key: Any) -> str:
    from kvpool.lmcache_l2_adapter import pool_key

    return pool_key(key)


# -- never blocks LMCache's threads ---------------------------------------------------
def _returns_at_once(call: Callable[[], Any]) -> Any:
    """Run ``call`` on another thread; fail if it has not returned within the bound."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive() and out, "the submit call blocked its caller"
    return out[0]


def test_submit_calls_return_at_once_and_results_arrive_through_the_event_fds(node_factory, pool_url, adapters):
    node = node_factory()
    adapter = adapters(pool_url + "?progress_timeout_s=20")
    ready, fresh = object_key(10), object_key(11)
    assert store(adapter, [ready], [memory_obj(payload(10))]).is_successful()
    fds = [adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()]
    assert len(set(fds)) == 3
    for fd in fds:  # drain anything signalled so far
        if select.select([fd], [], [], 0)[0]:
            os.read(fd, 8)
    target = torch.zeros((2, 2, 16, 1024), dtype=torch.bfloat16)
    node.pause()  # every byte the adapter now needs is stuck behind a stopped node
    try:
        store_id = _returns_at_once(lambda: adapter.submit_store_task([fresh], [memory_obj(payload(11))]))
        lookup_id = _returns_at_once(lambda: adapter.submit_lookup_and_lock_task([ready], {}))
        load_id = _returns_at_once(lambda: adapter.submit_load_task([ready], [memory_obj(target)]))
        _returns_at_once(lambda: adapter.submit_unlock([ready]))
        assert select.select(fds, [], [], 0.2)[0] == []
        assert adapter.pop_completed_store_tasks() == {}
        assert adapter.query_lookup_and_lock_result(lookup_id) is None
        assert adapter.query_load_result(load_id) is None
    finally:
        node.resume()
    stored = await_result(fds[0], lambda: adapter.pop_completed_store_tasks().get(store_id))
    assert stored.is_successful() and stored.bytes_transferred() == CHUNK_BYTES
    assert await_result(fds[1], lambda: adapter.query_lookup_and_lock_result(lookup_id)).test(0)
    assert await_result(fds[2], lambda: adapter.query_load_result(load_id)).test(0)
    assert same_bytes(target, payload(10))


# -- the channel ---------------------------------------------------------------------
def test_loads_of_same_cluster_hits_travel_over_the_channel_the_url_turns_on(node_factory, pool_url, adapters):
    """``nccl=on`` in the adapter's URL: its client builds the channel (here the CPU transport); the first
    load goes over TCP while the pair is made, then every hit comes over the channel and none over TCP."""
    node_factory("--cluster", "rack-a", "--channel", "cpu")
    adapter = adapters(f"{pool_url}?nccl=on&cluster=rack-a&channel_transport=cpu")
    keys = [object_key(60 + i) for i in range(3)]
    assert store(adapter, keys, [memory_obj(payload(60 + i)) for i in range(3)]).is_successful()

    def loaded(hits: list[bool], got: list[torch.Tensor]) -> None:
        assert hits == [True] * 3 and all(same_bytes(g, payload(60 + i)) for i, g in enumerate(got))

    def loaded_over_the_channel() -> bool:
        loaded(*load(adapter, keys))  # right bytes whichever path served them
        return adapter.client.counters["get_bytes_channel"] > 0

    assert wait_until(loaded_over_the_channel, WAIT_S), "no load came over the channel"
    before = dict(adapter.client.counters)
    loaded(*load(adapter, keys))
    after = dict(adapter.client.counters)
    assert after["get_bytes_channel"] - before["get_bytes_channel"] == 3 * CHUNK_BYTES
    assert after.get("get_bytes_tcp", 0) == before.get("get_bytes_tcp", 0) and after.get("channel_fallbacks", 0) == 0


# -- key mapping: salts, listing, usage -----------------------------------------------
def test_pool_keys_are_injective_reversible_and_never_look_like_in_process_keys():
    from lmcache.utils import CacheEngineKey

    from kvpool.lmcache_l2_adapter import object_key_from_pool_key, pool_key

    keys = [object_key(1, salt) for salt in ("", "alice", "bob", "a*b", "x:y", "mp:", "{tag}")]
    keys += [object_key(1, "", model) for model in ("mp:evil", "org/model", "0x1")]
    names = [pool_key(k) for k in keys]
    assert len(set(names)) == len(keys)
    assert [object_key_from_pool_key(n) for n in names] == keys
    inproc = CacheEngineKey("mp:", 1, 0, 0x1234, torch.bfloat16).to_string()
    assert object_key_from_pool_key(inproc) is None
    assert object_key_from_pool_key("mp:@model@0x01000100@0@zz") is None


def test_same_chunk_under_two_salts_is_two_entries_and_usage_is_reported_per_salt(node_factory, pool_url, adapters):
    node = node_factory()
    adapter = adapters(pool_url)
    alice, bob, plain = object_key(5, "alice"), object_key(5, "bob"), object_key(5, "")
    result = store(
        adapter, [alice, bob, plain], [memory_obj(payload(50)), memory_obj(payload(51)), memory_obj(payload(52))]
    )
    assert result.is_successful() and result.bytes_transferred() == 3 * CHUNK_BYTES
    hits, got = load(adapter, [bob, alice, plain])
    assert hits == [True, True, True]
    assert same_bytes(got[0], payload(51)) and same_bytes(got[1], payload(50)) and same_bytes(got[2], payload(52))
    adapter.refresh_usage()
    usage = adapter.get_usage()
    assert dict(usage.bytes_by_cache_salt) == {"alice": CHUNK_BYTES, "bob": CHUNK_BYTES, "": CHUNK_BYTES}
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as pool:
        capacity = sum(n.capacity_bytes for n in pool.nodes())
    assert usage.total_capacity_bytes == capacity > 0
    assert adapter.supports_global_eviction is False  # the pool evicts; LMCache's L2 eviction stays off
    status = adapter.report_status()
    assert status["is_healthy"] is True and status["live_nodes"] == 1
    del node


def test_per_salt_usage_follows_this_adapters_stores_and_deletes_between_scans(node_factory, pool_url, adapters):
    node_factory()
    adapter = adapters(pool_url)  # refreshes every 10 s: the first scan has run, the next is far off
    adapter.refresh_usage()
    assert dict(adapter.get_usage().bytes_by_cache_salt) == {}
    keys = [object_key(60, "carol"), object_key(61, "carol"), object_key(62, "dave")]
    assert store(adapter, keys, [memory_obj(payload(60 + i)) for i in range(3)]).is_successful()
    assert dict(adapter.get_usage().bytes_by_cache_salt) == {"carol": 2 * CHUNK_BYTES, "dave": CHUNK_BYTES}
    adapter.delete([keys[0]])
    assert dict(adapter.get_usage().bytes_by_cache_salt) == {"carol": CHUNK_BYTES, "dave": CHUNK_BYTES}
    adapter.refresh_usage()  # the scan agrees, and the deltas are not counted twice
    assert dict(adapter.get_usage().bytes_by_cache_salt) == {"carol": CHUNK_BYTES, "dave": CHUNK_BYTES}


def test_a_key_named_twice_in_one_load_fills_both_memory_objects(node_factory, pool_url, adapters):
    node_factory()
    adapter = adapters(pool_url)
    key = object_key(70)
    assert store(adapter, [key], [memory_obj(payload(70))]).is_successful()
    hits, got = load(adapter, [key, object_key(71), key])
    assert hits == [True, False, True]
    assert same_bytes(got[0], payload(70)) and same_bytes(got[2], payload(70))


def test_list_l2_keys_pages_through_every_key_with_the_model_filter(node_factory, pool_url, adapters):
    node_factory()
    adapter = adapters(pool_url)
    mine = [object_key(i, "s1" if i % 2 else "") for i in range(7)]
    other = [object_key(100 + i, "", "other/model") for i in range(3)]
    assert store(adapter, mine + other, [memory_obj(payload(i)) for i in range(10)]).is_successful()
    seen: list[Any] = []
    cursor = None
    for _ in range(20):
        page = adapter.list_l2_keys(model_name="kvpool-test/model", page_size=3, cursor=cursor)
        assert len(page.entries) <= 3
        seen.extend(page.entries)
        cursor = page.next_page_token
        if cursor is None:
            break
    assert cursor is None
    assert sorted((e.key.to_object_key() for e in seen), key=repr) == sorted(mine, key=repr)
    assert {e.size_bytes for e in seen} == {CHUNK_BYTES}
    everything = adapter.list_l2_keys(page_size=100)
    assert len(everything.entries) == 10 and everything.next_page_token is None


def test_delete_removes_from_the_pool_and_tells_lmcaches_listeners(node_factory, pool_url, adapters):
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    class Recorder(L2AdapterListener):  # type: ignore[misc]
        def __init__(self) -> None:
            self.stored: list[Any] = []
            self.deleted: list[Any] = []

        def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
            self.stored.extend(keys)

        def on_l2_keys_accessed(self, keys: list[Any]) -> None:
            pass

        def on_l2_keys_deleted(self, keys: list[Any]) -> None:
            self.deleted.extend(keys)

    node_factory()
    adapter = adapters(pool_url)
    recorder = Recorder()
    adapter.register_listener(recorder)
    keys = [object_key(20), object_key(21)]
    assert store(adapter, keys, [memory_obj(payload(20)), memory_obj(payload(21))]).is_successful()
    assert recorder.stored == keys
    adapter.delete([keys[0], object_key(999)])
    assert recorder.deleted == [keys[0]]
    hits, _ = load(adapter, keys)
    assert hits == [False, True]
    # a second store of a chunk the pool has sends nothing and counts nothing twice
    again = store(adapter, keys[1:], [memory_obj(payload(21))])
    assert again.is_successful() and again.bytes_transferred() == 0
    assert recorder.stored == keys


# -- one pool, both modes -------------------------------------------------------------
def test_in_process_and_multiprocess_data_share_one_pool_without_mixing(node_factory, pool_url, mp_stacks):
    from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config

    node_factory()
    inproc = LMCacheStack(kvpool_lmcache_config(pool_url))
    try:
        keys = [inproc.key(700 + i) for i in range(3)]
        objs = [inproc.make_object(i) for i in range(3)]
        expected = [o.tensor.clone() for o in objs]
        inproc.put(keys, objs)
        mp = mp_stacks(pool_url)
        mp_keys = [mp.key(i) for i in range(3)]
        assert mp.put(mp_keys, [mp.payload(i, 3) for i in range(3)]) == 3
        assert wait_until(lambda: mp.adapter.counters["stored_chunks"] >= 3, WAIT_S)
        listed = mp.adapter.list_l2_keys(page_size=100)
        assert sorted((e.key.to_object_key() for e in listed.entries), key=repr) == sorted(mp_keys, key=repr)
        got = inproc.get(keys)
        assert all(g is not None and same_bytes(g.tensor, e) for g, e in zip(got, expected))
        inproc.release(objs + got)
    finally:
        inproc.close()


# -- bad input ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"url": "kvpool://127.0.0.1/no-port"}, "port"),
        (
            {"url": "kvpool://127.0.0.1:6379/ns", "lock_ttl": 5},
            r"adapter_params.lock_ttl: unknown option; did you mean lock_ttl_ms\?",
        ),
        ({"url": "kvpool://127.0.0.1:6379/ns", "lock_ttl_ms": 0}, "adapter_params.lock_ttl_ms"),
        ({"url": "kvpool://127.0.0.1:6379/ns", "lock_ttl_ms": 3_600_000}, "adapter_params.lock_ttl_ms"),
        ({"url": "kvpool://127.0.0.1:6379/ns", "usage_refresh_ms": "5s"}, "adapter_params.usage_refresh_ms"),
    ],
)
def test_bad_adapter_params_are_refused_naming_what_was_wrong(params, named, monkeypatch):
    monkeypatch.delenv("KVPOOL_URL", raising=False)
    params = dict(params)
    with pytest.raises(ConfigError, match=named):  # a ValueError, as LMCache's config parsers raise
        build_adapter(params.pop("url"), **params)


def test_bad_listing_arguments_are_value_errors_naming_the_argument(pool_url, adapters):
    adapter = adapters(pool_url)
    with pytest.raises(ConfigError, match="page_size"):
        adapter.list_l2_keys(page_size=0)
    with pytest.raises(ConfigError, match="cursor"):
        adapter.list_l2_keys(cursor="not-a-cursor")
    with pytest.raises(KVPoolError, match="2 keys but 1 objects"):
        adapter.submit_store_task([object_key(1), object_key(2)], [memory_obj(payload(1))])


def test_a_store_the_busy_pool_refuses_is_skipped_not_failed_and_stores_once_there_is_room(
    node_factory, pool_url, adapters
):
    node = node_factory(dram="8MiB")
    adapter = adapters(pool_url + "?progress_timeout_s=1")  # a put may wait 0.5 s for room
    in_flight = PutInFlight(node, 8 * MiB)  # all of the node's DRAM, for longer than that
    try:
        result = store(adapter, [object_key(801)], [memory_obj(payload(801))])
    finally:
        in_flight.land()
    assert result.is_successful()  # a skipped store: nothing failed
    assert adapter.counters["store_skipped_busy"] == 1
    assert adapter.counters["miss_store"] == 0 and adapter.counters["stored_chunks"] == 0
    assert lookup_and_lock(adapter, [object_key(801)]) == [False]
    assert store(adapter, [object_key(802)], [memory_obj(payload(802))]).is_successful()
    assert adapter.counters["stored_chunks"] == 1


def test_pool_down_gives_misses_and_an_unhealthy_status_never_a_hang(adapters):
    from backend.embedded import free_port

    adapter = adapters(f"kvpool://127.0.0.1:{free_port()}/none?progress_timeout_s=0.3")
    assert lookup_and_lock(adapter, [object_key(1)]) == [False]
    hits, _ = load(adapter, [object_key(1)])
    assert hits == [False]
    assert store(adapter, [object_key(1)], [memory_obj(payload(1))]).is_successful() is False
    adapter.refresh_usage()
    assert adapter.report_status()["is_healthy"] is False


def test_a_pool_without_a_live_node_is_one_error_at_start_naming_the_cause_and_in_the_status(
    adapters, redis_factory, caplog
):
    from backend.embedded import EmbeddedRedis

    caplog.set_level(logging.INFO)
    empty = EmbeddedRedis().start()  # Redis answers; no node ever joined
    redis_factory.append(empty)
    adapter = adapters(f"kvpool://127.0.0.1:{empty.port}/engines?progress_timeout_s=1")
    assert wait_until(lambda: adapter.report_status()["pool_problem"] == "every-lookup-misses", WAIT_S)
    for i in range(3):
        assert lookup_and_lock(adapter, [object_key(900 + i)]) == [False]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("backend")]
    assert len(errors) == 1 and "not usable at start" in errors[0] and "#every-lookup-misses" in errors[0], errors


def test_a_lock_never_unlocked_ends_with_its_lease(node_factory, pool_url, adapters):
    node_factory("--nvme", "0", dram="2MiB")
    adapter = adapters(pool_url, lock_ttl_ms=1000)
    key = object_key(30)
    assert store(adapter, [key], [memory_obj(payload(30))]).is_successful()
    locked_at = time.monotonic()
    assert lookup_and_lock(adapter, [key]) == [True]  # and LMCache never unlocks it
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as pool:

        def evicted_after_more_pressure() -> bool:
            _pressure(pool, f"ttl{time.monotonic_ns()}", 24)
            return pool.contains([adapter_key(key)]) == [False]

        assert wait_until(evicted_after_more_pressure, WAIT_S, interval_s=0.2)
    # Nor does the adapter keep it: a lease whose ttl ended is forgotten at a later lookup, so what it
    # holds is bounded by the lookups of the last ttl, however many chunks LMCache never unlocks.
    time.sleep(max(0.0, locked_at + 1.0 - time.monotonic()))
    other = object_key(32)
    assert store(adapter, [other], [memory_obj(payload(32))]).is_successful()
    assert lookup_and_lock(adapter, [other]) == [True]
    assert adapter.report_status()["locked_keys"] == 1


def test_close_returns_the_leases_it_still_holds(node_factory, pool_url):
    node_factory("--nvme", "0", dram="2MiB")
    adapter = build_adapter(pool_url, lock_ttl_ms=600_000)
    key = object_key(31)
    try:
        assert store(adapter, [key], [memory_obj(payload(31))]).is_successful()
        assert lookup_and_lock(adapter, [key]) == [True]
    finally:
        adapter.close()
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as pool:

        def evicted_after_more_pressure() -> bool:
            _pressure(pool, f"close{time.monotonic_ns()}", 24)
            return pool.contains([adapter_key(key)]) == [False]

        assert wait_until(evicted_after_more_pressure, WAIT_S, interval_s=0.2)


# -- memory objects of several shape groups (hybrid models) ---------------------------
HYBRID_GROUPS = ((torch.Size([2, 2, 16, 1024]), torch.bfloat16), (torch.Size([2, 1, 16, 512]), torch.float16))


def hybrid_obj(seed: int | None, groups: tuple[tuple[torch.Size, torch.dtype], ...] = HYBRID_GROUPS) -> Any:
    """A standalone LMCache memory object of several shape groups in one buffer (random bytes, or zeros)."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    nbytes = sum(shape.numel() * dtype.itemsize for shape, dtype in groups)
    if seed is None:
        raw = torch.zeros(nbytes, dtype=torch.uint8)
    else:
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    shapes, dtypes = [shape for shape, _ in groups], [dtype for _, dtype in groups]
    metadata = MemoryObjMetadata(
        shape=shapes[0],
        dtype=dtypes[0],
        address=0,
        phy_size=nbytes,
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
        shapes=shapes,
        dtypes=dtypes,
    )
    return TensorMemoryObj(raw_data=raw, metadata=metadata, parent_allocator=None)


def test_an_object_of_two_shape_groups_is_stored_as_its_bytes_and_loaded_back_whole(node_factory, pool_url, adapters):
    node_factory()
    adapter = adapters(pool_url)
    key = object_key(40, salt="hybrid")
    source = hybrid_obj(40)
    assert len(source.get_shapes()) == 2
    result = store(adapter, [key], [source])
    assert result.is_successful() and int(result) == len(source.byte_array)  # the bytes it sent
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as pool:  # the same chunk meta as the in-process connector's
        (stored,) = pool.get([adapter_key(key)], fingerprint=object_fingerprint(source))
        assert stored is not None
        assert (stored.meta.dtype, stored.meta.shape, stored.meta.fmt) == (
            "uint8",
            (len(source.byte_array),),
            int(source.get_memory_format().value),
        )
    target = hybrid_obj(None)
    task_id = adapter.submit_load_task([key], [target])
    bitmap = await_result(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task_id))
    assert bitmap.test(0)
    assert bytes(target.byte_array) == bytes(source.byte_array)
    other = hybrid_obj(None, HYBRID_GROUPS[:1])  # another layout under the same key: a miss, never a partial copy
    task_id = adapter.submit_load_task([key], [other])
    bitmap = await_result(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task_id))
    assert not bitmap.test(0) and adapter.report_status()["counters"]["layout_misses"] == 1
    assert not any(bytes(other.byte_array))
