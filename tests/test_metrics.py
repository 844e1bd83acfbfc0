"""Node metrics and /health over real HTTP from real node processes; connector metrics in-process."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backend import counters, metrics
from backend.counters import ConnectorCounter, MissCause, NodeCounter
from backend.embedded import EmbeddedRedis
from backend.metrics import NodeMetricsServer, register_connector_metrics, unregister_connector_metrics
from kvpool import Chunk, PoolConfig, SyncPoolClient
from kvpool.lmcache_connector import CLIENT_COUNTERS
from tests.conftest import REPO
from tests.support.waits import wait_until

METRICS_RE = re.compile(r"metrics at http://(\S+):(\d+)/metrics")
METRICS_MD = REPO / "docs" / "metrics.md"
MIB = 1024 * 1024

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# -- helpers ------------------------------------------------------------------------------
def _metrics_port(node) -> int:
    assert wait_until(lambda: METRICS_RE.search(node.log), 10.0), node.log
    match = METRICS_RE.search(node.log)
    assert match is not None
    return int(match.group(2))


def _http(port: int, raw: bytes, timeout_s: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` as is and read the whole answer (the server closes after one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(raw)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    return int(status_line.split()[1]), headers, body


def _get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    return _http(port, f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())


def _scrape(port: int) -> Samples:
    status, headers, body = _get(port, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return _samples(body.decode())


def _samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, default: float | None = None, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return samples[key] if default is None else samples.get(key, default)


def _chunks(prefix: str, count: int, size: int) -> list[Chunk]:
    rng = __import__("random").Random(prefix)
    return [Chunk(f"{prefix}@{i}", rng.randbytes(size)) for i in range(count)]


# -- /metrics from a real node ------------------------------------------------------------
def test_counters_and_tier_gauges_move_by_what_the_node_served(node_factory, pool_url):
    node = node_factory("--metrics-port", "0")
    port = _metrics_port(node)
    before = _scrape(port)
    n = node.node_id
    assert _value(before, "kvpool_node_puts_total", node=n) == 0  # declared before anything happened
    assert _value(before, "kvpool_node_tier_capacity_bytes", node=n, tier="dram") == 256 * MIB
    assert _value(before, "kvpool_node_epoch", node=n) == node.epoch
    assert _value(before, "kvpool_node_healthy", node=n) == 1

    chunks = _chunks("m", 6, 4096)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        got = client.get([c.key for c in chunks[:4]] * 2)  # 8 hits on this node
        assert all(g is not None for g in got)
        assert client.delete([chunks[5].key]) == 1
    after = _scrape(port)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, node=n, **labels) - _value(before, name, node=n, **labels)

    assert delta("kvpool_node_puts_total") == 6
    assert delta("kvpool_node_put_bytes_total") == 6 * 4096
    assert delta("kvpool_node_gets_total") == 8
    assert delta("kvpool_node_hits_total") == 8
    assert delta("kvpool_node_misses_total") == 0
    assert delta("kvpool_node_get_bytes_total") == 8 * 4096
    assert delta("kvpool_node_deletes_total") == 1
    assert delta("kvpool_node_objects") == 5
    assert delta("kvpool_node_tier_objects", tier="dram") == 5
    assert delta("kvpool_node_tier_used_bytes", tier="dram") == 5 * 4096
    assert _value(after, "kvpool_node_uptime_seconds", node=n) >= _value(before, "kvpool_node_uptime_seconds", node=n)
    assert delta("kvpool_node_requests_total") >= 3  # at least one put, one get and one delete request
    # One GET request (8 keys, one frame): one more in the histogram, in a bucket below 10 s.
    gets = _value(after, "kvpool_node_request_latency_seconds_count", node=n, op="get_batch")
    assert gets - _value(before, "kvpool_node_request_latency_seconds_count", node=n, op="get_batch", default=0) >= 1
    assert _value(after, "kvpool_node_request_latency_seconds_bucket", node=n, op="get_batch", le="+Inf") == gets
    assert _value(after, "kvpool_node_request_latency_seconds_bucket", node=n, op="get_batch", le="10.0") == gets
    assert 0 < _value(after, "kvpool_node_request_latency_seconds_sum", node=n, op="get_batch") < 10 * gets
    buckets = sorted(
        (float(dict(labels)["le"]), value)
        for (name, labels), value in after.items()
        if name == "kvpool_node_request_latency_seconds_bucket" and ("op", "put_batch") in labels
    )
    assert [value for _, value in buckets] == sorted(value for _, value in buckets)  # cumulative, as Prometheus wants


def test_nvme_tier_metrics_follow_demotion_and_promotion(node_factory, pool_url, tmp_path):
    node = node_factory("--metrics-port", "0", "--nvme-dir", str(tmp_path / "nvme"), "--nvme", "64MiB", dram="4MiB")
    port = _metrics_port(node)
    n = node.node_id
    chunks = _chunks("spill", 8, MIB)  # twice the DRAM tier
    # One connection: the chunks arrive in order, so the first is the least recently used.
    with SyncPoolClient(PoolConfig.from_url(f"{pool_url}?connections_per_node=1")) as client:
        client.put(chunks)
        mid = _scrape(port)
        demoted = _value(mid, "kvpool_node_demotions_total", node=n)
        assert demoted >= 4
        assert _value(mid, "kvpool_node_nvme_writes_total", node=n) >= demoted
        assert _value(mid, "kvpool_node_tier_used_bytes", node=n, tier="nvme") >= demoted * MIB
        assert _value(mid, "kvpool_node_tier_disk_full", node=n, tier="nvme") == 0
        assert _value(mid, "kvpool_node_objects", node=n) == 8
        assert _value(mid, "kvpool_node_recovery_files", node=n) == 0  # fresh directory
        oldest = client.get([chunks[0].key])[0]  # least recently used: on NVMe by now
        assert oldest is not None and bytes(oldest.data) == bytes(chunks[0].data)
    after = _scrape(port)
    assert (
        _value(after, "kvpool_node_nvme_reads_total", node=n) - _value(mid, "kvpool_node_nvme_reads_total", node=n) == 1
    )
    assert (
        _value(after, "kvpool_node_promotions_total", node=n) - _value(mid, "kvpool_node_promotions_total", node=n) == 1
    )


# -- /health and the HTTP surface ---------------------------------------------------------
def test_health_is_200_with_status_ok_while_serving(node_factory):
    node = node_factory("--metrics-port", "0")
    status, headers, body = _get(_metrics_port(node), "/health")
    assert status == 200 and headers["content-type"] == "application/json"
    health = json.loads(body)
    assert health["status"] == "ok" and health["node_id"] == node.node_id


def test_health_is_503_degraded_when_redis_is_gone(node_factory, redis_factory):
    redis = EmbeddedRedis().start()
    redis_factory.append(redis)
    node = node_factory("--metrics-port", "0", redis_url=redis.url)
    port = _metrics_port(node)
    assert _get(port, "/health")[0] == 200
    redis.kill()
    assert wait_until(lambda: _get(port, "/health")[0] == 503, 15.0)
    status, _, body = _get(port, "/health")
    assert status == 503 and json.loads(body)["status"] == "degraded"
    assert _value(_scrape(port), "kvpool_node_healthy", node=node.node_id) == 0
    assert node.alive()


def test_unknown_paths_are_404_and_other_methods_405(node_factory):
    port = _metrics_port(node_factory("--metrics-port", "0"))
    assert _get(port, "/")[0] == 404
    assert _get(port, "/metrics/extra")[0] == 404
    assert _get(port, "/metrics?name=x")[0] == 200  # a query string does not change the document
    status, headers, _ = _http(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    status, headers, body = _http(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0


def test_malformed_slow_and_oversized_requests_do_not_break_the_endpoint(node_factory):
    node = node_factory("--metrics-port", "0")
    port = _metrics_port(node)
    assert _http(port, b"garbage\r\n\r\n")[0] == 400
    assert _http(port, b"GET /metrics SPDY/3\r\n\r\n")[0] == 400
    assert _http(port, b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n")[0] == 400
    assert _http(port, b"\xff\xfe\x00binary\n\n")[0] == 400
    assert _http(port, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n")[0] == 431
    # An error answered before the request was read to its end still reaches the client.
    big_post = b"POST /metrics HTTP/1.1\r\nContent-Length: 500000\r\n\r\n" + b"x" * 500_000
    assert _http(port, big_post)[0] == 405
    many_headers = b"".join(b"X-H%d: v\r\n" % i for i in range(200))
    assert _http(port, b"GET /metrics HTTP/1.1\r\n" + many_headers + b"\r\n")[0] == 431
    # A client that connects and says nothing, or stops half-way, holds nothing up.
    idle = socket.create_connection(("127.0.0.1", port))
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /metr")
    try:
        started = time.monotonic()
        assert _get(port, "/health")[0] == 200
        assert time.monotonic() - started < 2.0
        idle.settimeout(15.0)
        assert idle.recv(4096).startswith(b"HTTP/1.1 408 ")  # then the server gives up on it
    finally:
        idle.close()
        half.close()
    with socket.create_connection(("127.0.0.1", port)) as gone:
        gone.sendall(b"GET /metrics HTTP/1.1\r\n")  # and vanishes before the blank line
    assert _scrape(port)[("kvpool_node_healthy", (("node", node.node_id),))] == 1
    assert node.alive()


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("flag", ["--metrics-port", "--port"])
def test_a_taken_port_stops_the_node_with_one_clear_line_and_exit_1(redis_server, namespace, flag):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "backend.cli",
                "node",
                "--redis",
                redis_server.url,
                "--namespace",
                namespace,
                "--dram",
                "16MiB",
                flag,
                str(port),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
    assert result.returncode == 1  # a runtime error (the flag is fine; the port is taken), naming the option
    last = result.stderr.strip().splitlines()[-1]
    option = flag.removeprefix("--").replace("-", "_")
    assert last.startswith(f"kvpool: error: {option}: cannot listen on 127.0.0.1:") and str(port) in last
    assert "Traceback" not in result.stderr


def test_clients_that_connect_and_say_nothing_cannot_lock_out_a_scrape(node_factory):
    node = node_factory("--metrics-port", "0")
    port = _metrics_port(node)
    crowd = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * metrics.MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # all accepted and waiting for a request head
        started = time.monotonic()
        assert _get(port, "/metrics")[0] == 200
        assert _get(port, "/health")[0] == 200
        assert time.monotonic() - started < 2.0  # well inside READ_TIMEOUT_S
    finally:
        for sock in crowd:
            sock.close()
    assert node.alive()


async def test_a_failing_stats_call_answers_500_and_the_server_keeps_serving():
    def broken_stats() -> dict:
        raise RuntimeError("injected")  # a bug in stats() cannot be caused for real

    server = NodeMetricsServer(broken_stats, lambda: {"status": "ok"}, "127.0.0.1", 0)
    await server.start()
    try:
        assert server.port != 0
        assert (await asyncio.to_thread(_get, server.port, "/metrics"))[0] == 500
        assert (await asyncio.to_thread(_get, server.port, "/health"))[0] == 200
    finally:
        await server.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1.0).close()


# -- connector metrics in the default registry --------------------------------------------
@pytest.fixture
def plugins():
    names: list[str] = []
    yield names
    for name in names:
        unregister_connector_metrics(name)


def _default_registry() -> Samples:
    return _samples(generate_latest(REGISTRY).decode())


def test_connector_counters_appear_in_the_default_registry_per_plugin(plugins):
    first, second = Counter({"put_chunks": 3, "get_hits": 2, "miss_lookup": 1}), Counter({"get_misses": 7})
    plugins += ["kvt-a", "kvt-b"]
    register_connector_metrics(lambda: first, "kvt-a")
    register_connector_metrics(lambda: second, "kvt-b")
    samples = _default_registry()
    assert _value(samples, "kvpool_connector_put_chunks_total", plugin="kvt-a") == 3
    assert _value(samples, "kvpool_connector_miss_lookup_total", plugin="kvt-a") == 1
    assert _value(samples, "kvpool_connector_get_misses_total", plugin="kvt-b") == 7
    assert _value(samples, "kvpool_connector_get_hits_total", plugin="kvt-b") == 0  # declared from the start
    first["get_hits"] += 5  # read at scrape time
    assert _value(_default_registry(), "kvpool_connector_get_hits_total", plugin="kvt-a") == 7


def test_registering_a_plugin_again_replaces_its_counters(plugins):
    plugins.append("kvt-re")
    register_connector_metrics(lambda: {"put_chunks": 1}, "kvt-re")
    register_connector_metrics(lambda: {"put_chunks": 40}, "kvt-re")  # no "Duplicated timeseries" error
    text = generate_latest(REGISTRY).decode()
    assert text.count('kvpool_connector_put_chunks_total{plugin="kvt-re"}') == 1
    assert _value(_samples(text), "kvpool_connector_put_chunks_total", plugin="kvt-re") == 40
    unregister_connector_metrics("kvt-re")
    assert 'plugin="kvt-re"' not in generate_latest(REGISTRY).decode()


def test_a_failing_connector_source_does_not_break_the_scrape(plugins):
    def broken() -> dict[str, int]:
        raise RuntimeError("injected")

    plugins += ["kvt-broken", "kvt-fine"]
    register_connector_metrics(broken, "kvt-broken")
    register_connector_metrics(lambda: {"get_hits": 2}, "kvt-fine")
    samples = _default_registry()
    assert _value(samples, "kvpool_connector_get_hits_total", plugin="kvt-fine") == 2
    assert not any(("plugin", "kvt-broken") in labels for _, labels in samples)


# -- docs/metrics.md lists every name ------------------------------------------------------
def _documented() -> str:
    return METRICS_MD.read_text()


def _missing_from_docs(names: set[str]) -> list[str]:
    docs = _documented()
    return sorted(name for name in names if not re.search(rf"\b{re.escape(name)}\b", docs))


def _source_counters() -> tuple[set[str], set[str]]:
    """Counter names the node and the connector can report, read from their code.

    A counter appears in a scrape only once it happened, so a scrape alone cannot list them.
    The code counts under members of backend/counters.py: the names it uses are those members' values.
    """
    node = set()
    sources = [path.read_text() for path in sorted((REPO / "backend" / "node").rglob("*.py"))]
    channel = (REPO / "nccl_channel" / "node.py").read_text()
    sources.append(channel[channel.index("class ChannelServer") :])  # a node started with --channel adds these
    for text in sources:
        node |= {NodeCounter[member].value for member in re.findall(r"\bNodeCounter\.([A-Z_]+)", text)}
    # The in-process connector and the chunk conversion it reads through (its misses go through MissBoundary).
    source = "".join(
        (REPO / "backend" / "lmcache" / name).read_text() for name in ("connector.py", "chunks.py", "token_binding.py")
    )
    connector = {ConnectorCounter[member].value for member in re.findall(r"\bConnectorCounter\.([A-Z_]+)", source)}
    connector |= {str(name) for name in CLIENT_COUNTERS}  # the client's counters the connector reports as its own
    connector |= {MissCause[member].counter for member in re.findall(r"\bMissCause\.([A-Z_]+)", source)}
    return node, connector


def _scrape_busy_nvme_node(node_factory, pool_url, tmp_path) -> set[str]:
    """Every sample name a node with an NVMe tier and an arena emits once it served puts and gets.

    Such a node emits every family a DRAM-only node does, plus the NVMe and recovery ones.
    """
    node = node_factory("--metrics-port", "0", "--nvme-dir", str(tmp_path / "nvme"), "--nvme", "16MiB", shm=True)
    for url in (pool_url, f"{pool_url}?tenant=doc"):  # a tenant's chunks: the per-tenant families too
        with SyncPoolClient(PoolConfig.from_url(url)) as client:
            chunks = _chunks("doc", 2, 1024)
            client.put(chunks)
            assert all(client.get([c.key for c in chunks]))
    return {name for name, _ in _scrape(_metrics_port(node))}


def test_every_metric_a_node_emits_is_documented(node_factory, pool_url, tmp_path):
    emitted = _scrape_busy_nvme_node(node_factory, pool_url, tmp_path)
    assert {
        "kvpool_node_recovery_files",
        "kvpool_node_tier_disk_full",
        "kvpool_node_request_latency_seconds_bucket",
        "kvpool_node_request_latency_seconds_sum",
        "kvpool_node_request_latency_seconds_count",
    } <= emitted
    assert _missing_from_docs(emitted) == []


def test_every_counter_name_is_counted_somewhere():
    """A name of backend/counters.py that no code counts under would be a series that never moves."""
    sources = "".join(
        path.read_text()
        for root in ("backend", "nccl_channel")
        for path in sorted((REPO / root).rglob("*.py"))
        if path.name != "counters.py" and "metrics" not in path.parts
    )
    owners = [counters.NodeCounter, counters.ClientCounter, counters.ChannelCounter]
    owners += [counters.ConnectorCounter, counters.L2Counter, counters.MissCause]
    unused = [f"{owner.__name__}.{member.name}" for owner in owners for member in owner]
    unused = [name for name in unused if not re.search(rf"\b{re.escape(name)}\b", sources)]
    assert unused == []


def test_counter_names_reach_stat_and_the_client_as_their_plain_names(node_factory, pool_url):
    node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        chunks = _chunks("typed", 2, 256)
        client.put(chunks)
        assert all(client.get([c.key for c in chunks]))
        (node,) = client.nodes()
        stat = client.node_stats(node)["counters"]
        mine = client.counters
    assert mine["put_chunks"] == 2 and mine["get_hits"] == 2
    assert {type(name) for name in [*mine, *stat]} == {str}  # not the enum: what json and callers see
    assert stat["puts"] == 2 and stat["hits"] == 2 and stat[NodeCounter.GETS] == 2


def test_every_counter_in_the_source_is_documented():
    node, connector = _source_counters()
    assert {"puts", "hits", "gets", "demotions", "nvme_reads"} <= node  # the scan finds what it should
    assert {"get_hits", "put_chunks", "miss_lookup"} <= connector
    names = {f"kvpool_node_{c}_total" for c in node} | {f"kvpool_connector_{c}_total" for c in connector}
    assert _missing_from_docs(names) == []


def test_the_docs_name_only_metrics_the_code_can_emit(node_factory, pool_url, tmp_path):
    node_counters, connector_counters = _source_counters()
    emittable = _scrape_busy_nvme_node(node_factory, pool_url, tmp_path)
    emittable |= {f"kvpool_node_{c}_total" for c in node_counters}
    emittable |= {f"kvpool_connector_{c}_total" for c in connector_counters | set(metrics.CONNECTOR_COUNTERS)}
    emittable.add(metrics.POOL_UP)  # the connector's gauge (tests/test_troubleshooting.py scrapes it)
    pages = _documented() + (REPO / "docs" / "operations.md").read_text()  # the operator's page names some too
    documented = set(re.findall(r"\b(kvpool_(?:node|connector)_[a-z0-9_]+)\b", pages))
    assert documented, "docs/metrics.md lists no metric"
    assert sorted(documented - emittable) == []
