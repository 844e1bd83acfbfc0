"""Redis trouble is named and survived: a full Redis, a paused Redis.

The attacks (issue 33): a Redis at ``maxmemory`` under ``noeviction`` refused the heartbeat's
writes, so the node was declared dead with a log line that did not say Redis was full; a
``CLIENT PAUSE`` of 2 s made clients mark healthy nodes down, because the node's put commit
waited on Redis as long as the client waited for the node's answer. Each test runs real node
processes against a private redis-server that it fills or pauses.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis

from backend.embedded import EmbeddedRedis
from kvpool import Chunk, MetadataError, PoolClient, PoolConfig, SyncPoolClient
from tests.support.chunks import all_read_back, seeded_chunks
from tests.support.cli import kvpool
from tests.support.waits import until, wait_until
from tests.test_metrics import _metrics_port

FULL = bool(os.environ.get("KVPOOL_FULL"))  # `make faults`: the 30 s form
KIB = 1024
MIB = 1024 * KIB
# Longer than one heartbeat TTL (5 s): a node whose beats Redis refused would be declared dead within it.
FULL_FOR_S = 30.0 if FULL else 7.0
PAUSE_MS = 2000  # as long as the client's progress_timeout_s (2 s by default)


def _private_redis(redis_factory: list[EmbeddedRedis]) -> EmbeddedRedis:
    server = EmbeddedRedis().start()
    redis_factory.append(server)
    return server


def _fill(raw: redis.Redis) -> int:
    """Make Redis full: ``maxmemory`` a little above what it uses, ``noeviction``, then junk until it
    refuses a write (OOM), then the limit a little below what it uses: at the limit itself a small
    write may still fit. Returns how many junk keys it took."""
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 2 * MIB)
    for i in range(10_000):
        try:
            raw.set(f"junk:{i}", b"x" * (64 * KIB))
        except redis.exceptions.OutOfMemoryError:
            raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) - 256 * KIB)
            return i
    raise AssertionError("Redis never refused a write")


def test_a_full_redis_never_declares_the_node_dead_its_chunks_hit_and_puts_say_redis_is_full(
    node_factory, redis_factory, namespace
):
    server = _private_redis(redis_factory)
    node = node_factory(redis_url=server.url)
    url = f"kvpool://127.0.0.1:{server.port}/{namespace}"
    chunks = seeded_chunks("full", 16, 16 * KIB)
    with SyncPoolClient(PoolConfig.from_url(url)) as client, redis.Redis(port=server.port) as raw:
        client.put(chunks)
        assert _fill(raw) > 0
        full_until = time.monotonic() + FULL_FOR_S
        while time.monotonic() < full_until:  # the registry's view of the node, every quarter second
            assert [(n.node_id, n.epoch) for n in client.nodes(refresh=True)] == [(node.node_id, node.epoch)]
            time.sleep(0.25)
        assert raw.info("memory")["used_memory"] >= int(raw.config_get("maxmemory")["maxmemory"])  # still full
        assert all_read_back(client, chunks)
        with pytest.raises(MetadataError, match="Redis is full") as refused:
            client.put(seeded_chunks("refused", 1, 16 * KIB))
        assert refused.value.not_stored()  # nothing acknowledged that is not indexed
        assert wait_until(lambda: "Redis is full: used_memory" in node.log, 5.0), node.tail()
        assert "dead" not in node.log and "unreachable" not in node.log, node.tail()

        status = kvpool("status", "--url", url)
        assert status.returncode == 0 and "Redis is full: used_memory" in status.stdout, status.stdout
        assert json.loads(kvpool("status", "--url", url, "--json").stdout)["redis"]["full"] is True

        raw.config_set("maxmemory", 0)  # room again: puts are stored, the node says so
        more = seeded_chunks("room-again", 4, 16 * KIB)
        client.put(more)
        assert all_read_back(client, more)
        assert wait_until(lambda: "Redis answers and takes writes again" in node.log, 5.0), node.tail()


@pytest.mark.parametrize("mode", ["WRITE", "ALL"])
def test_a_redis_pause_as_long_as_the_client_timeout_marks_no_node_down_and_loses_nothing(
    node_factory, redis_factory, namespace, mode
):
    server = _private_redis(redis_factory)
    nodes = [node_factory(redis_url=server.url), node_factory(redis_url=server.url)]
    url = f"kvpool://127.0.0.1:{server.port}/{namespace}"
    acked: list[Chunk] = []
    refused: list[str] = []
    with SyncPoolClient(PoolConfig.from_url(url)) as client, redis.Redis(port=server.port) as raw:
        first = seeded_chunks("before", 8, 64 * KIB)
        client.put(first)
        acked += first
        raw.execute_command("CLIENT", "PAUSE", PAUSE_MS, mode)
        paused_at = time.monotonic()
        batch = 0
        while time.monotonic() - paused_at < PAUSE_MS / 1000 + 0.5:  # puts and gets through the pause
            chunks = seeded_chunks(f"during-{batch}", 4, 64 * KIB, seed=batch)
            batch += 1
            try:
                client.put(chunks)
                acked += chunks
            except MetadataError as exc:  # answered in time: not stored, and the node is not taken for dead
                refused.append(str(exc))
            client.get([c.key for c in acked[-8:]])  # misses while Redis does not answer lookups
        assert client.counters.get("nodes_marked_down", 0) == 0, refused
        assert refused and all("Redis slow" in text for text in refused), refused
        assert all_read_back(client, acked)  # nothing acknowledged is lost; gets after the pause hit
        after = seeded_chunks("after", 4, 64 * KIB)
        client.put(after)
        assert all_read_back(client, after)
    assert any("Redis slow" in node.log for node in nodes)
    assert not any("dead" in node.log or "unreachable" in node.log for node in nodes)


def test_a_delete_on_a_node_during_a_redis_pause_is_answered_in_time(node_factory, redis_factory, namespace):
    """`kvpool evict` deletes on the nodes first: a node's DELETE used to wait out a paused Redis (as long as
    the client's timeout) and be taken for dead. It answers now, and the index forgets the keys after the pause."""
    server = _private_redis(redis_factory)
    node_factory(redis_url=server.url)
    url = f"kvpool://127.0.0.1:{server.port}/{namespace}"
    gone = [c.key for c in seeded_chunks("gone", 4, 16 * KIB)]

    async def main() -> tuple[list[bool], float, int, list[bool]]:
        async with PoolClient(PoolConfig.from_url(url)) as client:
            await client.put(seeded_chunks("gone", 4, 16 * KIB))
            node = (await client.nodes(refresh=True))[0]
            with redis.Redis(port=server.port) as raw:
                raw.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
                started = time.monotonic()
                deleted = await client.node_admin.delete_on(node, gone)
                took_s = time.monotonic() - started
            await asyncio.sleep(PAUSE_MS / 1000)  # Redis's own pause runs out (reads wait meanwhile under ALL)
            # The heartbeat's flush removes the entries once Redis takes writes.
            await until(lambda: client.contains(gone), lambda found: not any(found), 10.0, interval_s=0.1)
            return deleted, took_s, client.counters.get("nodes_marked_down", 0), await client.contains(gone)

    deleted, took_s, marked_down, still_indexed = asyncio.run(main())
    assert deleted == [True] * len(gone)
    assert took_s < 0.75 * PAUSE_MS / 1000, took_s  # answered before the client's timeout (PAUSE_MS)
    assert marked_down == 0
    assert still_indexed == [False] * len(gone)


