"""Nodes whose wall clocks are hours off: liveness rides on Redis TTLs, never on timestamps.

Each node process gets a ``sitecustomize`` that shifts its ``time.time`` (a real
clock change would need root and move the whole machine). Monotonic clocks, which
the node uses for leases and uptime, are untouched, as they would be on a real host
whose wall clock was set wrong.
"""

from __future__ import annotations

import asyncio
import time

from backend.admin import NodeRow, node_rows
from kvpool import PoolClient, PoolConfig, SyncPoolClient
from tests.faults.proxy import skewed_clock_env
from tests.support.chunks import numbered_chunks as _chunks
from tests.support.waits import wait_until

SKEW_S = 3 * 3600.0
HEARTBEAT_TTL_S = 5.0  # the node's default heartbeat_ttl_s


def test_nodes_hours_ahead_or_behind_stay_alive_serve_and_die_by_their_ttl(node_factory, pool_url, tmp_path):
    ahead = node_factory(env=skewed_clock_env(tmp_path / "clock", SKEW_S))
    behind = node_factory(env=skewed_clock_env(tmp_path / "clock", -SKEW_S))
    with SyncPoolClient(
        PoolConfig.from_url(pool_url + "?replicas=2&connect_timeout_s=1&progress_timeout_s=1")
    ) as client:
        first = {n.node_id: n for n in client.nodes()}
        assert first[ahead.node_id].heartbeat_at > time.time() + SKEW_S / 2  # the skew took effect
        assert first[behind.node_id].heartbeat_at < time.time() - SKEW_S / 2

        chunks = _chunks("skew", 8, 64 * 1024)
        keys = [c.key for c in chunks]
        client.put(chunks)
        assert [bytes(g.data) for g in client.get(keys)] == [bytes(c.data) for c in chunks]

        # Beats keep coming for longer than the TTL, and both stay alive throughout.
        def beaten_past_ttl() -> bool:
            now = {n.node_id: n for n in client.nodes()}
            assert ahead.node_id in now and behind.node_id in now, "a skewed node was declared dead"
            return all(now[i].heartbeat_at - first[i].heartbeat_at > HEARTBEAT_TTL_S for i in now)

        assert wait_until(beaten_past_ttl, 20.0, 0.2)

        # Uptime comes from the node's monotonic clock, not from its skewed start time.
        rows = {r.node_id: r for r in asyncio.run(_rows(pool_url))}
        assert all(0 <= rows[n.node_id].uptime_s < 600 for n in (ahead, behind))

        # Death is the TTL running out on Redis's clock, whatever the node's clock said.
        behind.kill()
        assert wait_until(lambda: behind.node_id not in {n.node_id for n in client.nodes()}, 20.0, 0.2)
        assert ahead.node_id in {n.node_id for n in client.nodes()}
        assert [bytes(g.data) for g in client.get(keys)] == [bytes(c.data) for c in chunks]


async def _rows(url: str) -> list[NodeRow]:
    async with PoolClient(PoolConfig.from_url(url)) as client:
        return await node_rows(client)
