"""Tenants (docs/fleet.md, "Tenants and quotas"): a tenant's keys are its own in the index and on the node,
a quota bounds a tenant's bytes by evicting its own coldest chunks, and the per-tenant counts match the puts."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import quote

import pytest

from backend import admin
from backend.errors import ConfigError, PutOutcome
from backend.tenants import scoped, tenant_of
from kvpool import PoolClient, PoolConfig
from tests.support.chunks import numbered_chunks
from tests.support.cli import kvpool
from tests.test_metrics import _metrics_port, _scrape, _value

CHUNK = 64 * 1024


def _client(pool_url: str, tenant: str = "") -> PoolClient:
    return PoolClient(PoolConfig.from_url(f"{pool_url}?tenant={tenant}" if tenant else pool_url))


async def _tenant_report(client: PoolClient, tenant: str, until: object = None, timeout_s: float = 10.0) -> object:
    """The node's STAT line for ``tenant``, once ``until(report)`` holds (the quota rides on the heartbeat)."""
    node = (await client.nodes(refresh=True))[0]
    deadline = time.monotonic() + timeout_s
    while True:
        report = (await client.node_admin.stats(node)).tenants.get(tenant)
        if until is None or (report is not None and until(report)) or time.monotonic() > deadline:  # type: ignore[operator]
            return report
        await asyncio.sleep(0.1)


def test_a_tenant_name_is_checked_and_scopes_the_key():
    assert tenant_of(scoped("alice", "m@1@0@ab@bfloat16")) == "alice"
    assert tenant_of("m@1@0@ab@bfloat16") is None
    assert PoolConfig.from_url("kvpool://127.0.0.1:6379/ns?tenant=alice.v2").tenant == "alice.v2"
    for bad in ("a/b", "a b", "x" * 65, "é", "*"):
        with pytest.raises(ConfigError, match="A-Z a-z 0-9") as raised:
            PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?tenant={quote(bad)}")
        assert raised.value.key == "tenant"
        with pytest.raises(ConfigError, match="A-Z a-z 0-9"):
            PoolConfig(tenant=bad)


async def test_a_tenant_cannot_read_another_tenants_chunk(node_factory, pool_url):
    node_factory()
    async with _client(pool_url, "alice") as alice, _client(pool_url, "bob") as bob:
        (chunk,) = numbered_chunks("same", 1, CHUNK, seed=1)
        await alice.put([chunk])
        assert await alice.contains([chunk.key]) == [True]
        assert await bob.contains([chunk.key]) == [False]
        assert await bob.hit_prefix([chunk.key]) == 0
        assert await bob.get([chunk.key]) == [None]
        assert await bob.list_keys() == []
        assert await alice.list_keys() == [chunk.key]


async def test_a_tenant_cannot_overwrite_another_tenants_chunk(node_factory, pool_url):
    node_factory()
    async with _client(pool_url, "alice") as alice, _client(pool_url, "bob") as bob:
        (mine,) = numbered_chunks("same", 1, CHUNK, seed=1)
        (theirs,) = numbered_chunks("same", 1, CHUNK, seed=2)  # the same key, other bytes
        assert mine.key == theirs.key and bytes(mine.data) != bytes(theirs.data)
        await alice.put([mine])
        await bob.put([theirs])
        got_alice, got_bob = (await alice.get([mine.key]))[0], (await bob.get([mine.key]))[0]
        assert got_alice is not None and bytes(got_alice.data) == bytes(mine.data)
        assert got_bob is not None and bytes(got_bob.data) == bytes(theirs.data)


async def test_a_tenant_cannot_delete_another_tenants_chunk(node_factory, pool_url):
    node_factory()
    async with _client(pool_url, "alice") as alice, _client(pool_url, "bob") as bob:
        (chunk,) = numbered_chunks("same", 1, CHUNK, seed=1)
        await alice.put([chunk])
        assert await bob.delete([chunk.key]) == 0
        got = (await alice.get([chunk.key]))[0]
        assert got is not None and bytes(got.data) == bytes(chunk.data)
        assert await alice.delete([chunk.key]) == 1
        assert await alice.contains([chunk.key]) == [False]