@pytest.mark.skipif(
    not FULL, reason="runs `kvpool doctor` twice (LMCache's loader): under `make faults` (KVPOOL_FULL=1)"
)
def test_doctor_says_redis_is_full_or_slow_rather_than_unreachable(node_factory, redis_factory, namespace, tmp_path):
    server = _private_redis(redis_factory)
    node_factory(redis_url=server.url)
    config = tmp_path / "lmcache.yaml"
    config.write_text(kvpool("lmcache-config", "--url", f"kvpool://127.0.0.1:{server.port}/{namespace}").stdout)
    with redis.Redis(port=server.port) as raw:
        _fill(raw)
        full = kvpool("doctor", "--lmcache-config", str(config), timeout=180)
        assert full.returncode == 1 and "[FAIL] Redis memory: Redis is full: used_memory" in full.stdout, full.stdout
        assert "raise maxmemory" in full.stdout and "#redis-full" in full.stdout, full.stdout
        raw.config_set("maxmemory", 0)
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)  # a Redis that answers nothing: paused, stopped, cut off
    try:
        slow = kvpool("doctor", "--lmcache-config", str(config), timeout=180)
    finally:
        server.process.send_signal(signal.SIGCONT)
    assert slow.returncode == 1 and "[FAIL] Redis: " in slow.stdout and "Redis slow:" in slow.stdout, slow.stdout
    assert "no answer within" in slow.stdout and "unreachable" not in slow.stdout, slow.stdout
    assert "#redis-paused-or-slow" in slow.stdout, slow.stdout


