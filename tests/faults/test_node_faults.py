"""Node and Redis processes dying or freezing under load, with two copies of every chunk.

Each test checks the same promises: no wrong byte is ever returned, an acknowledged
put stays readable while one of its replicas lives, no call waits past a generous
bound, and the pool serves normally once the fault is over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from backend.embedded import EmbeddedRedis
from backend.metadata import NodeInfo
from backend.placement import choose_nodes
from kvpool import Chunk, KVPoolError, PoolConfig, PutOutcome, SyncPoolClient
from tests.faults.proxy import FULL, ROUNDS
from tests.support.chunks import numbered_chunks as _chunks
from tests.support.waits import wait_until

CALL_BOUND_S = 30.0  # "returned at all": far above the timeouts, far below pytest's timeout
CHUNK_BYTES = 32 * 1024
MAX_PUTS = 1500  # 1500 puts of 4 x 32 KiB fit a 256 MiB node: nothing is evicted during a test


def _bounded(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)`` and fail the test if it did not return within CALL_BOUND_S."""
    start = time.monotonic()
    try:
        return fn(*args)
    finally:
        assert time.monotonic() - start < CALL_BOUND_S, f"{fn} blocked for {time.monotonic() - start:.1f} s"


def _same_or_miss(chunks: list[Chunk], got: list[Any]) -> int:
    """Assert every answer is the chunk's exact bytes or a miss; return the hit count."""
    for chunk, fetched in zip(chunks, got):
        assert fetched is None or bytes(fetched.data) == bytes(chunk.data), f"wrong bytes for {chunk.key}"
    return sum(1 for g in got if g is not None)


class Writer(threading.Thread):
    """Puts fresh chunks in a loop; records which puts were acknowledged and which failed."""

    def __init__(self, client: SyncPoolClient, prefix: str, per_put: int = 4) -> None:
        super().__init__(daemon=True)
        self.client, self.prefix, self.per_put = client, prefix, per_put
        self.acked: list[Chunk] = []
        self.failed: list[Chunk] = []
        self.stored_of_failed: list[Chunk] = []  # chunks a failed put's error reported stored
        self.attempts = 0
        self.stop = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            while not self.stop.is_set() and self.attempts < MAX_PUTS:
                chunks = _chunks(f"{self.prefix}{self.attempts}-", self.per_put, CHUNK_BYTES, seed=self.attempts)
                try:
                    _bounded(self.client.put, chunks)
                    self.acked += chunks
                except KVPoolError as exc:
                    self.failed += chunks
                    # Once anything was sent, the error says what became of each chunk.
                    assert not exc.outcomes or set(exc.outcomes) == {c.key for c in chunks}, exc
                    self.stored_of_failed += [c for c in chunks if exc.outcomes[c.key] is PutOutcome.STORED]
                self.attempts += 1
                time.sleep(0.01)  # bounded memory on the nodes: no eviction muddles the count
        except BaseException as exc:  # an assertion from _bounded: re-raised by finish()
            self.errors.append(exc)

    def finish(self) -> None:
        self.stop.set()
        self.join(CALL_BOUND_S)
        assert not self.is_alive() and not self.errors, self.errors


def _by_id(client: SyncPoolClient, node_id: str) -> NodeInfo:
    return next(n for n in client.nodes() if n.node_id == node_id)


def test_kill_9_mid_put_never_loses_an_acknowledged_chunk_while_its_replica_lives(node_factory, pool_url):
    for round_ in range(ROUNDS):
        _kill_mid_put(node_factory, pool_url.rsplit("/", 1)[0], f"kp{round_}")


def _kill_mid_put(node_factory: Any, redis_part: str, ns: str) -> None:
    # A fresh pool per round: the last round's dead nodes play no part.
    victim, survivor = node_factory(ns=ns), node_factory(ns=ns)
    with SyncPoolClient(
        PoolConfig.from_url(f"{redis_part}/{ns}?replicas=2&connect_timeout_s=1&progress_timeout_s=1")
    ) as client:
        survivor_info = _by_id(client, survivor.node_id)
        writer = Writer(client, f"{ns}-")
        writer.start()
        assert wait_until(lambda: len(writer.acked) >= 8, 20.0)
        victim.kill()  # SIGKILL while puts are in flight
        killed_at = writer.attempts
        # Until the registry drops the victim its puts fail; after that they land on the survivor.
        assert wait_until(lambda: any(_put_index(c) > killed_at + 1 for c in writer.acked), 20.0)
        writer.finish()
        assert writer.acked
        for start in range(0, len(writer.acked), 64):
            part = writer.acked[start : start + 64]
            from_survivor = client._call(client._client.fetch_from(survivor_info, [(c.key, len(c.data)) for c in part]))
            assert _same_or_miss(part, from_survivor) == len(part)  # every acknowledged put survived
        assert writer.failed  # the puts in flight at the kill, and those until the registry dropped the victim
        _same_or_miss(writer.failed, client.get([c.key for c in writer.failed]))  # exact bytes or misses
        reported = writer.stored_of_failed  # what a failed put reported stored is there too
        assert _same_or_miss(reported, client.get([c.key for c in reported])) == len(reported)


