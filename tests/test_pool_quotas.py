"""Pool-wide tenant quotas (docs/fleet.md, "Tenants and quotas"): a tenant's bytes summed over the live nodes,
bounded by what each node learns of the others at its heartbeat; the overshoot stays within the stated bound,
nodes over the quota evict down to their proportional shares, and a dead node's report stops counting."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest
import redis

from backend import admin
from backend.errors import CapacityError, NodeUnavailable
from backend.metadata import POOL_SCOPE
from backend.node.store.quotas import pool_share
from backend.protocol.reports import TenantReport
from kvpool import PoolClient, PoolConfig
from tests.support.chunks import numbered_chunks
from tests.support.cli import kvpool
from tests.test_metrics import _metrics_port, _scrape, _value

CHUNK = 64 * 1024
QUOTA = 8 * CHUNK  # the tenant's bytes over the whole pool
SETTLE_S = 15.0  # reports ride on heartbeats (1 s apart); a dead node's expires with its heartbeat (5 s)


def _client(pool_url: str, tenant: str = "") -> PoolClient:
    return PoolClient(PoolConfig.from_url(f"{pool_url}?tenant={tenant}" if tenant else pool_url))


async def _reports(client: PoolClient, tenant: str) -> dict[str, TenantReport]:
    """Each live node's STAT line for ``tenant`` (a node holding nothing of it and knowing no quota: none)."""
    reports = {}
    for node in await client.nodes(refresh=True):
        try:
            stats = await client.node_admin.stats(node)
        except NodeUnavailable:  # killed, and still listed until its heartbeat expires
            continue
        report = stats.tenants.get(tenant)
        reports[node.node_id] = report if report is not None else TenantReport(0, -1, 0, 0, 0)
    return reports