async def test_a_quota_bounds_a_tenants_bytes_and_the_other_tenants_chunks_stay(node_factory, pool_url):
    node_factory(dram="64MiB")
    async with _client(pool_url) as admin_client, _client(pool_url, "alice") as alice, _client(pool_url, "bob") as bob:
        bobs = numbered_chunks("b", 8, CHUNK, seed=3)
        await bob.put(bobs)
        await admin.set_quota(admin_client, "alice", 4 * CHUNK)
        assert await _tenant_report(admin_client, "alice", lambda r: r.quota_bytes == 4 * CHUNK) is not None
        alices = numbered_chunks("a", 10, CHUNK, seed=4)
        for chunk in alices:  # one put each: the oldest are the coldest
            await alice.put([chunk])
        report = await _tenant_report(admin_client, "alice")
        assert report.held_bytes == 4 * CHUNK  # type: ignore[attr-defined]
        assert report.quota_evictions == 6  # type: ignore[attr-defined]
        assert await alice.contains([c.key for c in alices]) == [False] * 6 + [True] * 4
        assert await bob.contains([c.key for c in bobs]) == [True] * 8
        rows = {row.tenant: row for row in await admin.list_quotas(admin_client)}
        assert (rows["alice"].quota_bytes, rows["alice"].held_bytes) == (4 * CHUNK, 4 * CHUNK)
        assert (rows["bob"].quota_bytes, rows["bob"].held_bytes) == (None, 8 * CHUNK)


async def test_a_tenant_whose_pins_fill_its_quota_gets_no_room(node_factory, pool_url):
    node_factory(dram="64MiB")
    async with _client(pool_url) as admin_client, _client(pool_url, "alice") as alice:
        await admin.set_quota(admin_client, "alice", 2 * CHUNK)
        await _tenant_report(admin_client, "alice", lambda r: r.quota_bytes == 2 * CHUNK)
        pinned = numbered_chunks("p", 2, CHUNK, seed=5)
        await alice.put(pinned)
        await admin.pin(admin_client, [scoped("alice", c.key) for c in pinned], ttl_s=60)
        (extra,) = numbered_chunks("x", 1, CHUNK, seed=6)
        with pytest.raises(Exception, match="room") as refused:
            await alice.put([extra])
        assert set(refused.value.outcomes) == {extra.key}  # as the tenant named it, not as the pool holds it
        assert await alice.contains([c.key for c in pinned] + [extra.key]) == [True, True, False]


async def test_per_tenant_metrics_match_the_puts_made(node_factory, pool_url):
    node = node_factory("--metrics-port", "0")
    port = _metrics_port(node)
    async with _client(pool_url, "alice") as alice, _client(pool_url, "bob") as bob:
        await alice.put(numbered_chunks("a", 5, CHUNK, seed=7))
        await bob.put(numbered_chunks("b", 3, CHUNK, seed=8))
        await alice.get(["a@0", "a@1", "nope"])
        await bob.get(["a@0"])  # alice's key: a miss for bob
    samples = _scrape(port)
    n = node.node_id

    def value(name: str, tenant: str) -> float:
        return _value(samples, f"kvpool_node_tenant_{name}", node=n, tenant=tenant)

    assert (value("puts_total", "alice"), value("puts_total", "bob")) == (5, 3)
    assert (value("held_bytes", "alice"), value("held_bytes", "bob")) == (5 * CHUNK, 3 * CHUNK)
    assert (value("hits_total", "alice"), value("misses_total", "alice")) == (2, 0)
    assert (value("hits_total", "bob"), value("misses_total", "bob")) == (0, 0)  # the index answered bob: no such key
    assert value("quota_bytes", "alice") == -1


def test_quota_refuses_a_negative_size_and_a_bad_tenant_name(processes, pool_url):
    negative = kvpool("quota", "set", "alice", "-5", "--url", pool_url)
    assert negative.returncode != 0 and "0 or more bytes" in negative.stderr, negative.stderr
    bad_name = kvpool("quota", "set", "a/b", "1MiB", "--url", pool_url)
    assert bad_name.returncode != 0 and "A-Z a-z 0-9" in bad_name.stderr, bad_name.stderr
    ok = kvpool("quota", "set", "alice", "1MiB", "--url", pool_url)
    assert ok.returncode == 0, ok.stderr
    listed = kvpool("quota", "--url", pool_url)
    assert "alice" in listed.stdout and "1.0 MiB" in listed.stdout, listed.stdout


