"""The pool over a real 3-master Redis Cluster and through a real Redis Sentinel.

Each test starts its own redis-servers: three ``--cluster-enabled yes`` servers joined
by ``redis-cli --cluster create``, or one master watched by one ``redis-server
--sentinel``. Then real node processes and a real client use the pool through the
``kvpool://...?redis_mode=cluster`` or ``?sentinel=NAME`` URL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.embedded import EmbeddedRedis, free_port
from backend.launch.redis_servers import RedisProcesses
from backend.launch.redis_servers import cli as _cli
from backend.metadata import MetadataStore
from kvpool import Chunk, PoolClient, PoolConfig, SyncPoolClient
from tests.conftest import REPO
from tests.support.index import index_key, index_pattern
from tests.support.waits import wait_until

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None, reason="needs redis-server and redis-cli"
)


@pytest.fixture
def redis_processes(processes: None, tmp_path: Path) -> Iterator[RedisProcesses]:
    made = RedisProcesses(tmp_path)
    yield made
    made.stop_all()


@pytest.fixture
def redis_cluster(redis_processes: RedisProcesses) -> list[int]:
    """Three masters, no replicas, all 16384 slots assigned; returns their ports."""
    return redis_processes.start_cluster(3)


def _chunks(prefix: str, count: int, size: int) -> list[Chunk]:
    return [Chunk(f"{prefix}@{i}", os.urandom(size)) for i in range(count)]


def _kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LMCACHE_TRACK_USAGE": "false"}
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )


def _index_keys_on(port: int, namespace: str) -> int:
    return len(_cli(port, "--scan", "--pattern", index_pattern(namespace)).split())


def test_pool_over_a_three_master_cluster_stores_lists_and_deletes_with_the_index_on_every_master(
    redis_cluster, node_factory, namespace
):
    seed_a, seed_b, seed_c = redis_cluster
    node_url = f"redis+cluster://127.0.0.1:{seed_a}"
    a = node_factory(redis_url=node_url)
    b = node_factory(redis_url=node_url)
    # The client seeds from another member than the nodes did: any member will do.
    url = f"kvpool://127.0.0.1:{seed_b}/{namespace}?redis_mode=cluster&redis_hosts=127.0.0.1:{seed_c}"
    chunks = _chunks("cl", 60, 3000)
    keys = [c.key for c in chunks]
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        assert {n.node_id for n in client.nodes()} == {a.node_id, b.node_id}
        client.put(chunks)
        got = client.get([*keys, "cl@absent"])
        assert [bytes(g.data) for g in got[:-1]] == [bytes(c.data) for c in chunks]
        assert got[-1] is None
        assert client.contains(keys) == [True] * 60
        assert sorted(client.list_keys()) == sorted(keys)
        per_master = [_index_keys_on(port, namespace) for port in redis_cluster]
        assert sum(per_master) == 60 and all(count > 0 for count in per_master), per_master
        listed = _kvpool("ls", "--url", url)
        assert listed.returncode == 0, listed.stderr
        assert sorted(line.split()[0] for line in listed.stdout.splitlines()) == sorted(keys)
        status = _kvpool("status", "--url", url)
        assert status.returncode == 0, status.stderr
        assert "2 alive" in status.stdout and "redis+cluster://" in status.stdout
        check = _kvpool("check", "--url", url)  # walks the index on every master, asks the nodes
        assert check.returncode == 0, check.stderr
        assert "checked 60 index entries" in check.stdout and "clean" in check.stdout
        assert client.delete(keys[:30]) == 30
        assert client.contains(keys) == [False] * 30 + [True] * 30
        assert client.get(keys[:30]) == [None] * 30


def test_a_cluster_of_one_primary_runs_a_node_and_reads_its_version_and_memory(
    redis_processes, node_factory, namespace
):
    """A managed cluster of one shard answers INFO with that node's fields alone, not keyed by node (redis-py):
    the node's start-up version check and the memory reading took the fields for nodes and crashed."""
    (port,) = redis_processes.start_cluster(1)
    url = f"redis+cluster://127.0.0.1:{port}"
    store = MetadataStore(url, namespace)

    async def read() -> tuple[str, int]:
        try:
            return await store.connection.check_version(), (await store.connection.memory()).used_bytes
        finally:
            await store.close()

    version, used = asyncio.run(read())
    assert version.startswith("7.") and used > 0
    node = node_factory(redis_url=url)
    with SyncPoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{port}/{namespace}?redis_mode=cluster")) as client:
        client.put(_chunks("one", 4, 1000))
        assert client.contains([f"one@{i}" for i in range(4)]) == [True] * 4
    assert node.alive()


