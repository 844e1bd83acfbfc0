"""Naming the tenant per key (docs/fleet.md, "Naming the tenant"): the LMCache connector's ``tenant_tag=NAME``
(the request tag ``lmcache.tag.NAME`` names each key's tenant) and the multiprocess-mode adapter's
``tenant_from_salt=on`` (each key's cache_salt does). Real redis-server and node processes, LMCache's own
RemoteBackend through the kvpool connector, LMCache's token database making the tagged keys, and the adapter
fed LMCache's own ``ObjectKey``s.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from backend import admin
from backend.client import SyncPoolClient
from backend.config import PoolConfig
from backend.errors import ConfigError
from backend.events.keys import block_of
from backend.lmcache.config import pool_config_from, remote_url_pool_config
from backend.tenants import scoped, tenant_of
from kvpool import PoolClient
from tests.test_lmcache_l2 import (
    CHUNK_BYTES,
    load,
    lookup_and_lock,
    memory_obj,
    object_key,
    payload,
    store,
)

TAG = "tenant"  # the request tag naming the tenant: kv_transfer_params {"lmcache.tag.tenant": NAME}
POOL = "pool-token-" + "c3" * 16
ALICE = "alice-token-" + "d4" * 16
BOB = "bob-token-" + "e5" * 16


def tagged_keys(stack: Any, first_token: int, chunks: int, tags: dict[str, Any] | None) -> list[Any]:
    """The keys LMCache's own token database makes for a prompt of ``chunks`` chunks of a request whose
    ``kv_transfer_params`` carry ``tags`` (as vLLM hands them to LMCache: its ``request_configs``)."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    tokens = list(range(first_token, first_token + chunks * int(stack.config.chunk_size)))
    database = ChunkedTokenDatabase(stack.config, stack.metadata)
    return [key for _, _, key in database.process_tokens(tokens=tokens, request_configs=tags)]


def untagged(key: Any) -> str:
    """The key's LMCache string without its request tags (what the pool stores after ``~t/NAME/``)."""
    from lmcache.utils import CacheEngineKey

    return str(CacheEngineKey(key.model_name, key.world_size, key.worker_id, key.chunk_hash, key.dtype).to_string())


def stored_keys(pool_url: str, env: dict[str, str] | None = None) -> list[str]:
    with SyncPoolClient(PoolConfig.from_url(pool_url, env)) as operator:
        return sorted(operator.list_keys())


def tenant_counts(pool_url: str, env: dict[str, str] | None = None) -> dict[str, int]:
    """Puts per tenant, as the node counts them (STAT)."""
    with SyncPoolClient(PoolConfig.from_url(pool_url, env)) as operator:
        stats = operator.node_stats(operator.nodes()[0])
    return {name: report["puts"] for name, report in stats["tenants"].items()}


def put_objects(stack: Any, keys: list[Any], seed: int) -> None:
    objs = [stack.make_object(seed + i) for i in range(len(keys))]
    stack.put(keys, objs)
    stack.release(objs)


def same_tensors(stack: Any, got: list[Any], seed: int) -> bool:
    import torch

    ok = all(o is not None and torch.equal(o.tensor, stack.expected_tensor(seed + i)) for i, o in enumerate(got))
    stack.release(got)
    return ok


# -- the connector: a request tag names the tenant ------------------------------------------------
def test_one_engine_stores_each_requests_chunks_under_the_tenant_its_tag_names(node_factory, pool_url, stack_factory):
    node_factory()
    engine = stack_factory(f"{pool_url}?tenant_tag={TAG}")
    alices = tagged_keys(engine, 0, 2, {f"lmcache.tag.{TAG}": "alice"})
    bobs = tagged_keys(engine, 0, 2, {f"lmcache.tag.{TAG}": "bob"})  # the same prompt
    assert [untagged(k) for k in alices] == [untagged(k) for k in bobs]
    assert alices[0].to_string().endswith(f"@{TAG}%alice")  # the tag rides in LMCache's key string
    put_objects(engine, alices, seed=10)
    put_objects(engine, bobs, seed=20)
    # Each tenant's chunks under its own prefix, the tag not stored twice: the prefix says it.
    assert stored_keys(pool_url) == sorted(
        [scoped("alice", untagged(k)) for k in alices] + [scoped("bob", untagged(k)) for k in bobs]
    )
    assert engine.contains_prefix(alices) == 2 and engine.contains_prefix(bobs) == 2
    assert same_tensors(engine, engine.get(alices), seed=10) and same_tensors(engine, engine.get(bobs), seed=20)
    # An engine whose URL names alice (untagged keys) reads the very chunks the tag put there: one tenant, one chunk.
    alice_engine = stack_factory(f"{pool_url}?tenant=alice")
    plain = tagged_keys(alice_engine, 0, 2, None)
    assert alice_engine.contains_prefix(plain) == 2
    assert same_tensors(alice_engine, alice_engine.get(plain), seed=10)
    # The node counts the puts per tenant (its per-tenant metrics and quotas see the tag's tenant).
    assert tenant_counts(pool_url) == {"alice": 2, "bob": 2}
    # list() names the keys as LMCache does, tag included.
    listed = asyncio.run_coroutine_threadsafe(engine.connector().list(), engine.loop).result(10)
    assert sorted(listed) == sorted(k.to_string() for k in alices + bobs)
    assert engine.connector().counters["tenant_refused"] == 0


