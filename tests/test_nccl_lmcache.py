"""Same-cluster hits through LMCache's own RemoteBackend: over the channel when it is on,
over TCP otherwise, byte-identical both ways; a channel that fails in any way falls
back to TCP and still returns the right bytes.

The channel runs on its CPU transport (``channel_transport=cpu``); LMCache builds the
connector from its config exactly as in production. The first read of a node goes over
TCP while its pair is made in the background; :func:`_paired` waits for that pair.
"""

from __future__ import annotations

import asyncio
import logging
import os
import textwrap
import threading
import time
from pathlib import Path

import pytest

import nccl_channel
from backend.lmcache.stack import LMCacheStack
from tests.support.lmcache import same_bytes
from tests.support.waits import wait_until

CLUSTER = "rack-a"
PAIR_WAIT_S = 20.0


def _store(stack: LMCacheStack, first: int, count: int) -> tuple[list, list]:
    keys = [stack.key(first + i) for i in range(count)]
    objs = [stack.make_object(first + i) for i in range(count)]
    stack.put(keys, objs)
    return keys, objs


def _identical(stack: LMCacheStack, got: list, objs: list) -> bool:
    return all(g is not None and same_bytes(g, o) for g, o in zip(got, objs, strict=True))


def _paired(stack: LMCacheStack, keys: list, objs: list) -> None:
    """Read once (over TCP, which starts the pairing) and wait for the pair; the bytes must be right meanwhile."""
    got = stack.get(keys)
    try:
        assert _identical(stack, got, objs)
    finally:
        stack.release(got)
    assert wait_until(lambda: stack.connector().channel.pair_count() == 1, PAIR_WAIT_S)


def test_same_cluster_hits_travel_over_the_channel_when_it_is_on(node_factory, pool_url, stack_factory):
    node_factory("--cluster", CLUSTER, "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu")
    keys, objs = _store(stack, 100, 6)
    _paired(stack, keys, objs)
    tcp_before = stack.connector().counters["get_bytes_tcp"]
    got = stack.get(keys)
    try:
        assert _identical(stack, got, objs)
        counters = stack.connector().counters  # a snapshot: read after the get
        assert counters["get_bytes_channel"] == 6 * stack.chunk_bytes
        assert counters["get_bytes_tcp"] == tcp_before and counters["channel_fallbacks"] == 0
        assert stack.connector().channel.counters["pairs_created"] == 1
    finally:
        stack.release(objs + got)


def _read_over_tcp_only(stack: LMCacheStack, first: int, count: int) -> None:
    """Store ``count`` chunks and read them once: byte-identical, and every byte over TCP."""
    keys, objs = _store(stack, first, count)
    got = stack.get(keys)
    try:
        assert _identical(stack, got, objs)
        counters = stack.connector().counters
        assert counters["get_bytes_tcp"] == count * stack.chunk_bytes and counters["get_bytes_channel"] == 0
    finally:
        stack.release(objs + got)


def test_the_first_read_of_a_node_goes_over_tcp_while_its_pair_is_made(node_factory, pool_url, stack_factory):
    """No get waits for a pairing (a cold NCCL init takes seconds): TCP serves it, the pair comes after."""
    node_factory("--cluster", CLUSTER, "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu")
    _read_over_tcp_only(stack, 150, 4)
    assert stack.connector().counters["channel_fallbacks"] == 0  # not a failure: the pair was not there yet
    assert wait_until(lambda: stack.connector().channel.pair_count() == 1, PAIR_WAIT_S)


def test_the_same_hits_travel_over_tcp_when_the_channel_is_off(node_factory, pool_url, stack_factory):
    node_factory("--cluster", CLUSTER, "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?cluster={CLUSTER}")
    _read_over_tcp_only(stack, 200, 6)
    assert stack.connector().channel is None


def test_a_copy_in_another_cluster_is_read_over_tcp_even_with_the_channel_on(node_factory, pool_url, stack_factory):
    node_factory("--cluster", "rack-b", "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu")
    _read_over_tcp_only(stack, 300, 3)
    assert stack.connector().channel.pair_count() == 0  # nothing to pair with


def _assert_all_fell_back_to_tcp(stack: LMCacheStack, got: list, objs: list, tcp_before: int) -> None:
    """Every chunk read is right, and every one came over TCP because the channel failed to bring it."""
    assert _identical(stack, got, objs)
    counters = stack.connector().counters
    assert counters["channel_fallbacks"] == len(objs)
    assert counters["get_bytes_tcp"] - tcp_before == len(objs) * stack.chunk_bytes
    assert counters["get_bytes_channel"] == 0


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_peer_death_mid_transfer_falls_back_to_tcp_with_correct_bytes(
    fault, node_factory, pool_url, stack_factory, caplog
):
    """Node A (same cluster, channel) dies or stalls after the first chunk; node B's replica serves over TCP."""
    caplog.set_level(logging.WARNING)
    near = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    node_factory("--cluster", "rack-b")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu&replicas=2&progress_timeout_s=1")
    keys, objs = _store(stack, 400, 16)  # 32 MiB: far more than the socket buffers hold
    connector = stack.connector()
    armed = threading.Event()  # a link takes its transport's progress hook when it is made: set it first
    connector.channel.transport.progress = lambda index: (
        (near.kill() if fault == "kill" else near.pause()) if index == 0 and armed.is_set() else None
    )
    _paired(stack, keys[:1], objs[:1])
    tcp_before = connector.counters["get_bytes_tcp"]
    armed.set()
    try:
        got = stack.get(keys)
        try:
            _assert_all_fell_back_to_tcp(stack, got, objs, tcp_before)
            assert connector.channel.pair_count() == 0  # the broken pair was aborted and dropped
            assert any("reading over TCP" in r.message for r in caplog.records)
        finally:
            stack.release(got)
    finally:
        near.resume()
        stack.release(objs)


