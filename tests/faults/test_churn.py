"""Node churn: what killed nodes leave in Redis is collected by a live node, so Redis stays bounded.

Nodes without an NVMe directory take a new id at every start (HOSTNAME-PORT), and a node
killed with SIGKILL never deregisters. Fifty such restarts (twenty in ``make test``, fifty
under ``make faults``), with chunks written to them, must not leave a registry entry per
restart and their index fields behind.
"""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import redis

from kvpool import Chunk, KVPoolError, PoolConfig, SyncPoolClient
from tests.support.index import index_key, slots
from tests.support.waits import wait_until

RESTARTS = 50 if os.environ.get("KVPOOL_FULL") else 20  # `make faults` runs all fifty
AT_ONCE = 5  # nodes started (and killed) together, to keep the test short
GRACE_S = 1.0
KEYS = 40
COLLECT_WAIT_S = 30.0  # heartbeat TTL (5 s) + grace + a few collector steps, with room for a loaded machine


def _namespace_footprint(r: redis.Redis, namespace: str) -> tuple[int, int, int, set[str]]:
    """(registry entries, index fields, bytes of every key of the namespace, node ids the index names)."""
    registry = r.hlen(f"kvp:{{{namespace}}}:nodes")
    fields, memory, named = 0, 0, set()
    by_slot = {str(slot): node for node, slot in slots(r, namespace).items()}
    for pattern in (f"kvp:{namespace}*", f"kvp:{{{namespace}}}:*"):
        for key in r.scan_iter(match=pattern, count=1000):
            memory += r.memory_usage(key, samples=0) or 0
            if key.startswith(index_key(namespace, "")):
                holders = r.hkeys(key)
                fields += len(holders)
                named.update(by_slot.get(slot, f"#{slot}") for slot in holders)
    return registry, fields, memory, named


def _collected(r: redis.Redis, namespace: str, live: set[str]) -> bool:
    registry, _, _, named = _namespace_footprint(r, namespace)
    return registry == len(live) and named <= live


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_node_restarts_leave_redis_bounded(node_factory, pool_url, redis_server, namespace):
    survivor = node_factory("--node-id", "0-survivor", "--dead-node-grace-s", str(GRACE_S), dram="64MiB")
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    rng = random.Random(7)
    footprints = []
    with SyncPoolClient(PoolConfig.from_url(f"{pool_url}?connect_timeout_s=1&progress_timeout_s=1")) as client:
        for round_ in range(RESTARTS // AT_ONCE):
            churn = [node_factory("--dead-node-grace-s", str(GRACE_S), dram="16MiB") for _ in range(AT_ONCE)]
            assert len({n.node_id for n in churn}) == AT_ONCE  # each start is a new id: no NVMe to keep one in
            client.nodes(refresh=True)
            # Mostly on the new nodes. Nodes killed a moment ago are listed until their heartbeat expires,
            # so a few chunks can fail to find three live nodes in a row: they are not what is measured.
            with contextlib.suppress(KVPoolError):
                client.put([Chunk(f"churn@{i}", rng.randbytes(4096)) for i in range(KEYS)])
            for node in churn:
                node.kill()
            if round_ in (1, RESTARTS // AT_ONCE - 1):
                assert wait_until(lambda: _collected(r, namespace, {survivor.node_id}), COLLECT_WAIT_S), (
                    _namespace_footprint(r, namespace)[:3]
                )
                footprints.append(_namespace_footprint(r, namespace))
        stats = client.node_stats(client.nodes(refresh=True)[0])
    (reg_early, _, mem_early, _), (reg_late, fields_late, mem_late, named_late) = footprints
    print(
        f"after {2 * AT_ONCE} restarts: {footprints[0][:3]}; after {RESTARTS}: {footprints[1][:3]} "
        "(registry entries, index fields, bytes)"
    )
    assert reg_early == reg_late == 1  # the survivor alone: every dead node forgotten
    assert named_late == {survivor.node_id}  # no index field names a dead node
    assert fields_late <= KEYS  # at most one field per key: the survivor's copy
    assert mem_late <= mem_early * 1.2 + 4096, (mem_early, mem_late)  # flat across the later restarts
    assert stats["counters"]["collected_nodes"] >= RESTARTS - AT_ONCE
    assert survivor.alive()


def test_a_node_collected_while_frozen_republishes_when_it_resumes(node_factory, pool_url, redis_server, namespace):
    """Being collected costs a frozen node misses, never its bytes: its next heartbeat finds its registry
    entry gone and republishes what it holds."""
    frozen = node_factory("--node-id", "b-frozen", dram="16MiB")
    chunks = [Chunk(f"frozen@{i}", random.Random(i).randbytes(2048)) for i in range(10)]
    with SyncPoolClient(PoolConfig.from_url(f"{pool_url}?connect_timeout_s=1&progress_timeout_s=1")) as client:
        client.put(chunks)  # the only node holds them all
        node_factory("--node-id", "a-collector", "--dead-node-grace-s", str(GRACE_S), dram="16MiB")
        keys = [c.key for c in chunks]
        frozen.pause()
        try:
            r = redis.Redis.from_url(redis_server.url, decode_responses=True)
            assert wait_until(lambda: not r.hexists(f"kvp:{{{namespace}}}:nodes", "b-frozen"), COLLECT_WAIT_S)
            assert wait_until(lambda: client.contains(keys) == [False] * len(keys), COLLECT_WAIT_S)
        finally:
            frozen.resume()
        assert wait_until(lambda: client.contains(keys) == [True] * len(keys), 15.0)
        got = client.get(keys)
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]
    assert wait_until(lambda: "collected as dead" in frozen.log, 5.0)