def _put_index(chunk: Chunk) -> int:
    return int(chunk.key.split("-")[1])


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shared-memory"])
def test_kill_9_mid_get_fails_over_to_the_replica_and_never_returns_wrong_bytes(node_factory, pool_url, shm):
    # shared-memory: the client copies out of the nodes' arenas, which outlive a killed node
    victim = node_factory("--cluster", "near", shm=shm)  # the client's own cluster: every read tries it first
    node_factory(shm=shm)
    with SyncPoolClient(
        PoolConfig.from_url(pool_url + "?replicas=2&connect_timeout_s=1&progress_timeout_s=1&cluster=near")
    ) as client:
        chunks = _chunks("kg", 32, 256 * 1024)
        client.put(chunks)
        keys = [c.key for c in chunks]
        rounds: list[int] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def read() -> None:
            try:
                while not stop.is_set():
                    rounds.append(_same_or_miss(chunks, _bounded(client.get, keys)))
            except BaseException as exc:
                errors.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert wait_until(lambda: len(rounds) >= 3, 20.0)
        victim.kill()
        after = len(rounds)
        assert wait_until(lambda: len(rounds) >= after + (20 if FULL else 5) or bool(errors), 30.0)
        stop.set()
        reader.join(CALL_BOUND_S)
        assert not errors, errors
        assert all(hits == len(keys) for hits in rounds)  # the replica answered every key
        assert client.counters.get("get_failovers", 0) >= 1
        assert (client.counters.get("shm_get_bytes", 0) > 0) == shm  # the path under test was taken


def test_a_frozen_node_is_read_around_within_the_timeout_and_serves_again_after_sigcont(node_factory, pool_url):
    slow = node_factory("--cluster", "near")  # the client's own cluster: reads try it first
    node_factory()
    with SyncPoolClient(
        PoolConfig.from_url(pool_url + "?replicas=2&connect_timeout_s=0.5&progress_timeout_s=0.5&cluster=near")
    ) as client:
        chunks = _chunks("sl", 16, 128 * 1024)
        client.put(chunks)
        keys = [c.key for c in chunks]
        slow_info = _by_id(client, slow.node_id)
        slow.pause()  # SIGSTOP: connections open, nothing answers
        try:
            for _ in range(3 * ROUNDS):
                assert _same_or_miss(chunks, _bounded(client.get, keys)) == len(keys)
            # The first read timed out on the frozen node; later reads ask its replica first.
            assert client.counters["get_failovers"] == len(keys)
        finally:
            slow.resume()
        wanted = [(c.key, len(c.data)) for c in chunks]

        def serves_again() -> bool:
            try:
                got = client._call(client._client.fetch_from(slow_info, wanted))
            except KVPoolError:
                return False
            return _same_or_miss(chunks, got) == len(chunks)

        assert wait_until(serves_again, 20.0, 0.2)


def test_redis_killed_mid_commit_loses_no_acknowledged_put_and_the_pool_recovers(node_factory, redis_factory):
    redis = EmbeddedRedis().start()
    redis_factory.append(redis)
    node_factory(redis_url=redis.url, ns="rk")
    node_factory(redis_url=redis.url, ns="rk")
    config = PoolConfig.from_url(
        f"kvpool://127.0.0.1:{redis.port}/rk?replicas=2&connect_timeout_s=1&progress_timeout_s=1"
    )
    with SyncPoolClient(config) as client:
        writer = Writer(client, "rk-")
        writer.start()
        assert wait_until(lambda: len(writer.acked) >= 8, 20.0)
        redis.kill()  # SIGKILL while nodes commit index entries
        failed_before = len(writer.failed)
        assert wait_until(lambda: len(writer.failed) > failed_before, 20.0)  # puts now fail, bounded
        # A lookup while Redis is down is a miss (never an exception, never a hang)
        assert _bounded(client.get, [writer.acked[0].key]) == [None]
        assert _bounded(client.hit_prefix, [writer.acked[0].key]) == 0
        restarted = EmbeddedRedis(redis.port)
        redis_factory.append(restarted)
        restarted.start()  # empty: the nodes republish what they hold
        acked_before = len(writer.acked)
        assert wait_until(lambda: len(writer.acked) > acked_before, 30.0)  # puts succeed again
        writer.finish()
        keys = [c.key for c in writer.acked]
        assert wait_until(lambda: client.hit_prefix(keys) == len(keys), 30.0, 0.2)
        assert _same_or_miss(writer.acked, client.get(keys)) == len(keys)
        # A put that failed while Redis was down left no copy (the nodes drop what they cannot
        # index), except the puts whose first copy committed just before the kill or just after
        # the restart while the other did not: at most one put's chunks at each end.
        assert _same_or_miss(writer.failed, client.get([c.key for c in writer.failed])) <= 2 * writer.per_put
        reported = writer.stored_of_failed
        assert _same_or_miss(reported, client.get([c.key for c in reported])) == len(reported)


def test_replicas_go_to_distinct_hosts_when_the_registry_knows_them():
    def node(node_id: str, hostname: str) -> NodeInfo:
        return NodeInfo(
            node_id=node_id, host="10.0.0.1", port=1, epoch=1, hostname=hostname, capacity_bytes=1 << 30, alive=True
        )

    nodes = [node("a1", "host-a"), node("a2", "host-a"), node("a3", "host-a"), node("b1", "host-b")]
    for i in range(200):
        chosen = choose_nodes(f"key-{i}", nodes, 2)
        assert {n.hostname for n in chosen} == {"host-a", "host-b"}  # never both copies on host-a
    three = choose_nodes("key", nodes, 3)
    assert len({n.node_id for n in three}) == 3  # more copies than hosts: still distinct nodes