def test_any_exception_in_the_channel_path_falls_back_to_tcp(
    node_factory, pool_url, stack_factory, monkeypatch, caplog
):
    """A CUDA error in the device copy is a RuntimeError, not a KVPoolError: it must cost a fallback, not the read.

    No CPU can make CUDA fail, so the check of a landed chunk is replaced by one that raises what
    PyTorch raises for a faulted device.
    """
    import nccl_channel.pipeline as pipeline_module

    caplog.set_level(logging.WARNING)
    node_factory("--cluster", CLUSTER, "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu")
    keys, objs = _store(stack, 450, 5)
    _paired(stack, keys, objs)
    connector = stack.connector()
    tcp_before = connector.counters["get_bytes_tcp"]

    def faulted_check(view, expected):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(pipeline_module, "_verify_chunk", faulted_check)
    got = stack.get(keys)
    try:
        _assert_all_fell_back_to_tcp(stack, got, objs, tcp_before)
        assert connector.counters["miss_get"] == 0  # LMCache never saw the error
        assert any("CUDA error" in r.getMessage() for r in caplog.records)
    finally:
        stack.release(objs + got)


SLOW_JOIN = textwrap.dedent("""
    import os, time
    import nccl_channel.channel as channel

    _join = channel.CpuTransport.join

    def slow_join(self, unique_id, rank, state, timeout_s):
        time.sleep(float(os.environ["KVPOOL_TEST_JOIN_DELAY_S"]))  # a cold NCCL init
        return _join(self, unique_id, rank, state, timeout_s)

    channel.CpuTransport.join = slow_join
""")


def _on_loop(stack: LMCacheStack, coro):
    """Run a coroutine of the connector's client on LMCache's loop, where that client lives."""
    return asyncio.run_coroutine_threadsafe(coro, stack.loop).result(30)


def _slow_join_env(directory: Path, delay_s: float) -> dict[str, str]:
    """A child Python whose CPU channel takes ``delay_s`` to join a pair, as a cold NCCL init can."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SLOW_JOIN)
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "KVPOOL_TEST_JOIN_DELAY_S": str(delay_s)}


def test_a_pairing_slower_than_the_request_timeout_engages_without_closing_the_shared_connection(
    node_factory, pool_url, stack_factory, tmp_path
):
    """The node's side of a pairing takes 3 s, three times progress_timeout_s: the pairing has its own deadline
    (30 s by default), the node answers the pairing request at once, and reads keep using the same
    TCP connections meanwhile."""
    node = node_factory("--cluster", CLUSTER, "--channel", "cpu", env=_slow_join_env(tmp_path / "slow", 3.0))
    stack = stack_factory(
        f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu&progress_timeout_s=1&connections_per_node=1"
    )
    keys, objs = _store(stack, 500, 4)
    connector = stack.connector()
    deadline = time.monotonic() + PAIR_WAIT_S
    while connector.channel.pair_count() == 0 and time.monotonic() < deadline:  # TCP serves every read meanwhile
        got = stack.get(keys)
        try:
            assert _identical(stack, got, objs)
        finally:
            stack.release(got)
    assert connector.channel.pair_count() == 1 and connector.channel.counters["pair_failures"] == 0
    before = connector.counters["get_bytes_channel"]  # the loop's last read may have used the pair it just saw
    got = stack.get(keys)
    try:
        assert _identical(stack, got, objs)
        assert connector.counters["get_bytes_channel"] - before == 4 * stack.chunk_bytes
    finally:
        stack.release(objs + got)
    client = connector.client
    info = next(n for n in _on_loop(stack, client.nodes()) if n.node_id == node.node_id)
    stats = _on_loop(stack, client.node_stats(info))
    assert stats["counters"]["connections_accepted"] == 1  # the one connection was never closed and remade


def test_nccl_on_reads_over_tcp_from_a_node_that_serves_only_the_cpu_twin(
    node_factory, pool_url, stack_factory, caplog
):
    """The default transport is NCCL. Without a GPU or libnccl the connector says why, once, and has no
    channel; with them it has one, but a node serving the CPU twin is not reachable over it. TCP either way."""
    caplog.set_level(logging.WARNING)
    node_factory("--cluster", CLUSTER, "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}")
    keys, objs = _store(stack, 600, 4)
    got = stack.get(keys)
    again = stack.get(keys)
    try:
        assert _identical(stack, got, objs) and _identical(stack, again, objs)
        connector = stack.connector()
        assert connector.counters["get_bytes_tcp"] == 8 * stack.chunk_bytes
        assert connector.counters["get_bytes_channel"] == 0
        warnings = [r.message for r in caplog.records if "nccl=on, but" in r.message]
        if nccl_channel.available():
            assert connector.channel is not None and connector.channel.kind == "nccl" and not warnings
            assert connector.channel.pair_count() == 0
        else:
            assert connector.channel is None
            assert len(warnings) == 1 and "cannot run here" in warnings[0]
    finally:
        stack.release(objs + got + again)