def test_a_quota_of_a_tenant_named_by_tag_bounds_only_its_requests_chunks(node_factory, pool_url, stack_factory):
    node_factory(dram="64MiB")
    engine = stack_factory(f"{pool_url}?tenant_tag={TAG}")
    quota = engine.chunk_bytes * 3 // 2  # one chunk fits, two do not

    async def set_quota() -> None:
        async with PoolClient(PoolConfig.from_url(pool_url)) as operator:
            await admin.set_quota(operator, "alice", quota)
            node = (await operator.nodes(refresh=True))[0]
            for _ in range(100):  # the node reads quotas with its heartbeat
                report = (await operator.node_admin.stats(node)).tenants.get("alice")
                if report is not None and report.quota_bytes == quota:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError("the node never read alice's quota")

    asyncio.run(set_quota())
    alices = tagged_keys(engine, 1000, 3, {f"lmcache.tag.{TAG}": "alice"})
    bobs = tagged_keys(engine, 1000, 2, {f"lmcache.tag.{TAG}": "bob"})
    for i, key in enumerate(alices):  # one put each: the oldest are the coldest
        put_objects(engine, [key], seed=110 + i)
    put_objects(engine, bobs, seed=120)
    held = set(stored_keys(pool_url))
    assert [scoped("alice", untagged(k)) in held for k in alices] == [False, False, True]
    assert all(scoped("bob", untagged(k)) in held for k in bobs)


def test_a_key_without_the_tag_is_the_urls_tenants_or_no_tenants(node_factory, pool_url, stack_factory):
    node_factory()
    with_fallback = stack_factory(f"{pool_url}?tenant_tag={TAG}&tenant=carol")
    without = stack_factory(f"{pool_url}?tenant_tag={TAG}")
    other_tags = {"lmcache.tag.user": "u1"}  # another tag is kept in the key, the tenant's fallback applies
    first = tagged_keys(with_fallback, 100, 1, other_tags)
    second = tagged_keys(without, 200, 1, None)
    put_objects(with_fallback, first, seed=30)
    put_objects(without, second, seed=40)
    assert stored_keys(pool_url) == sorted([scoped("carol", first[0].to_string()), second[0].to_string()])
    assert first[0].to_string().endswith("@user%u1")
    assert with_fallback.contains_prefix(first) == 1 and without.contains_prefix(second) == 1
    assert without.contains_prefix(first) == 0  # carol's chunk is not the chunk of no tenant


def test_a_tag_that_names_no_tenant_is_refused_counted_and_said_once(node_factory, pool_url, stack_factory, caplog):
    node_factory()
    engine = stack_factory(f"{pool_url}?tenant_tag={TAG}")
    good = tagged_keys(engine, 300, 1, {f"lmcache.tag.{TAG}": "alice"})
    bad = tagged_keys(engine, 400, 2, {f"lmcache.tag.{TAG}": "a/b"})
    too_long = tagged_keys(engine, 500, 1, {f"lmcache.tag.{TAG}": "x" * 65})
    with caplog.at_level(logging.WARNING, logger="backend.lmcache.tenant_names"):
        put_objects(engine, good + bad + too_long, seed=50)
        put_objects(engine, bad, seed=60)  # again: counted again, not said again
    assert stored_keys(pool_url) == [scoped("alice", untagged(good[0]))]  # nothing stored under another name
    connector = engine.connector()
    assert connector.counters["tenant_refused"] == 5
    said = [r.getMessage() for r in caplog.records if "is not a tenant name" in r.getMessage()]
    assert len(said) == 2 and "'a/b'" in said[0] and "lmcache.tag.tenant" in said[0], said
    # A lookup stops at the first refused key; a get of one is a miss, the others are read.
    assert engine.contains_prefix(good + bad) == 1
    got = engine.get(good + bad[:1])
    assert got[1] is None and got[0] is not None
    engine.release(got)
    assert connector.counters["miss_get"] == 0 and connector.counters["miss_put"] == 0  # refused, not failed