async def _until(
    client: PoolClient, tenant: str, done: Callable[[dict[str, TenantReport]], bool]
) -> dict[str, TenantReport]:
    """The nodes' reports for ``tenant`` once ``done(reports)`` holds (AssertionError after SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        reports = await _reports(client, tenant)
        if done(reports):
            return reports
        assert time.monotonic() < deadline, reports
        await asyncio.sleep(0.1)


def _settled(reports: dict[str, TenantReport]) -> bool:
    """Every node's share is the one the others' current bytes give: the reports are current and were read."""
    total = sum(r.held_bytes for r in reports.values())
    return all(
        r.pool_share_bytes == pool_share(QUOTA, r.held_bytes, total - r.held_bytes).limit_bytes
        for r in reports.values()
    )


async def _put_refused_or_stored(client: PoolClient, chunks: list, node_id: str) -> None:
    """Put ``chunks`` on ``node_id`` alone; a refusal of some (no room within the quota) is expected."""
    try:
        await client.put(chunks, only=[node_id])
    except CapacityError:
        pass


def test_a_nodes_share_is_the_room_left_within_the_quota_and_its_proportional_part_over_it():
    assert pool_share(8, 2, 3).limit_bytes == 5  # within: all the room the others left
    assert pool_share(8, 0, 0).limit_bytes == 8
    assert pool_share(0, 0, 0).limit_bytes == 0
    assert pool_share(8, 8, 16).limit_bytes == 2  # over: 8 * 8 / 24, rounded down
    for held in ([8, 8, 8], [1, 2, 30], [5, 0, 4, 7], [100, 1]):
        total = sum(held)
        shares = [pool_share(8, mine, total - mine).limit_bytes for mine in held]
        assert sum(shares) <= 8 and all(0 <= share <= 8 for share in shares), (held, shares)
        assert sum(shares) > 8 - len(held)  # the excess leaves once between the nodes, not once per node


async def test_a_pool_quota_bounds_the_overshoot_converges_and_forgets_a_dead_node(
    node_factory, pool_url, redis_server
):
    nodes = [node_factory(dram="64MiB") for _ in range(3)]
    ids = [node.node_id for node in nodes]
    async with _client(pool_url) as admin_client, _client(pool_url, "alice") as alice:
        await admin.set_quota(admin_client, "alice", QUOTA, POOL_SCOPE)
        await _until(admin_client, "alice", lambda rs: all(r.pool_quota_bytes == QUOTA for r in rs.values()))

        # A burst on every node at once, from nothing held: each node may take the whole quota before the
        # others' reports say otherwise. The bound: Q + (N - 1) * (Q - R), R = the bytes last reported (0).
        bursts = [numbered_chunks(f"burst{i}", 10, CHUNK, seed=i) for i in range(3)]
        await asyncio.gather(*(_put_refused_or_stored(alice, chunks, nid) for chunks, nid in zip(bursts, ids)))
        held = {nid: r.held_bytes for nid, r in (await _reports(admin_client, "alice")).items()}
        total = sum(held.values())
        print(f"burst: {total // CHUNK} chunks held over the pool for a quota of {QUOTA // CHUNK}: {held}")
        assert all(nbytes <= QUOTA for nbytes in held.values()), held  # no node passes the quota itself
        assert total <= QUOTA + (len(nodes) - 1) * QUOTA, held

        # The reports land: every node over its share evicts down to it at its next put. The shares add up
        # to the quota, so the excess leaves once between the nodes, not once per node.
        before = await _until(admin_client, "alice", _settled)
        reported = sum(r.held_bytes for r in before.values())
        more = [numbered_chunks(f"more{i}", 4, CHUNK, seed=10 + i) for i in range(3)]
        await asyncio.gather(*(_put_refused_or_stored(alice, chunks, nid) for chunks, nid in zip(more, ids)))
        after = await _reports(admin_client, "alice")
        total = sum(r.held_bytes for r in after.values())
        print(f"after the reports: {total // CHUNK} chunks held (reported {reported // CHUNK})")
        for nid in ids:
            assert after[nid].held_bytes <= before[nid].pool_share_bytes, (before, after)
        if reported > QUOTA:
            assert QUOTA - len(nodes) * CHUNK <= total <= QUOTA, (before, after)
            assert all(r.quota_evictions > 0 for r in after.values()), after
        else:  # a heartbeat fell inside the burst: it never overshot, and each node grew within its share
            assert total <= QUOTA, (before, after)

        # A node dies: its report expires with its heartbeat, and the others may take its share.
        dead = nodes[2]
        dead.kill()
        store = redis.Redis(port=redis_server.port)
        held_key = f"kvp:{{{dead.namespace}}}:held:{dead.node_id}"
        deadline = time.monotonic() + SETTLE_S
        while store.exists(held_key):
            assert time.monotonic() < deadline, "the dead node's report did not expire"
            await asyncio.sleep(0.2)
        live = ids[:2]

        def forgot_the_dead(reports: dict[str, TenantReport]) -> bool:
            shown = {nid: reports[nid] for nid in live if nid in reports}
            return len(shown) == 2 and _settled(shown)

        now = await _until(admin_client, "alice", forgot_the_dead)
        room = now[live[0]].pool_share_bytes - now[live[0]].held_bytes  # what the dead node's bytes held back
        assert room >= after[dead.node_id].held_bytes > 0, (now, after)
        extra = numbered_chunks("extra", room // CHUNK, CHUNK, seed=20)
        await alice.put(extra, only=[live[0]])  # every chunk stored: the dead node's report no longer counts
        final = await _reports(admin_client, "alice")
        assert sum(final[nid].held_bytes for nid in live) == QUOTA, final


async def test_a_tenant_with_both_quotas_is_bound_by_both(node_factory, pool_url):
    node = node_factory("--metrics-port", "0", dram="64MiB")
    async with _client(pool_url) as admin_client, _client(pool_url, "alice") as alice:
        await admin.set_quota(admin_client, "alice", 2 * CHUNK)  # on each node
        await admin.set_quota(admin_client, "alice", 100 * CHUNK, POOL_SCOPE)
        await _until(admin_client, "alice", lambda rs: all(r.pool_quota_bytes == 100 * CHUNK for r in rs.values()))
        for chunk in numbered_chunks("a", 5, CHUNK, seed=1):
            await alice.put([chunk])
        assert (await _reports(admin_client, "alice"))[node.node_id].held_bytes == 2 * CHUNK

        await admin.set_quota(admin_client, "alice", 100 * CHUNK)
        await admin.set_quota(admin_client, "alice", 3 * CHUNK, POOL_SCOPE)
        await _until(admin_client, "alice", lambda rs: all(r.pool_quota_bytes == 3 * CHUNK for r in rs.values()))
        for chunk in numbered_chunks("b", 5, CHUNK, seed=2):
            await alice.put([chunk])
        report = (await _reports(admin_client, "alice"))[node.node_id]
        assert (report.held_bytes, report.quota_bytes, report.pool_share_bytes) == (3 * CHUNK, 100 * CHUNK, 3 * CHUNK)

        rows = {row.tenant: row for row in await admin.list_quotas(admin_client)}
        assert (rows["alice"].quota_bytes, rows["alice"].pool_quota_bytes) == (100 * CHUNK, 3 * CHUNK)
        assert rows["alice"].held_bytes == 3 * CHUNK
    samples = _scrape(_metrics_port(node))
    labels = {"node": node.node_id, "tenant": "alice"}
    assert _value(samples, "kvpool_node_tenant_pool_quota_bytes", **labels) == 3 * CHUNK
    assert _value(samples, "kvpool_node_tenant_pool_share_bytes", **labels) == 3 * CHUNK
    assert _value(samples, "kvpool_node_tenant_quota_bytes", **labels) == 100 * CHUNK


def test_quota_list_shows_both_scopes_and_clear_takes_one(processes, pool_url):
    assert kvpool("quota", "set", "alice", "1MiB", "--url", pool_url).returncode == 0
    set_pool = kvpool("quota", "set", "alice", "4MiB", "--scope", "pool", "--url", pool_url)
    assert set_pool.returncode == 0 and "over the pool" in set_pool.stdout, set_pool.stderr
    listed = kvpool("quota", "--url", pool_url)
    assert "quota/pool" in listed.stdout and "4.0 MiB" in listed.stdout and "1.0 MiB" in listed.stdout, listed.stdout
    cleared = kvpool("quota", "clear", "alice", "--scope", "pool", "--url", pool_url)
    assert cleared.returncode == 0 and "over the pool cleared" in cleared.stdout, cleared.stdout
    (row,) = json.loads(kvpool("quota", "--json", "--url", pool_url).stdout)
    assert (row["quota_bytes"], row["pool_quota_bytes"]) == (1024 * 1024, None)


@pytest.mark.parametrize(
    "args,named",
    [
        (["set", "alice", "-5"], "0 or more bytes"),
        (["set", "alice", "lots"], "is not a size"),
        (["set", "alice", "1MiB", "--scope", "cluster"], "invalid choice: 'cluster'"),
        (["set", "a/b", "1MiB", "--scope", "pool"], "A-Z a-z 0-9"),
        (["clear", "a b", "--scope", "pool"], "A-Z a-z 0-9"),
        (["set", "alice"], "needs TENANT and BYTES"),
        (["clear", "alice", "1MiB"], "takes no BYTES"),
    ],
)
def test_bad_quota_input_exits_2_naming_it_and_changes_nothing(processes, pool_url, args, named):
    assert kvpool("quota", "set", "alice", "2MiB", "--scope", "pool", "--url", pool_url).returncode == 0
    bad = kvpool("quota", *args, "--url", pool_url)
    assert bad.returncode == 2 and named in bad.stderr, (bad.returncode, bad.stderr)
    (row,) = json.loads(kvpool("quota", "--json", "--url", pool_url).stdout)
    assert row["pool_quota_bytes"] == 2 * 1024 * 1024  # nothing lost
