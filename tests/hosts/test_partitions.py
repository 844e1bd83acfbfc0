"""Blackholes across hosts: a link that drops everything silently (no RST, no FIN), then heals.

Every test ends with 0 wrong bytes, nothing lost on the nodes that stayed up, and full
service within ``HEAL_S`` of the heal. The time bounds (a silent peer costs the first
call at most ``progress_timeout_s`` of silence, later calls <= 10 ms: the client's progress
timeout, down marks and Redis circuit) are checked under ``make faults``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from tests.hosts.conftest import FULL
from tests.support.waits import wait_until

TIMEOUT_S = 1.0  # connect_timeout_s and progress_timeout_s
HEAL_S = 10.0
LATER_CALL_S = 0.010
full_only = pytest.mark.skipif(not FULL, reason="bound tests run under `make faults` (KVPOOL_FULL=1)")
MiB = 1 << 20


def _pool(bed_factory, nodes: tuple[str, ...], *, replicas: int = 1, rate_gbit: float | None = None):
    bed = bed_factory(["redis", *nodes, "client"])
    redis = bed.start_redis("redis")
    started = {host: bed.start_node(host, redis.url, shm=False, dram="512MiB") for host in nodes}
    if rate_gbit is not None:
        bed.set_rate("client", rate_gbit)
    url = f"kvpool://{redis.address}:{redis.port}/kvpool?connect_timeout_s={TIMEOUT_S}&progress_timeout_s={TIMEOUT_S}&replicas={replicas}"
    return bed, started, url, bed_factory.driver(bed, "client", url)


def _holders(bed, url: str) -> dict[str, set[str]]:
    proc = bed.run("client", [sys.executable, "-m", "backend.cli", "ls", "--json", "--url", url], timeout_s=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    held: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        held.setdefault(row["key"], set()).add(row["node_id"].rsplit("-", 1)[0])
    return held


def _full_service(bed, driver, hosts, tag: str) -> None:
    """Within HEAL_S: a put and a hit on every node (keys until each node holds one)."""
    deadline = time.monotonic() + HEAL_S
    for i in range(64):
        keys = [f"{tag}-{i}"]
        driver.call("put", keys=keys, size=MiB)
        got = driver.call("get", keys=keys, size=MiB)
        assert got.get("wrong", []) == []
        if time.monotonic() > deadline:
            break
    nodes = driver.call("nodes")["nodes"]
    assert {n["hostname"] for n in nodes if n["alive"]} == set(hosts), nodes
    assert time.monotonic() <= deadline + 1.0


def _mid_get_blackhole(bed_factory, replicas: int) -> dict:
    """8 x 8 MiB on a 1 Gb/s client link (about 0.6 s), node1 blackholed 0.2 s into the get."""
    bed, _, url, driver = _pool(bed_factory, ("node1", "node2"), replicas=replicas, rate_gbit=1.0)
    keys = [f"mid-{i}" for i in range(8)]
    assert "error" not in driver.call("put", keys=keys, size=8 * MiB)
    held = _holders(bed, url)
    on_node1 = [k for k in keys if "node1" in held[k]]
    assert on_node1, held
    driver.send("get", keys=keys, size=8 * MiB)
    timer = threading.Timer(0.2, bed.partition, ("client", "node1"))
    timer.start()
    during = driver.receive()
    timer.join()
    later = driver.call("get", keys=keys, size=8 * MiB)
    bed.heal()
    healed_at = time.monotonic()
    assert wait_until(lambda: driver.call("get", keys=keys, size=8 * MiB)["hits"] == len(keys), HEAL_S)
    return {
        "during": during,
        "later": later,
        "heal_s": time.monotonic() - healed_at,
        "on_node1": on_node1,
        "bed": bed,
        "driver": driver,
    }


@pytest.mark.parametrize("replicas", [1, 2])
def test_blackholed_node_mid_batch_get_never_returns_a_wrong_byte_and_is_read_again_after_the_heal(
    bed_factory, replicas
):
    seen = _mid_get_blackhole(bed_factory, replicas)
    for answer in (seen["during"], seen["later"]):
        assert "error" not in answer, answer
        assert answer["wrong"] == []
    if replicas == 1:  # no other copy: what node1 held is a miss, what node2 held a hit
        assert seen["later"]["hits"] == 8 - len(seen["on_node1"])
    _full_service(seen["bed"], seen["driver"], ("node1", "node2"), f"after-{replicas}")


@full_only
def test_blackholed_node_mid_batch_get_returns_within_the_timeout_and_later_calls_fail_fast(bed_factory):
    seen = _mid_get_blackhole(bed_factory, replicas=2)
    assert seen["during"]["hits"] == 8  # every key from the other replica
    assert seen["during"]["seconds"] <= TIMEOUT_S + 1.0
    assert seen["later"]["hits"] == 8 and seen["later"]["seconds"] <= 1.0  # node1 marked down: not waited on


def test_node_cut_from_redis_keeps_serving_loses_no_puts_routing_and_republishes_after_the_heal(bed_factory):
    bed, _, url, driver = _pool(bed_factory, ("node1", "node2"))
    keys = [f"held-{i}" for i in range(16)]
    assert "error" not in driver.call("put", keys=keys, size=MiB)
    with bed.blackhole("node1", "redis"):
        got = driver.call("get", keys=keys, size=MiB)
        assert got["hits"] == len(keys) and got["wrong"] == []  # node1 serves what it holds
        # Its heartbeat lapses (TTL 5 s): clients stop sending it new puts.
        assert wait_until(lambda: {n["hostname"] for n in driver.call("nodes")["nodes"] if n["alive"]} == {"node2"}, 15)
        fresh = [f"fresh-{i}" for i in range(16)]
        assert "error" not in driver.call("put", keys=fresh, size=MiB)
        held = _holders(bed, url)
        assert all(held[k] == {"node2"} for k in fresh), held
    assert wait_until(lambda: len([n for n in driver.call("nodes")["nodes"] if n["alive"]]) == 2, HEAL_S)
    got = driver.call("get", keys=keys + fresh, size=MiB)
    assert got["hits"] == len(keys) + len(fresh) and got["wrong"] == []  # nothing node1 held was lost
    _full_service(bed, driver, ("node1", "node2"), "after-redis")


def _client_cut_from_redis(bed_factory) -> dict:
    bed, _, _, driver = _pool(bed_factory, ("node1",))
    keys = [f"known-{i}" for i in range(8)]
    assert "error" not in driver.call("put", keys=keys, size=MiB)
    with bed.blackhole("client", "redis"):
        first = driver.call("get", keys=keys, size=MiB)
        later = [driver.call("contains", keys=keys) for _ in range(3)]
        half = [f"half-{i}" for i in range(8)]
        put = driver.call("put", keys=half, size=MiB)
    healed_at = time.monotonic()
    assert wait_until(lambda: driver.call("get", keys=keys, size=MiB)["hits"] == len(keys), HEAL_S)
    recovered_s = time.monotonic() - healed_at
    after = driver.call("get", keys=half, size=MiB)
    return {
        "first": first,
        "later": later,
        "put": put,
        "after": after,
        "recovered_s": recovered_s,
        "bed": bed,
        "driver": driver,
    }


def test_client_cut_from_redis_reads_misses_commits_no_half_put_and_recovers_after_the_heal(bed_factory):
    seen = _client_cut_from_redis(bed_factory)
    assert "error" not in seen["first"] and seen["first"]["wrong"] == []
    assert seen["first"]["hits"] == 0  # no index: misses, not an error
    assert all("error" not in c for c in seen["later"])
    assert seen["after"]["wrong"] == []
    assert seen["after"]["hits"] in (0, 8)  # the put during the cut: whole or absent, never half
    assert seen["recovered_s"] <= HEAL_S
    _full_service(seen["bed"], seen["driver"], ("node1",), "after-client-redis")


@full_only
def test_client_cut_from_redis_pays_one_timeout_then_fails_fast(bed_factory):
    seen = _client_cut_from_redis(bed_factory)
    assert seen["first"]["seconds"] <= TIMEOUT_S + 1.0
    assert all(c["seconds"] <= LATER_CALL_S for c in seen["later"]), seen["later"]