def test_the_tag_is_stored_once_the_key_grows_by_the_prefix_alone(node_factory, pool_url, stack_factory):
    node_factory()
    engine = stack_factory(f"{pool_url}?tenant_tag={TAG}")
    (key,) = tagged_keys(engine, 600, 1, {f"lmcache.tag.{TAG}": "alice"})
    put_objects(engine, [key], seed=70)
    (stored,) = stored_keys(pool_url)
    # LMCache's key with the tag, and the stored key: the tag's bytes are traded for the prefix's.
    assert len(stored) == len(untagged(key)) + len("~t/alice/")
    assert len(key.to_string()) == len(untagged(key)) + len(f"@{TAG}%alice")


def _file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return path


def test_a_tenant_token_naming_another_tenants_tag_is_refused_by_the_node(
    node_factory, pool_url, stack_factory, tmp_path
):
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    _file(tenants / "alice", ALICE)
    _file(tenants / "bob", BOB)
    node_factory("--token-file", str(_file(tmp_path / "pool", POOL)), "--tenant-tokens", str(tenants))
    alice_token = _file(tmp_path / "alice-token", ALICE)
    engine = stack_factory(f"{pool_url}?tenant_tag={TAG}&token_file={alice_token}")
    mine = tagged_keys(engine, 700, 1, {f"lmcache.tag.{TAG}": "alice"})
    theirs = tagged_keys(engine, 800, 1, {f"lmcache.tag.{TAG}": "bob"})
    put_objects(engine, mine, seed=80)
    put_objects(engine, theirs, seed=90)
    env = {"KVPOOL_TOKEN": POOL}
    assert stored_keys(pool_url, env) == [scoped("alice", untagged(mine[0]))]
    connector = engine.connector()
    assert connector.counters["miss_put"] == 1  # the node refused it (AuthError): a failed put, nothing stored
    with SyncPoolClient(PoolConfig.from_url(pool_url, env)) as operator:
        counters = operator.node_stats(operator.nodes()[0])["counters"]
    assert counters["tenant_refusals"] >= 1
    # bob's chunk, put by the operator, is still not alice's engine's to read
    with SyncPoolClient(PoolConfig.from_url(f"{pool_url}?tenant=bob", {"KVPOOL_TOKEN": BOB})) as bob:
        objs = [engine.make_object(91)]
        from backend.lmcache.chunks import to_chunk

        bob.put([to_chunk(untagged(theirs[0]), objs[0], connector.layout.value)])
        engine.release(objs)
    assert engine.contains_prefix(theirs) == 1  # Redis shows the name (docs/security.md: Redis is not bounded)
    assert engine.get(theirs) == [None]  # the node refuses alice's token bob's bytes


# -- the adapter: the cache_salt names the tenant ---------------------------------------------------
def test_with_tenant_from_salt_each_salt_is_its_own_tenant(node_factory, pool_url, adapters):
    from kvpool.lmcache_l2_adapter import pool_key

    node_factory()
    adapter = adapters(f"{pool_url}?tenant_from_salt=on")
    alice, bob, plain = object_key(1, "alice"), object_key(1, "bob"), object_key(1, "")
    keys = [alice, bob, plain]
    assert store(adapter, keys, [memory_obj(payload(i)) for i in range(3)]).is_successful()
    assert stored_keys(pool_url) == sorted(
        [scoped("alice", pool_key(alice)), scoped("bob", pool_key(bob)), pool_key(plain)]
    )
    assert lookup_and_lock(adapter, keys) == [True, True, True]
    adapter.submit_unlock(keys)
    hits, got = load(adapter, keys)
    assert hits == [True, True, True]
    assert all(torch_equal(got[i], payload(i)) for i in range(3))
    assert tenant_counts(pool_url) == {"alice": 1, "bob": 1}
    listed = adapter.list_l2_keys(page_size=100)
    assert sorted((e.key.to_object_key() for e in listed.entries), key=repr) == sorted(keys, key=repr)
    adapter.refresh_usage()
    assert dict(adapter.get_usage().bytes_by_cache_salt) == {"alice": CHUNK_BYTES, "bob": CHUNK_BYTES, "": CHUNK_BYTES}
    adapter.delete([alice])
    assert stored_keys(pool_url) == sorted([scoped("bob", pool_key(bob)), pool_key(plain)])