def test_every_node_republishes_when_one_cluster_shard_restarts_empty(
    redis_cluster, redis_processes, node_factory, namespace
):
    node = node_factory(redis_url=f"redis+cluster://127.0.0.1:{redis_cluster[0]}")
    url = f"kvpool://127.0.0.1:{redis_cluster[0]}/{namespace}?redis_mode=cluster&progress_timeout_s=1"
    chunks = _chunks("sh", 60, 2000)
    keys = [c.key for c in chunks]
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        # Empty a shard that does NOT hold the registry and its marker: only its own marker tells.
        registry_slot = _cli(redis_cluster[0], "CLUSTER", "KEYSLOT", f"kvp:{{{namespace}}}:marker").strip()
        victim = next(
            port for port in redis_cluster if _cli(port, "CLUSTER", "COUNTKEYSINSLOT", registry_slot).strip() == "0"
        )
        lost = _index_keys_on(victim, namespace)
        assert lost > 0
        node.pause()  # hold its heartbeat so the misses can be seen before it republishes
        _cli(victim, "FLUSHALL")
        assert client.contains(keys).count(False) == lost  # that shard's keys miss; nothing raises
        node.resume()
        assert wait_until(lambda: client.contains(keys) == [True] * 60, 20.0)
        got = client.get(keys)
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]
    assert "republished" in node.log


def test_cluster_master_killed_reads_as_misses_and_restarted_empty_is_republished(
    redis_cluster, redis_processes, node_factory, namespace
):
    node = node_factory(redis_url=f"redis+cluster://127.0.0.1:{redis_cluster[0]}")
    url = f"kvpool://127.0.0.1:{redis_cluster[0]}/{namespace}?redis_mode=cluster&progress_timeout_s=1"
    chunks = _chunks("kl", 60, 2000)
    keys = [c.key for c in chunks]
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        victim = redis_cluster[1]
        on_victim = {
            name[len(index_key(namespace, "")) :]
            for name in _cli(victim, "--scan", "--pattern", index_pattern(namespace)).split()
        }
        assert on_victim
        redis_processes.kill(victim)
        # A master without a replica is gone: its keys (and, once the cluster marks
        # itself failed, every key) miss; nothing raises and nothing waits unbounded.
        hits = run_in_thread(lambda: client.contains(keys), 60)
        assert not any(hit for key, hit in zip(keys, hits) if key in on_victim)
        got = run_in_thread(lambda: client.get(keys), 60)
        for chunk, data in zip(chunks, got):
            assert data is None if chunk.key in on_victim else data is None or bytes(data.data) == bytes(chunk.data)
        redis_processes.start(victim)  # same port and cluster config, no data
        redis_processes.wait_cluster_ok(redis_cluster)
        assert wait_until(lambda: client.contains(keys) == [True] * 60, 30.0)
        got = client.get(keys)
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]
    assert "republished 60 chunks" in node.log