def test_a_node_whose_redis_user_may_not_run_info_says_the_full_redis_is_over_once_a_put_lands(
    node_factory, redis_factory, namespace, tmp_path
):
    """Hardened ACLs often take INFO away (it is in @dangerous): then the node cannot ask Redis whether it has
    room again, and learns it from the first put whose commit lands (before: /health stayed 'full')."""
    server = _private_redis(redis_factory)
    password = tmp_path / "node-redis-password"
    password.write_text("node-redis-password-0123456789\n")
    password.chmod(0o600)
    with redis.Redis(port=server.port) as raw:
        raw.execute_command("ACL", "SETUSER", "kvnode", "on", ">node-redis-password-0123456789", "~*", "&*")
        raw.execute_command("ACL", "SETUSER", "kvnode", "+@all", "-info")
    node = node_factory(
        "--redis-password-file",
        str(password),
        "--metrics-port",
        "0",
        redis_url=f"redis://kvnode@127.0.0.1:{server.port}/0",
    )
    port = _metrics_port(node)
    url = f"kvpool://127.0.0.1:{server.port}/{namespace}"
    with SyncPoolClient(PoolConfig.from_url(url)) as client, redis.Redis(port=server.port) as raw:
        client.put(seeded_chunks("before", 4, 16 * KIB))
        _fill(raw)
        with pytest.raises(MetadataError, match="Redis is full"):
            client.put(seeded_chunks("refused", 1, 16 * KIB))
        assert wait_until(lambda: _health(port)["redis"] == "full", 5.0)
        raw.config_set("maxmemory", 0)
        # Two beats land (the second begun after Redis had room): without INFO they cannot tell that it has.
        for _ in range(2):
            beat_at = _beat_at(client)
            assert wait_until(lambda beat_at=beat_at: _beat_at(client) > beat_at, 5.0)
        assert _health(port)["redis"] == "full"
        client.put(seeded_chunks("room-again", 2, 16 * KIB))
        assert wait_until(lambda: _health(port)["redis"] == "ok", 5.0), _health(port)
        # The state flips before the line is written, and the node's log reaches the test through a pipe.
        assert wait_until(lambda: "Redis answers and takes writes again" in node.log, 5.0), node.log[-2000:]


def _beat_at(client: SyncPoolClient) -> float:
    """When the pool's one node last beat, by the registry (its wall clock)."""
    [node] = client.nodes(refresh=True)
    return node.heartbeat_at


def _health(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as error:  # 503 while degraded: the body says why
        return dict(json.loads(error.read()))


def test_a_redis_that_cannot_compile_kvpools_scripts_is_named_with_the_version_kvpool_needs(redis_server):
    """Redis 6 knows no script flags: kvpool's claim and heartbeat fail to compile there. The error says which
    Redis kvpool needs (the same compile error, caused on this Redis 7 by a script with a shebang it rejects)."""
    from backend.metadata import MetadataStore

    async def compile_a_flagged_script_redis_rejects() -> None:
        store = MetadataStore(redis_server.url, "ns")
        try:
            async with store.connection.call("node id claim"):
                await store.connection.redis.eval("#!lua flags=no-such-flag\nreturn 1", 0)
        finally:
            await store.close()

    with pytest.raises(MetadataError, match=r"kvpool needs Redis 7\.0 or newer"):
        asyncio.run(compile_a_flagged_script_redis_rejects())