def test_an_empty_salt_is_the_urls_tenants_and_a_salt_that_names_no_tenant_is_refused(
    node_factory, pool_url, adapters, caplog
):
    from kvpool.lmcache_l2_adapter import pool_key

    node_factory()
    adapter = adapters(f"{pool_url}?tenant_from_salt=on&tenant=carol")
    plain, bad, good = object_key(2, ""), object_key(3, "a+b="), object_key(4, "dave")
    keys = [plain, bad, good]
    with caplog.at_level(logging.WARNING, logger="backend.lmcache.tenant_names"):
        result = store(adapter, keys, [memory_obj(payload(i)) for i in range(3)])
        store(adapter, [bad], [memory_obj(payload(1))])
    assert result.is_successful() and result.bytes_transferred() == 2 * CHUNK_BYTES
    assert stored_keys(pool_url) == sorted([scoped("carol", pool_key(plain)), scoped("dave", pool_key(good))])
    assert adapter.counters["tenant_refused"] == 2
    said = [r.getMessage() for r in caplog.records if "is not a tenant name" in r.getMessage()]
    assert len(said) == 1 and "'a+b='" in said[0] and "cache_salt" in said[0], said
    assert lookup_and_lock(adapter, keys) == [True, False, True]
    adapter.submit_unlock(keys)
    hits, _ = load(adapter, keys)
    assert hits == [True, False, True]
    listed = adapter.list_l2_keys(page_size=100)
    assert sorted((e.key.to_object_key() for e in listed.entries), key=repr) == sorted([plain, good], key=repr)


def test_an_adapter_of_the_urls_tenant_lists_its_own_keys_and_no_other_tenants(node_factory, pool_url, adapters):
    node_factory()
    carols = adapters(f"{pool_url}?tenant=carol")
    salted = adapters(f"{pool_url}?tenant_from_salt=on")
    mine, theirs = [object_key(10, "s1"), object_key(11, "")], [object_key(12, "dave")]
    assert store(carols, mine, [memory_obj(payload(i)) for i in range(2)]).is_successful()
    assert store(salted, theirs, [memory_obj(payload(2))]).is_successful()
    listed = carols.list_l2_keys(page_size=100)  # its keys are ~t/carol/mp:...: the listing used to miss them
    assert sorted((e.key.to_object_key() for e in listed.entries), key=repr) == sorted(mine, key=repr)
    assert [e.key.to_object_key() for e in salted.list_l2_keys(page_size=100).entries] == theirs


