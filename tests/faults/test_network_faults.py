"""A network path that stalls, truncates or resets, between real clients and a real node.

The node advertises a :class:`FaultProxy` (``--advertise HOST:PORT``), so every client
reaches it through the proxy; its replica is reached directly.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from backend.embedded import free_port
from backend.metadata import NodeInfo
from kvpool import Chunk, KVPoolError, PoolConfig, SyncPoolClient
from tests.conftest import REPO, NodeProcess
from tests.faults.proxy import ROUNDS, FaultProxy, hostname_env
from tests.support.chunks import numbered_chunks as _chunks
from tests.support.waits import wait_until

CALL_BOUND_S = 30.0  # "returned at all": far above the timeouts, far below pytest's timeout


@pytest.fixture
def proxied(node_factory) -> Iterator[Any]:
    """Start a node that clients reach only through a fresh FaultProxy."""
    proxies: list[FaultProxy] = []

    def start(*extra: str) -> tuple[NodeProcess, FaultProxy]:
        port = free_port()
        proxy = FaultProxy(port)
        proxies.append(proxy)
        node = node_factory("--port", str(port), "--advertise", f"127.0.0.1:{proxy.port}", *extra)
        return node, proxy

    yield start
    for proxy in proxies:
        proxy.close()


def _bounded(fn: Any, *args: Any) -> Any:
    """Call ``fn(*args)`` and fail the test if it did not return within CALL_BOUND_S."""
    start = time.monotonic()
    try:
        return fn(*args)
    finally:
        assert time.monotonic() - start < CALL_BOUND_S, f"blocked for {time.monotonic() - start:.1f} s"


def _fetch_from(client: SyncPoolClient, node: NodeInfo, chunks: list[Chunk]) -> list[Any]:
    return client._call(client._client.fetch_from(node, [(c.key, len(c.data)) for c in chunks]))


def _node(client: SyncPoolClient, node_id: str) -> NodeInfo:
    return next(n for n in client.nodes() if n.node_id == node_id)


def _identical(chunks: list[Chunk], got: list[Any]) -> bool:
    return all(g is not None and bytes(g.data) == bytes(c.data) for c, g in zip(chunks, got))


def _no_wrong_bytes(chunks: list[Chunk], got: list[Any]) -> None:
    for chunk, fetched in zip(chunks, got):
        assert fetched is None or bytes(fetched.data) == bytes(chunk.data), f"wrong bytes for {chunk.key}"


def test_a_node_advertised_behind_a_forwarder_is_reached_through_it(proxied, pool_url):
    node, proxy = proxied()
    assert node.port == proxy.port  # the ready line shows the advertised address
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        info = _node(client, node.node_id)
        assert (info.host, info.port) == ("127.0.0.1", proxy.port)
        chunks = _chunks("adv", 4, 100_000)
        client.put(chunks)
        assert _identical(chunks, client.get([c.key for c in chunks]))
    assert proxy.counters["accepted"] >= 1


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", ("", 0)),
        ("node1", ("node1", 0)),
        ("node1:7000", ("node1", 7000)),
        (":7000", ("", 7000)),
        ("[fd00::1]:7000", ("fd00::1", 7000)),
        ("[fd00::1]", ("fd00::1", 0)),
        ("fd00::1", ("fd00::1", 0)),
    ],
)
def test_advertise_takes_a_host_a_port_or_both(value, expected):
    from backend.config import parse_advertise

    assert parse_advertise("--advertise", value) == expected


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("value", ["host:0", "host:99999", "host:port", "[::1", "[::1]x"])
def test_a_bad_advertise_address_is_refused_naming_the_flag(redis_server, value):
    proc = subprocess.run(
        [sys.executable, "-m", "backend.cli", "node", "--redis", redis_server.url, "--advertise", value],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "--advertise" in proc.stderr, proc.stderr


@pytest.mark.parametrize("fault", ["stall", "truncate", "reset"])
def test_a_faulty_path_to_one_replica_costs_a_bounded_wait_never_wrong_bytes(proxied, node_factory, pool_url, fault):
    behind, proxy = proxied("--cluster", "near")  # the client's cluster: reads try it first
    node_factory()
    url = pool_url + "?replicas=2&connect_timeout_s=0.5&progress_timeout_s=0.5&cluster=near"
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        for round_ in range(ROUNDS):
            _fault_round(client, behind.node_id, proxy, fault, f"{fault}{round_}")


def _fault_round(client: SyncPoolClient, node_id: str, proxy: FaultProxy, fault: str, prefix: str) -> None:
    chunks = _chunks(prefix, 8, 512 * 1024, seed=len(prefix))
    keys = [c.key for c in chunks]
    client.put(chunks)
    info = _node(client, node_id)
    assert _identical(chunks, _fetch_from(client, info, chunks))  # the proxied copy is there
    proxy.set(fault, limit_bytes=200_000)  # truncate: cut each connection 200 kB on
    # Reads of that one copy: an error or a miss, within the timeout.
    with pytest.raises(KVPoolError):
        _no_wrong_bytes(chunks, _bounded(_fetch_from, client, info, chunks))
    # Reads of the key: the replica answers (the faulty copy failed over, or skipped: its node is marked down).
    failovers = client.counters.get("get_failovers", 0)
    assert _identical(chunks, _bounded(client.get, keys))
    down = client._client.health.is_down(info.node_id, info.epoch)
    assert client.counters.get("get_failovers", 0) > failovers or down
    # Writes needing both copies: refused, never acknowledged with one.
    more = _chunks(prefix + "w", 2, 512 * 1024, seed=99)
    with pytest.raises(KVPoolError, match="not stored"):
        _bounded(client.put, more)
    _no_wrong_bytes(more, client.get([c.key for c in more]))
    proxy.set("pass")
    # The connection pool recovers: the same copy is read through fresh connections.
    assert wait_until(lambda: _fetch_ok(client, info, chunks), 20.0, 0.2)
    client.put(more)
    assert _identical(more, _fetch_from(client, info, more))


def _fetch_ok(client: SyncPoolClient, info: NodeInfo, chunks: list[Chunk]) -> bool:
    try:
        got = _fetch_from(client, info, chunks)
    except KVPoolError:
        return False
    _no_wrong_bytes(chunks, got)
    return _identical(chunks, got)


def test_a_copy_that_fails_is_retried_on_another_host_while_there_is_one(
    node_factory, pool_url, redis_server, namespace, tmp_path
):
    """Hosts a (two nodes) and b (two nodes, one unreachable: its proxy resets every connection).
    With replicas=2, every key whose first choice on host b fails gets its second copy on the other
    node of host b, never a second copy on host a."""

    def on(host: str, *extra: str) -> NodeProcess:
        return node_factory(*extra, dram="64MiB", env=hostname_env(tmp_path / host, host))

    a1, a2, b2 = on("host-a"), on("host-a"), on("host-b")
    port = free_port()
    with FaultProxy(port) as proxy:
        b1 = on("host-b", "--port", str(port), "--advertise", f"127.0.0.1:{proxy.port}")
        proxy.set("reset")
        host_of = {a1.node_id: "host-a", a2.node_id: "host-a", b1.node_id: "host-b", b2.node_id: "host-b"}
        with SyncPoolClient(
            PoolConfig.from_url(f"{pool_url}?replicas=2&connect_timeout_s=1&progress_timeout_s=1")
        ) as client:
            assert {n.hostname for n in client.nodes(refresh=True)} == {"host-a", "host-b"}
            chunks = _chunks("hosts", 64, 1000)
            client.put(chunks)
        assert proxy.counters["reset"] > 0  # b1 was chosen first for some keys, and failed
    holders = _holders(redis_server.url, namespace, [c.key for c in chunks])
    for key, nodes in holders.items():
        assert b1.node_id not in nodes
        assert sorted(host_of[n] for n in nodes) == ["host-a", "host-b"], (key, nodes)


def _holders(redis_url: str, namespace: str, keys: list[str]) -> dict[str, list[str]]:
    """The node ids the index records for each key."""
    import asyncio

    from backend.metadata import MetadataStore

    async def lookup() -> list[list[str]]:
        store = MetadataStore(redis_url, namespace)
        try:
            return [[loc.node_id for loc in entry] for entry in await store.index.lookup(keys)]
        finally:
            await store.close()

    return dict(zip(keys, asyncio.run(lookup())))