def test_two_engines_of_two_tenants_keep_the_same_lmcache_keys_apart(node_factory, pool_url, stack_factory):
    """The tenant rides on the connector's URL (LMCache 0.5.6 hands a remote connector no cache_salt)."""
    node_factory()
    alice, bob = stack_factory(f"{pool_url}?tenant=alice"), stack_factory(f"{pool_url}?tenant=bob")
    keys = [alice.key(40 + i) for i in range(3)]
    assert [k.to_string() for k in keys] == [bob.key(40 + i).to_string() for i in range(3)]  # the same LMCache keys
    objs = [alice.make_object(i) for i in range(3)]
    alice.put(keys, objs)
    alice.release(objs)
    assert alice.contains_prefix(keys) == 3
    assert bob.contains_prefix(keys) == 0
    assert bob.get(keys) == [None, None, None]
    assert bob.remote.remove(keys[0]) is False
    assert alice.contains_prefix(keys) == 3
    listed = asyncio.run_coroutine_threadsafe(alice.connector().list(), alice.loop).result(10)
    assert sorted(listed) == sorted(k.to_string() for k in keys)  # the engine's own names, no prefix


BIG_CHUNK = 1024 * 1024  # on a node of 32 MiB of DRAM a connection's window is 4 MiB: four of these


@pytest.mark.parametrize("eviction,nvme", [("lru", False), ("prefix", False), ("lru", True)])
async def test_a_quota_never_evicts_the_chunks_of_the_put_that_needs_room(
    node_factory, pool_url, tmp_path, eviction, nvme
):
    """A tenant at its quota puts a chain it partly holds already, in one request larger than a connection's
    window: the quota makes room from the tenant's other chunks only, then answers no room; the chain's
    held chunks (the coldest the tenant has) stay, so the chain's hit prefix grows, never breaks. With an
    NVMe tier (DRAM smaller than the chain) the held chunks are on NVMe or in DRAM as the demoter moved
    them, and the quota walks NVMe first: the outcome is the same wherever they are."""
    if nvme:
        node_factory("--eviction", eviction, "--nvme-dir", str(tmp_path), "--nvme", "64MiB", dram="8MiB")
    else:
        node_factory("--eviction", eviction, dram="32MiB")
    # One connection: the put is one request, in the node's windows. Over two, its halves would race as two
    # stripes, and a stripe the node has not seen yet is not known to be the put's (docs/fleet.md).
    one_connection = f"{pool_url}?tenant=alice&connections_per_node=1"
    async with _client(pool_url) as admin_client, PoolClient(PoolConfig.from_url(one_connection)) as alice:
        await admin.set_quota(admin_client, "alice", 8 * BIG_CHUNK)
        await _tenant_report(admin_client, "alice", lambda r: r.quota_bytes == 8 * BIG_CHUNK)
        chain = numbered_chunks("c", 10, BIG_CHUNK, seed=9)
        others = numbered_chunks("d", 3, BIG_CHUNK, seed=10)
        await alice.put(chain[:5])  # the chain's first half: the tenant's coldest chunks
        await alice.put(others)
        with pytest.raises(Exception, match="room") as refused:
            await alice.put(chain)  # needs 5 chunks more; only the 3 others may leave
        outcomes = refused.value.outcomes  # type: ignore[attr-defined]
        assert {key for key, outcome in outcomes.items() if outcome is not PutOutcome.STORED} == {"c@8", "c@9"}
        assert await alice.hit_prefix([c.key for c in chain]) == 8
        assert await alice.contains([c.key for c in others]) == [False] * 3
        report = await _tenant_report(admin_client, "alice")
        assert report.held_bytes == 8 * BIG_CHUNK  # type: ignore[attr-defined]
        assert report.quota_evictions == 3  # type: ignore[attr-defined]