def test_salt_pattern_matches_a_salts_keys_under_the_tenant_they_are_stored_under(node_factory, pool_url, adapters):
    from kvpool.lmcache_l2_adapter import pool_key, salt_pattern

    node_factory()
    salted = adapters(f"{pool_url}?tenant_from_salt=on")
    plain = adapters(pool_url)  # no tenant: salt alice's keys are mp:alice@...
    carols = adapters(f"{pool_url}?tenant=carol")  # the URL's tenant: ~t/carol/mp:alice@...
    alices = [object_key(20, "alice"), object_key(21, "alice", model="other/model")]
    assert store(salted, [*alices, object_key(22, "bob")], [memory_obj(payload(i)) for i in range(3)]).is_successful()
    assert store(plain, [object_key(23, "alice")], [memory_obj(payload(3))]).is_successful()
    assert store(carols, [object_key(24, "alice")], [memory_obj(payload(4))]).is_successful()

    def matched(pattern: str) -> list[str]:
        with SyncPoolClient(PoolConfig.from_url(pool_url)) as operator:
            return sorted(operator.list_keys(pattern))

    # Under tenant_from_salt=on a salt's keys are its own tenant's: ~t/alice/mp:alice@... (the old pattern missed them).
    assert matched(salted.names.pattern("alice")) == sorted(scoped("alice", pool_key(k)) for k in alices)
    assert salted.names.pattern("alice") == salt_pattern("alice", tenant="alice")
    assert matched(salt_pattern("alice", "other/model", tenant="alice")) == [scoped("alice", pool_key(alices[1]))]
    assert matched(salt_pattern("alice")) == [pool_key(object_key(23, "alice"))]  # no tenant: no tenant's keys only
    assert matched(plain.names.pattern("alice")) == [pool_key(object_key(23, "alice"))]
    assert matched(carols.names.pattern("alice")) == [scoped("carol", pool_key(object_key(24, "alice")))]
    with pytest.raises(ConfigError, match="is not a tenant name") as refused:
        salted.names.pattern("a+b=")  # such a salt's keys are never stored under tenant_from_salt=on
    assert refused.value.key == "cache_salt"
    with pytest.raises(ConfigError, match="must be 1-64 characters") as refused:
        salt_pattern("alice", tenant="a/b")
    assert refused.value.key == "tenant"


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- configuration ---------------------------------------------------------------------------------
def test_the_tenant_options_are_checked_and_each_layer_refuses_the_other_layers():
    config = PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?tenant_tag={TAG}&tenant=alice")
    assert (config.tenant_tag, config.tenant, config.tenant_from_salt) == (TAG, "alice", False)
    assert f"tenant_tag={TAG}" in config.to_url()
    assert PoolConfig.from_url("kvpool://127.0.0.1:6379/ns?tenant_from_salt=on").tenant_from_salt is True
    for bad in ("a@b", "x%y", ""):
        with pytest.raises(ConfigError, match="tag name") as refused:
            PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?tenant_tag={bad}")
        assert refused.value.key == "tenant_tag"
    with pytest.raises(ConfigError, match="not both"):
        PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?tenant_tag={TAG}&tenant_from_salt=on")
    with pytest.raises(ConfigError, match="carry no request tag") as refused:
        pool_config_from(f"kvpool://127.0.0.1:6379/ns?tenant_tag={TAG}", "adapter_params.url", multiprocess=True)
    assert refused.value.key == "tenant_tag"
    with pytest.raises(ConfigError, match="without a cache_salt") as refused:
        pool_config_from("kvpool://127.0.0.1:6379/ns?tenant_from_salt=on", "extra_config")
    assert refused.value.key == "tenant_from_salt"
    with pytest.raises(ConfigError, match="without a cache_salt"):
        remote_url_pool_config(
            "external://127.0.0.1:6379/kvpool.lmcache_connector/?connector_name=KVPoolRemoteURLConnector"
            "&tenant_from_salt=on"
        )
    url = remote_url_pool_config(
        f"external://127.0.0.1:6379/kvpool.lmcache_connector/?connector_name=KVPoolRemoteURLConnector&tenant_tag={TAG}"
    )
    assert url.tenant_tag == TAG


# -- pins and events name the stored keys, whoever named the tenant ----------------------------------
async def test_pins_and_an_events_endpoints_tenant_filter_take_the_tag_named_tenants_keys(
    node_factory, pool_url, stack_factory
):
    node_factory()
    engine = stack_factory(f"{pool_url}?tenant_tag={TAG}")
    keys = tagged_keys(engine, 900, 2, {f"lmcache.tag.{TAG}": "alice"})
    await asyncio.to_thread(put_objects, engine, keys, 100)
    stored = [scoped("alice", untagged(k)) for k in keys]
    async with PoolClient(PoolConfig.from_url(pool_url)) as operator:
        report = await admin.pin(operator, stored, ttl_s=60)  # what `kvpool pin` runs
        assert report.keys == 2 and report.copies == 2
        assert (await admin.unpin(operator, stored)).unpinned == 2
    # An events endpoint of tenant alice publishes what starts ~t/alice/, as its engines name it: the block is
    # the LMCache key's chunk hash, the same as for an engine whose URL names alice.
    for key, name in zip(keys, stored):
        assert tenant_of(name) == "alice"
        block = block_of(name[len(scoped("alice", "")) :])
        assert block is not None and block.block_hash == key.chunk_hash & ((1 << 64) - 1) and block.extra is None
