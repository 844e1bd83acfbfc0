"""Silent failures: a link to a node or to Redis that stays open and moves nothing (no RST, no FIN).

Only a timeout tells such a link from a slow one. Each test cuts one link with a
:class:`Blackhole` between real processes on loopback and checks what the issue of a
pool across hosts asks: the first call pays at most ``progress_timeout_s`` of silence (plus one
fallback), later calls nothing (the node, or Redis, is marked down and probed, not
waited on), never a wrong byte, and full service soon after the heal.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from backend.embedded import free_port
from backend.lmcache.stack import LMCacheStack
from kvpool import KVPoolError, PoolConfig, SyncPoolClient
from tests.conftest import NodeProcess
from tests.faults.blackhole import Blackhole
from tests.faults.test_network_faults import _identical, _no_wrong_bytes, _node
from tests.support.chunks import numbered_chunks as _chunks
from tests.support.waits import run_with_timeout, wait_until

MIB = 1024 * 1024
TIMEOUT_S = 0.5  # connect_timeout_s and progress_timeout_s
SLACK_S = 1.0  # the bound: the timeout + 1 s past a normal read
LATER_CALL_S = 0.010  # a call after the first, while the link is still cut
HEAL_S = 10.0  # full service this soon after the heal


@pytest.fixture
def holes() -> Iterator[Callable[[int], Blackhole]]:
    made: list[Blackhole] = []

    def make(upstream_port: int) -> Blackhole:
        made.append(Blackhole(upstream_port))
        return made[-1]

    yield make
    for hole in made:
        hole.close()


def _behind(
    node_factory: Any, holes: Callable[[int], Blackhole], *extra: str, **kw: Any
) -> tuple[NodeProcess, Blackhole]:
    """A node every client reaches only through a fresh Blackhole."""
    port = free_port()
    hole = holes(port)
    return node_factory("--port", str(port), "--advertise", f"127.0.0.1:{hole.port}", *extra, **kw), hole


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


def test_a_batch_get_cut_mid_transfer_returns_from_the_replica_within_the_timeout(node_factory, holes, pool_url):
    """8 x 16 MiB over one connection: the link goes silent 20 MiB into the answer. The get is given
    up after progress_timeout_s of silence (not that plus 20 ms per MiB asked for: 3 s here) and reads
    the replica; the cut node is read again after the heal."""
    behind, hole = _behind(node_factory, holes, "--cluster", "near", dram="256MiB")
    node_factory(dram="256MiB")
    url = f"{pool_url}?replicas=2&connect_timeout_s={TIMEOUT_S}&progress_timeout_s={TIMEOUT_S}&cluster=near&connections_per_node=1"
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        chunks = _chunks("cut", 8, 16 * MIB, seed=3)
        keys = [c.key for c in chunks]
        client.put(chunks)
        got, normal_s = _timed(client.get, keys)
        assert _identical(chunks, got)

        hole.blackhole(after_bytes=20 * MIB)
        got, cut_s = _timed(client.get, keys)
        assert _identical(chunks, got)  # every chunk, from the replica
        assert cut_s < normal_s + TIMEOUT_S + SLACK_S, (cut_s, normal_s)
        assert client.counters["nodes_marked_down"] == 1
        got, later_s = _timed(client.get, keys)  # the cut node is not waited on again
        assert _identical(chunks, got) and later_s < normal_s + SLACK_S / 2, (later_s, normal_s)

        hole.heal()
        info = next(n for n in client.nodes() if n.node_id == behind.node_id)
        assert wait_until(lambda: client.counters.get("nodes_restored", 0) == 1, HEAL_S)
        fetched = client._call(client._client.fetch_from(info, [(c.key, len(c.data)) for c in chunks]))
        assert _identical(chunks, fetched)  # the cut node's own copies, read again


def test_a_silent_node_costs_one_timeout_then_misses_at_once_and_takes_no_puts_until_it_answers(
    node_factory, holes, pool_url
):
    behind, hole = _behind(node_factory, holes)
    url = f"{pool_url}?replicas=1&connect_timeout_s={TIMEOUT_S}&progress_timeout_s={TIMEOUT_S}"
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        chunks = _chunks("only", 8, 4 * MIB, seed=4)
        keys = [c.key for c in chunks]
        client.put(chunks)  # on the one node there is
        other = node_factory()
        assert wait_until(lambda: len(client.nodes(refresh=True)) == 2)
        got, normal_s = _timed(client.get, keys)
        assert _identical(chunks, got)

        hole.blackhole()
        got, cut_s = _timed(client.get, keys)
        assert got == [None] * 8
        assert cut_s < normal_s + TIMEOUT_S + SLACK_S, (cut_s, normal_s)
        later = [_timed(client.get, keys) for _ in range(5)]
        assert all(g == [None] * 8 for g, _ in later)
        times = [t for _, t in later]
        assert statistics.median(times) < LATER_CALL_S and max(times) < 5 * LATER_CALL_S, times
        assert client.contains(keys) == [False] * 8  # a lookup does not count a down node's copies

        more = _chunks("more", 8, 64 * 1024, seed=5)
        _, put_s = _timed(client.put, more)  # every chunk goes to the node that answers
        assert put_s < TIMEOUT_S, put_s
        assert _identical(more, client.get([c.key for c in more]))
        assert client.counters.get("nodes_marked_down") == 1

        hole.heal()
        assert wait_until(lambda: _identical(chunks, client.get(keys)), HEAL_S, 0.1)
        client.put(_chunks("after", 16, 1000, seed=6))  # both nodes take puts again
        counts = [client.node_stats(_node(client, n.node_id))["objects"] for n in (behind, other)]
        assert counts[0] > 8 and counts[1] > 8, counts


def _right_or_miss(stack: LMCacheStack, got: list[Any], seeds: list[int]) -> int:
    for seed, obj in zip(seeds, got):
        if obj is not None:
            assert stack.expected_tensor(seed).equal(obj.tensor), f"wrong bytes for chunk {seed}"
    stack.release(got)
    return sum(1 for obj in got if obj is not None)


def _read_each(stack: LMCacheStack, keys: list[Any], seeds: list[int]) -> tuple[int, list[float]]:
    """The reader of the issue: per key, LMCache's lookup then its get. Hits, and each key's seconds."""
    hits, times = 0, []
    for key, seed in zip(keys, seeds):
        start = time.monotonic()
        stack.contains_prefix([key])
        hits += _right_or_miss(stack, stack.get([key]), [seed])
        times.append(time.monotonic() - start)
    return hits, times


def test_an_lmcache_reader_cut_from_redis_and_the_node_returns_8_misses_within_one_timeout(
    node_factory, holes, redis_server, namespace, stack_factory
):
    """The issue's reader: cut off from the host of Redis and the node, its 8 lookups and 8 gets
    took 16 x the timeout. Now the first call pays one timeout, the rest none, and after the heal
    it hits again."""
    _, node_hole = _behind(node_factory, holes)
    redis_hole = holes(redis_server.port)
    url = (
        f"kvpool://127.0.0.1:{redis_hole.port}/{namespace}?connect_timeout_s={TIMEOUT_S}&progress_timeout_s={TIMEOUT_S}"
    )
    stack = stack_factory(url)
    seeds = list(range(8))
    keys = [stack.key(700 + s) for s in seeds]
    objs = [stack.make_object(s) for s in seeds]
    stack.put(keys, objs)
    stack.release(objs)
    hits, times = _read_each(stack, keys, seeds)
    assert hits == 8
    normal_s = sum(times)

    node_hole.blackhole()
    redis_hole.blackhole()
    (hits, times) = run_with_timeout(lambda: _read_each(stack, keys, seeds), 60)
    assert hits == 0
    assert sum(times) < normal_s + TIMEOUT_S + SLACK_S, times
    hits, later = _read_each(stack, keys, seeds)
    assert hits == 0 and statistics.median(later) < LATER_CALL_S and max(later) < 5 * LATER_CALL_S, later

    node_hole.heal()
    redis_hole.heal()
    assert wait_until(lambda: _read_each(stack, keys, seeds)[0] == 8, HEAL_S, 0.1)


def test_a_silent_redis_reads_as_fast_misses_puts_never_half_commit_and_the_client_recovers(
    node_factory, holes, redis_server, namespace
):
    node_factory()
    node_factory()
    hole = holes(redis_server.port)
    url = f"kvpool://127.0.0.1:{hole.port}/{namespace}?replicas=1&connect_timeout_s={TIMEOUT_S}&progress_timeout_s={TIMEOUT_S}"
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        chunks = _chunks("held", 8, 256 * 1024, seed=7)
        keys = [c.key for c in chunks]
        client.put(chunks)
        assert _identical(chunks, client.get(keys))

        hole.blackhole()
        got, first_s = _timed(client.get, keys)
        assert got == [None] * 8 and first_s < TIMEOUT_S + SLACK_S, first_s
        later = [_timed(client.contains, keys) for _ in range(5)] + [_timed(client.get, keys) for _ in range(5)]
        assert all(not any(found) for found, _ in later)
        times = [t for _, t in later]
        assert statistics.median(times) < LATER_CALL_S and max(times) < 5 * LATER_CALL_S, times

        # A put while the client cannot reach Redis: the nodes commit it, or it is refused; never half.
        more = _chunks("during", 8, 256 * 1024, seed=8)
        try:
            client.put(more)
            stored = True
        except KVPoolError:
            stored = False
        start = time.monotonic()
        with pytest.raises(KVPoolError):
            client.delete(keys[:1])  # a write of the index itself: refused at once
        assert time.monotonic() - start < LATER_CALL_S

        hole.heal()
        assert wait_until(lambda: _identical(chunks, client.get(keys)), HEAL_S, 0.1)
        got = client.get([c.key for c in more])
        _no_wrong_bytes(more, got)  # an index entry never points at bytes that are not there
        if stored:
            assert _identical(more, got)


def test_a_node_cut_from_redis_keeps_serving_takes_no_new_puts_once_its_heartbeat_lapses_and_loses_nothing(
    node_factory, holes, redis_server, pool_url
):
    hole = holes(redis_server.port)
    cut = node_factory(redis_url=f"redis://127.0.0.1:{hole.port}")
    node_factory()
    url = f"{pool_url}?replicas=1&connect_timeout_s={TIMEOUT_S}&progress_timeout_s={TIMEOUT_S}"
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        chunks = _chunks("kept", 32, 64 * 1024, seed=9)
        keys = [c.key for c in chunks]
        client.put(chunks)
        info = _node(client, cut.node_id)
        held = [c for c in chunks if client._call(client._client.fetch_from(info, [(c.key, len(c.data))]))[0]]
        assert held  # some chunks landed on the node that will be cut

        hole.blackhole()
        # Its heartbeat lapses (5 s TTL): clients stop routing puts to it.
        assert wait_until(lambda: cut.node_id not in {n.node_id for n in client.nodes(refresh=True)}, 10.0, 0.2)
        fetched, fetch_s = _timed(client._call, client._client.fetch_from(info, [(c.key, len(c.data)) for c in held]))
        assert _identical(held, fetched)  # reads need no Redis: it serves what it holds
        assert fetch_s < 1.0, fetch_s
        new = _chunks("new", 16, 64 * 1024, seed=10)
        client.put(new)  # all on the node whose heartbeat Redis sees
        absent = client._call(client._client.fetch_from(info, [(c.key, len(c.data)) for c in new]))
        assert absent == [None] * len(new)

        hole.heal()
        # It republishes: every chunk it held is found again, none lost.
        found = wait_until(lambda: _identical(chunks, client.get(keys)), HEAL_S, 0.2)
        assert found, "\n".join(cut.output[-30:])
        assert _identical(new, client.get([c.key for c in new]))
