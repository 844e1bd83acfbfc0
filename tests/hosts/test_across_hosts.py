"""kvpool across hosts of the bed (``bench.hosts.bed``): each host its own namespaces, hostname and /dev/shm.

Real redis-server and node processes run on their hosts; clients run on others, so every
read crosses the bridge over TCP, as between real machines.
"""

from __future__ import annotations

import json
import sys
import time

from tests.hosts.conftest import FULL

ONE_WAY_DELAY_MS = 0.25
SOAK_S = 60.0 if FULL else 8.0
LOSS_ONE_IN = 100


def _url(redis, *, query: str = "") -> str:
    return f"kvpool://{redis.address}:{redis.port}/kvpool" + (f"?{query}" if query else "")


def _engine(bed, host: str, role: str, url: str, chunks: int) -> dict:
    proc = bed.run(host, [sys.executable, "-m", "bench.engine", role, url, "--chunks", str(chunks)], timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _node_stats(bed, host: str, url: str) -> list[dict]:
    proc = bed.run(host, [sys.executable, "-m", "backend.cli", "nodes", "--json", "--url", url], timeout_s=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_lmcache_engine_on_one_host_reads_what_an_engine_on_another_host_stored_over_tcp(bed_factory):
    bed = bed_factory(["redis", "node1", "enginea", "engineb"])
    redis = bed.start_redis("redis", delay_ms=ONE_WAY_DELAY_MS)
    node = bed.start_node("node1", redis.url, delay_ms=ONE_WAY_DELAY_MS, shm=True)  # its arena: node1's /dev/shm
    url = _url(redis)
    stored = _engine(bed, "enginea", "put", url, 6)
    assert stored["hit_prefix"] == 6
    read = _engine(bed, "engineb", "get", url, 6)
    assert read["hits"] == 6 and read["identical"] == 6
    assert read["shm_get_bytes"] == 0  # engine B's /dev/shm holds no arena: it cannot map node1's
    driver = bed_factory.driver(bed, "engineb", url)
    nodes = driver.call("nodes")["nodes"]
    assert [(n["node_id"], n["hostname"]) for n in nodes] == [(node.node_id, "node1")]
    # The node sent every byte of the chunks over its socket (its arena was never mapped by anyone).
    rows = _node_stats(bed, "engineb", url)
    assert rows[0]["address"] == f"{bed.hosts['node1'].address}:{node.port}"


def test_replicas_land_on_distinct_hosts_and_kvpool_ls_and_nodes_show_the_hosts(bed_factory):
    bed = bed_factory(["redis", "hosta", "hostb", "client"])
    redis = bed.start_redis("redis")
    nodes = [bed.start_node(h, redis.url, port=p, shm=False) for h in ("hosta", "hostb") for p in (7000, 7002)]
    url = _url(redis, query="replicas=2")
    driver = bed_factory.driver(bed, "client", url)
    keys = [f"replica-{i}" for i in range(24)]
    assert "error" not in driver.call("put", keys=keys, size=64 << 10)
    got = driver.call("get", keys=keys, size=64 << 10)
    assert got["hits"] == len(keys) and got["wrong"] == []
    listed = bed.run("client", [sys.executable, "-m", "backend.cli", "ls", "--json", "--url", url], timeout_s=60)
    assert listed.returncode == 0, listed.stderr[-2000:]
    host_of = {n.node_id: n.node_id.rsplit("-", 1)[0] for n in nodes}
    assert set(host_of.values()) == {"hosta", "hostb"}  # node ids carry their host's name
    copies: dict[str, list[str]] = {}
    for line in listed.stdout.splitlines():
        row = json.loads(line)
        assert row["host"] == host_of[row["node_id"]]  # ls names the host each copy is on
        copies.setdefault(row["key"], []).append(row["host"])
    shown = bed.run("client", [sys.executable, "-m", "backend.cli", "nodes", "--json", "--url", url], timeout_s=60)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert {r["node_id"]: r["host"] for r in json.loads(shown.stdout)} == host_of
    table = bed.run("client", [sys.executable, "-m", "backend.cli", "nodes", "--url", url], timeout_s=60)
    header = next(line for line in table.stdout.splitlines() if "address" in line)
    assert [cell.strip() for cell in header.split("┃") if cell.strip()][:3] == ["node", "host", "address"]
    assert all(h in table.stdout for h in ("hosta", "hostb"))
    assert sorted(copies) == sorted(keys)
    spread = {key: sorted(hosts) for key, hosts in copies.items()}
    assert all(hosts == ["hosta", "hostb"] for hosts in spread.values()), spread  # 2 copies, one per host
    rows = _node_stats(bed, "client", url)
    addresses = {row["node_id"]: row["address"].rsplit(":", 1)[0] for row in rows}
    assert addresses == {n.node_id: bed.hosts[host_of[n.node_id]].address for n in nodes}


def test_a_link_that_drops_one_packet_in_a_hundred_returns_no_wrong_byte_under_a_soak(bed_factory):
    bed = bed_factory(["redis", "node1", "node2", "client"])
    redis = bed.start_redis("redis")
    for host in ("node1", "node2"):
        bed.start_node(host, redis.url, shm=False)
    bed.set_loss("client", LOSS_ONE_IN)
    assert f"numgen random mod {LOSS_ONE_IN} 0 drop" in bed.rules()
    driver = bed_factory.driver(bed, "client", _url(redis, query="connect_timeout_s=5&progress_timeout_s=5"))
    size, batch = 1 << 20, 8
    rounds = hits = 0
    wrong: list[str] = []
    deadline = time.monotonic() + SOAK_S
    while time.monotonic() < deadline:
        keys = [f"soak-{rounds}-{i}" for i in range(batch)]
        put = driver.call("put", keys=keys, size=size)
        got = driver.call("get", keys=keys, size=size)
        assert "error" not in got, got
        hits += got["hits"]
        wrong += got["wrong"]
        rounds += 1
    assert wrong == []
    assert rounds >= 3 and "error" not in put
    assert hits >= rounds * batch * 0.9, (hits, rounds)  # lost packets are retransmitted, not lost chunks
