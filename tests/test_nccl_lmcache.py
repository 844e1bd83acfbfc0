"""Same-cluster hits through LMCache's own RemoteBackend: over the channel when it is on,
over TCP otherwise, byte-identical both ways; a channel that fails mid-transfer falls
back to TCP and still returns the right bytes.

The channel runs on its CPU transport (``channel_transport=cpu``); LMCache builds the
connector from its config exactly as in production.
"""

from __future__ import annotations

import logging

import pytest

from bench.lmcache_stack import LMCacheStack, same_bytes

CLUSTER = "rack-a"


def _store(stack: LMCacheStack, first: int, count: int) -> tuple[list, list]:
    keys = [stack.key(first + i) for i in range(count)]
    objs = [stack.make_object(first + i) for i in range(count)]
    stack.put(keys, objs)
    return keys, objs


def _identical(stack: LMCacheStack, got: list, objs: list) -> bool:
    return all(g is not None and same_bytes(g, o) for g, o in zip(got, objs, strict=True))


def test_same_cluster_hits_travel_over_the_channel_when_it_is_on(node_factory, pool_url, stack_factory):
    node_factory("--cluster", CLUSTER, "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu")
    keys, objs = _store(stack, 100, 6)
    got = stack.get(keys)
    counters = stack.connector().counters
    try:
        assert _identical(stack, got, objs)
        assert counters["get_bytes_channel"] == 6 * stack.chunk_bytes
        assert counters["get_bytes_tcp"] == 0 and counters["channel_fallbacks"] == 0
        assert stack.connector().channel.counters["pairs_created"] == 1
    finally:
        stack.release(objs + got)


def test_the_same_hits_travel_over_tcp_when_the_channel_is_off(node_factory, pool_url, stack_factory):
    node_factory("--cluster", CLUSTER, "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?cluster={CLUSTER}")
    keys, objs = _store(stack, 200, 6)
    got = stack.get(keys)
    counters = stack.connector().counters
    try:
        assert stack.connector().channel is None
        assert _identical(stack, got, objs)
        assert counters["get_bytes_tcp"] == 6 * stack.chunk_bytes and counters["get_bytes_channel"] == 0
    finally:
        stack.release(objs + got)


def test_a_copy_in_another_cluster_is_read_over_tcp_even_with_the_channel_on(node_factory, pool_url, stack_factory):
    node_factory("--cluster", "rack-b", "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu")
    keys, objs = _store(stack, 300, 3)
    got = stack.get(keys)
    counters = stack.connector().counters
    try:
        assert _identical(stack, got, objs)
        assert counters["get_bytes_tcp"] == 3 * stack.chunk_bytes and counters["get_bytes_channel"] == 0
    finally:
        stack.release(objs + got)


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_peer_death_mid_transfer_falls_back_to_tcp_with_correct_bytes(fault, node_factory, pool_url, stack_factory,
                                                                     caplog):  # fmt: skip
    """Node A (same cluster, channel) dies or stalls after the first chunk; node B's replica serves over TCP."""
    caplog.set_level(logging.WARNING)
    near = node_factory("--cluster", CLUSTER, "--channel", "cpu")
    node_factory("--cluster", "rack-b")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}&channel_transport=cpu&replicas=2&timeout_ms=1000")
    keys, objs = _store(stack, 400, 16)  # 32 MiB: far more than the socket buffers hold
    connector = stack.connector()
    connector.channel.transport.progress = lambda index: (near.kill() if fault == "kill" else near.pause()) \
        if index == 0 else None  # fmt: skip
    try:
        got = stack.get(keys)
        try:
            assert _identical(stack, got, objs)
            assert connector.counters["channel_fallbacks"] == 16
            assert connector.counters["get_bytes_tcp"] == 16 * stack.chunk_bytes
            assert connector.counters["get_bytes_channel"] == 0
            assert connector.channel.pair_count() == 0  # the broken pair was aborted and dropped
            assert any("reading over TCP" in r.message for r in caplog.records)
        finally:
            stack.release(got)
    finally:
        near.resume()
        stack.release(objs)


def test_nccl_on_without_a_gpu_logs_one_warning_and_reads_over_tcp(node_factory, pool_url, stack_factory, caplog):
    """The default transport is NCCL; on a machine without GPU or libnccl the connector says why once."""
    caplog.set_level(logging.WARNING)
    node_factory("--cluster", CLUSTER, "--channel", "cpu")
    stack = stack_factory(f"{pool_url}?nccl=on&cluster={CLUSTER}")
    keys, objs = _store(stack, 500, 4)
    got = stack.get(keys)
    again = stack.get(keys)
    try:
        assert _identical(stack, got, objs) and _identical(stack, again, objs)
        connector = stack.connector()
        assert connector.channel is None
        assert connector.counters["get_bytes_tcp"] == 8 * stack.chunk_bytes
        assert connector.counters["get_bytes_channel"] == 0
        warnings = [r.message for r in caplog.records if "nccl=on, but" in r.message]
        assert len(warnings) == 1 and "cannot run here" in warnings[0]
    finally:
        stack.release(objs + got + again)