def run_in_thread(fn, timeout_s: float):
    """``fn()``, or a failure if it does not return within ``timeout_s``."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout_s)
    finally:
        pool.shutdown(wait=False)  # a call that hung fails the test instead of stalling it


def test_pool_through_a_sentinel_finds_the_master_by_name(redis_processes, node_factory, namespace):
    master = redis_processes.start(free_port())
    sentinel = redis_processes.start_sentinel(free_port(), "kvmaster", master)
    node_url = f"redis+sentinel://127.0.0.1:{sentinel}/kvmaster"
    node = node_factory(redis_url=node_url)
    url = f"kvpool://127.0.0.1:{sentinel}/{namespace}?sentinel=kvmaster"
    chunks = _chunks("se", 10, 5000)
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        assert [n.node_id for n in client.nodes()] == [node.node_id]
        client.put(chunks)
        got = client.get([c.key for c in chunks])
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]
    # The index is in the master the sentinel named, not anywhere else.
    assert len(_cli(master, "--scan", "--pattern", index_pattern(namespace)).split()) == 10
    status = _kvpool("status", "--url", url)
    assert status.returncode == 0, status.stderr
    assert "redis+sentinel://" in status.stdout and "1 alive" in status.stdout


def test_sentinel_failover_reads_as_misses_then_the_promoted_replica_serves_the_same_index(
    redis_processes, node_factory, namespace
):
    master = redis_processes.start(free_port())
    replica = redis_processes.start(free_port(), "--replicaof", "127.0.0.1", str(master))
    sentinel = redis_processes.start_sentinel(free_port(), "kvmaster", master)
    assert wait_until(lambda: "master_link_status:up" in _cli(replica, "INFO", "replication"), 30.0)
    node = node_factory(redis_url=f"redis+sentinel://127.0.0.1:{sentinel}/kvmaster")
    url = f"kvpool://127.0.0.1:{sentinel}/{namespace}?sentinel=kvmaster&progress_timeout_s=1"
    chunks = _chunks("fo", 20, 3000)
    keys = [c.key for c in chunks]
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        assert _cli(master, "WAIT", "1", "5000").strip() == "1"  # the replica has the index too
        redis_processes.kill(master)
        hits = run_in_thread(lambda: client.contains(keys), 60)  # misses or hits, never an exception
        assert hits in ([False] * 20, [True] * 20)
        assert wait_until(lambda: "role:master" in _cli(replica, "INFO", "replication"), 30.0)
        assert wait_until(lambda: client.contains(keys) == [True] * 20, 30.0)
        got = client.get(keys)
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]
        more = _chunks("after", 5, 1000)
        client.put(more)  # writes go to the promoted master
        assert len(_cli(replica, "--scan", "--pattern", index_pattern(namespace, "after@*")).split()) == 5
    assert node.alive()


@pytest.mark.usefixtures("processes")
def test_sentinel_with_an_unknown_master_name_is_an_error_naming_it(redis_processes, namespace):
    master = redis_processes.start(free_port())
    sentinel = redis_processes.start_sentinel(free_port(), "kvmaster", master)
    status = _kvpool("status", "--url", f"kvpool://127.0.0.1:{sentinel}/{namespace}?sentinel=other")
    assert status.returncode == 1
    assert "other" in status.stderr


async def test_metadata_calls_to_a_cluster_recover_from_scripts_lost_on_every_shard(redis_cluster, namespace):
    from backend.metadata import Location

    store = MetadataStore(f"redis+cluster://127.0.0.1:{redis_cluster[2]}", namespace)
    try:
        keys = [f"s{i}" for i in range(50)]
        await store.index.commit([(k, Location("n1", 1, "dram", 10, 5)) for k in keys])
        for port in redis_cluster:
            _cli(port, "SCRIPT", "FLUSH")  # as a shard restarted empty would
        await store.index.remove("n1", 1, keys[:20])
        entries = await store.index.lookup(keys)
        assert [bool(e) for e in entries] == [False] * 20 + [True] * 30
        assert await store.index.flush_namespace() >= 30
        assert [k async for k in store.index.scan_keys()] == []
    finally:
        await store.close()


def test_lmcache_misses_while_redis_restarts_empty_then_hits_the_same_bytes(
    node_factory, redis_factory, stack_factory, namespace
):
    from tests.support.lmcache import same_bytes
    from tests.support.waits import run_with_timeout

    redis = EmbeddedRedis().start()
    redis_factory.append(redis)
    node = node_factory(redis_url=redis.url)
    stack = stack_factory(f"kvpool://127.0.0.1:{redis.port}/{namespace}?progress_timeout_s=0.5")
    keys = [stack.key(400 + i) for i in range(4)]
    objs = [stack.make_object(i) for i in range(4)]
    stack.put(keys, objs)
    assert stack.contains_prefix(keys) == 4
    redis.kill()
    # Every wait below is bounded: a call that hung would fail the test, not stall it.
    assert run_with_timeout(lambda: stack.contains_prefix(keys), 30) == 0
    assert run_with_timeout(lambda: stack.get(keys), 30) == [None] * 4
    late = [stack.make_object(9)]
    run_with_timeout(lambda: stack.put([stack.key(499)], late), 60)  # no exception reaches LMCache
    stack.release(late)
    assert stack.connector().counters["miss_put"] == 1
    restarted = EmbeddedRedis(redis.port)
    redis_factory.append(restarted)
    restarted.start()  # empty: the node finds its marker gone and republishes
    assert wait_until(lambda: stack.contains_prefix(keys) == 4, 30.0)
    got = stack.get(keys)
    assert all(g is not None and same_bytes(g, obj) for g, obj in zip(got, objs))
    stack.release(objs + got)
    assert "republished 4 chunks" in node.log


@pytest.mark.usefixtures("processes")
def test_bench_redis_commands_counts_one_hgetall_per_key_on_both_topologies():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.harness.redis_commands", "--keys", "50", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("lookup commands: {'hgetall': 50}") == 2
    assert "redis-server paused:" in proc.stdout and "redis-server killed:" in proc.stdout


async def _walk(store: MetadataStore, match: str) -> list[str]:
    cursor, seen, steps = 0, [], 0
    while True:
        cursor, found = await store.index.scan_step(cursor, match, count=10)
        seen.extend(found)
        steps += 1
        if cursor == 0:
            return seen
        assert steps < 10_000


async def test_scan_steps_walk_every_key_once_across_every_cluster_primary(redis_cluster, redis_factory, namespace):
    from backend.metadata import Location

    # A private server: the session's shared one holds whatever earlier tests left (10^5 keys and
    # more), which a walk of 10 keys per step would take longer than _walk's bound to cover.
    redis_factory.append(single := EmbeddedRedis().start())
    for url in (f"redis+cluster://127.0.0.1:{redis_cluster[0]}", single.url):
        store = MetadataStore(url, namespace)
        try:
            keys = [f"mp:w{i}" for i in range(250)]
            await store.index.commit([(k, Location("n1", 1, "dram", 10, 5)) for k in [*keys, "other"]])
            walked = await _walk(store, "mp:*")
            assert sorted(walked) == sorted(keys), url  # each key once, none from another pattern
        finally:
            await store.index.flush_namespace()
            await store.close()


@pytest.mark.parametrize(
    ("query", "redis_url"),
    [
        ("", "redis://h:1/0"),
        ("?redis_mode=cluster", "redis+cluster://h:1"),
        ("?redis_mode=cluster&redis_hosts=h2:2,[::1]:3", "redis+cluster://h:1,h2:2,[::1]:3"),
        ("?sentinel=kvmaster", "redis+sentinel://h:1/kvmaster"),
        ("?sentinel=kvmaster&redis_hosts=h2:2", "redis+sentinel://h:1,h2:2/kvmaster"),
        ("?tls=on&redis_user=alice", "rediss://alice@h:1/0"),
        ("?redis_mode=cluster&tls=on&redis_user=alice", "rediss+cluster://alice@h:1"),
        ("?sentinel=kvmaster&tls=on", "rediss+sentinel://h:1/kvmaster"),
    ],
)
def test_pool_url_names_the_redis_topology_nodes_take(query, redis_url):
    config = PoolConfig.from_url(f"kvpool://h:1/ns{query}")
    assert config.redis_url == redis_url
    assert PoolConfig.from_url(config.to_url()) == config  # the canonical URL keeps the topology
    from backend.redis_topology import RedisTarget

    assert RedisTarget.parse(redis_url).render() == redis_url


async def test_tls_and_acl_user_reach_every_topologys_connections():
    from backend.redis_topology import RedisTarget, connect

    target = RedisTarget.parse("rediss+cluster://alice:s3cret@h:1,h2:2")
    assert (target.tls, target.user, target.password) == (True, "alice", "s3cret")
    assert target.render() == "rediss+cluster://alice:***@h:1,h2:2"  # the password never shows
    cluster = connect(target, 1.0, ca_file="/ca.pem")
    kwargs = cluster.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["ssl_ca_certs"]) == ("alice", "s3cret", "/ca.pem")
    assert "SSL" in kwargs["connection_class"].__name__
    single = connect(RedisTarget.parse("rediss://bob@h:1/0"), 1.0, password="pw", ca_file="/ca.pem")
    pool_kwargs = single.connection_pool.connection_kwargs
    assert (pool_kwargs["username"], pool_kwargs["password"], pool_kwargs["ssl_ca_certs"]) == ("bob", "pw", "/ca.pem")
    assert "SSL" in single.connection_pool.connection_class.__name__
    await single.aclose()
    await cluster.aclose()


@pytest.mark.parametrize(
    ("query", "option"),
    [
        ("?redis_mode=cluster&sentinel=m", "sentinel"),
        ("?redis_hosts=h2:2", "redis_hosts"),
        ("?redis_mode=cluster&redis_hosts=h2", "redis_hosts"),
        ("?redis_mode=sentinel", "redis_mode"),
        ("?redis_mode=shard", "redis_mode"),
    ],
)
def test_wrong_redis_topology_options_are_config_errors_naming_the_option(query, option):
    from backend.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url(f"kvpool://h:1/ns{query}")
    assert caught.value.key == option


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize(
    "url", ["redis+sentinel://127.0.0.1:1", "redis+cluster://127.0.0.1:1/x", "redis+cluster://nohost", "http://h:1"]
)
def test_node_refuses_a_malformed_redis_url_naming_the_flag(url):
    proc = _kvpool("node", "--redis", url, "--dram", "1MiB")
    assert proc.returncode == 2
    assert "--redis" in proc.stderr


def test_a_hung_redis_reads_as_misses_and_a_put_fails_without_hanging(node_factory, redis_factory, namespace):
    import signal

    from backend.errors import KVPoolError

    redis = EmbeddedRedis().start()
    redis_factory.append(redis)
    node_factory(redis_url=redis.url)
    chunks = _chunks("hung", 5, 1000)
    keys = [c.key for c in chunks]
    with SyncPoolClient(
        PoolConfig.from_url(f"kvpool://127.0.0.1:{redis.port}/{namespace}?progress_timeout_s=0.5")
    ) as client:
        client.put(chunks)
        assert redis.process is not None
        redis.process.send_signal(signal.SIGSTOP)  # accepts connections, never answers
        try:
            assert run_in_thread(lambda: client.contains(keys), 30) == [False] * 5
            assert run_in_thread(lambda: client.get(keys), 30) == [None] * 5
            with pytest.raises(KVPoolError):
                run_in_thread(lambda: client.put(_chunks("late", 1, 100)), 30)  # not indexed: not acknowledged
        finally:
            redis.process.send_signal(signal.SIGCONT)
        assert wait_until(lambda: client.contains(keys) == [True] * 5, 15.0)


async def test_scans_of_a_hung_redis_fail_within_the_timeout_instead_of_retrying_past_it(redis_factory, namespace):
    """SCAN paths (list_keys, ls, check, flush) promise the same bound as every other Redis call.

    redis-py alone would wait one socket timeout, reconnect and wait another: twice the timeout.
    """
    import signal
    import time

    from backend.errors import MetadataError
    from backend.metadata import Location

    redis = EmbeddedRedis().start()
    redis_factory.append(redis)
    store = MetadataStore(redis.url, namespace, timeout_s=1.0)
    try:
        await store.index.commit([(f"scan@{i}", Location("n", 1, "dram", 1, i)) for i in range(50)])
        assert len([key async for key in store.index.scan_keys()]) == 50
        assert redis.process is not None
        redis.process.send_signal(signal.SIGSTOP)  # accepts connections, never answers

        async def scan_all() -> list[str]:
            return [key async for key in store.index.scan_keys()]

        try:
            for name, call in (("scan_keys", scan_all), ("flush_namespace", store.index.flush_namespace)):
                started = time.monotonic()
                # The first call times out; the next fails at once (the breaker is open since then).
                with pytest.raises(
                    MetadataError, match=r"no answer within 1000 ms|has not answered since a call timed"
                ):
                    await call()
                assert time.monotonic() - started < 1.7, name
        finally:
            redis.process.send_signal(signal.SIGCONT)
    finally:
        await store.close()


async def test_lookups_on_a_cluster_give_the_answers_one_redis_gives(redis_cluster, redis_server, namespace):
    """Keys spread over every primary: one script call per primary, combined into one answer."""
    from backend.metadata import Location, NodeInfo

    keys = [f"spread/{i}" for i in range(300)]
    locations = [(key, Location("n1", 3, "dram", 10, i)) for i, key in enumerate(keys) if i != 200]
    locations += [(keys[7], Location("ghost", 1, "dram", 10, 7)), (keys[250], Location("n1", 2, "dram", 10, 0))]
    stores = [
        MetadataStore(f"redis+cluster://127.0.0.1:{redis_cluster[0]}", namespace),
        MetadataStore(redis_server.url, namespace),
    ]
    try:
        answers = []
        for store in stores:
            await store.index.commit(locations)
            for port in redis_cluster if store.connection.is_cluster else []:
                _cli(port, "SCRIPT", "FLUSH")  # as a shard restarted empty would: reloaded, not a miss
            found = []
            for prefix in (True, False):
                for copies in (True, False):
                    got = await store.lookup.lookup_live(keys, {"n1": 3}, prefix=prefix, copies=copies)
                    found.append((got.hits, got.copies, sorted((i, loc.node_id, loc.epoch) for i, loc in got.others)))
            answers.append(found)
        cluster, single = answers
        assert cluster == single
        hits, copies, others = cluster[0]
        assert len(hits) == 201 and hits[:200] == [True] * 200 and hits[200] is False
        assert [loc.checksum for loc in copies[7]] == [7]  # its live copy; the dead one is another
        assert others == [(7, "ghost", 1)]  # key 250's old epoch is past the prefix: never read
        assert cluster[2][0] == [True] * 200 + [False] + [True] * 49 + [False] + [True] * 49
        assert cluster[2][2] == [(7, "ghost", 1), (250, "n1", 2)]
        assert all(_index_keys_on(port, namespace) > 50 for port in redis_cluster)  # every primary was asked

        await stores[0].registry.heartbeat(NodeInfo("n1", "127.0.0.1", 1, 3), ttl_ms=60_000, changed=True)
        client = PoolClient(
            PoolConfig.from_url(f"kvpool://127.0.0.1:{redis_cluster[1]}/{namespace}?redis_mode=cluster")
        )
        try:
            assert await client.hit_prefix(keys) == 200
            assert await client.contains(keys[199:202]) == [True, False, True]
            assert await client.contains(keys[249:252]) == [True, False, True]
        finally:
            await client.close()
    finally:
        for store in stores:
            await store.close()


async def test_a_sweep_walks_every_primary_and_removes_dead_and_ended_runs_fields_where_they_lie(
    redis_cluster, redis_server, namespace
):
    """The dead-node reaper's sweep (``KeyIndex.sweep_step``): one Lua call per SCAN page, on each primary in
    turn, removing a dead slot's fields and a live node's older epoch's, keeping its newer and unknown ones."""
    from backend.metadata import Location

    keys = [f"sweep/{i}" for i in range(600)]
    for url in (f"redis+cluster://127.0.0.1:{redis_cluster[0]}", redis_server.url):
        store = MetadataStore(url, namespace)
        try:
            await store.index.commit([(k, Location("live", 5, "dram", 10, i)) for i, k in enumerate(keys)])
            await store.index.commit([(k, Location("dead", 2, "dram", 10, i)) for i, k in enumerate(keys)])
            await store.index.commit([(k, Location("restarted", 3, "dram", 10, i)) for i, k in enumerate(keys[:300])])
            await store.index.commit(
                [(k, Location("restarted", 4, "dram", 10, i)) for i, k in enumerate(keys[300:], 300)]
            )
            await store.index.commit([(keys[0], Location("stranger", 1, "dram", 10, 0))])
            slot = {n: store.connection.slots.slot_of(n) for n in ("live", "dead", "restarted", "stranger")}
            live = {slot["live"]: 5, slot["restarted"]: 4}
            cursor, read, removed, unknown, calls = 0, 0, 0, set(), 0
            while True:
                page = await store.index.sweep_step(cursor, live, {slot["dead"]}, count=100)
                cursor, read, removed, calls = page.cursor, read + page.keys, removed + page.removed, calls + 1
                unknown |= page.unknown
                if cursor == 0:
                    break
            assert read == 600 and removed == 600 + 300 and unknown == {slot["stranger"]}
            assert calls >= 6  # pages, not one call over everything
            entries = await store.index.lookup(keys)
            assert sorted(loc.node_id for loc in entries[0]) == ["live", "stranger"]  # a slot no one is told of stays
            assert all(
                sorted((loc.node_id, loc.epoch) for loc in e) == [("live", 5), ("restarted", 4)] for e in entries[300:]
            )
            assert all([loc.node_id for loc in e] == ["live"] for e in entries[1:300])
            if store.connection.is_cluster:
                assert all(_index_keys_on(port, namespace) > 100 for port in redis_cluster)  # every primary held some
        finally:
            await store.close()
