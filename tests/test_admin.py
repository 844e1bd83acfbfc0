"""Every admin verb against a real pool (redis-server + 2 node processes) with data in it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import yaml

from backend.embedded import free_port
from backend.errors import CapacityError, ProtocolError
from backend.metadata import Location, MetadataStore, NodeInfo
from backend.node.memory.arena import room_of
from backend.node.store.nvme_format import chunk_path, read_header
from backend.protocol.inventory import InventoryRow, Verified
from kvpool import Chunk, PoolConfig, SyncPoolClient
from tests.conftest import REPO, NodeProcess
from tests.support.cli import kvpool
from tests.support.index import index_key
from tests.support.waits import wait_until

KIB = 1024


def _data(prefix: str, count: int, size: int, seed: int = 0) -> list[Chunk]:
    rng = random.Random(seed)
    return [Chunk(f"{prefix}@1@0@{i}@bfloat16", rng.randbytes(size)) for i in range(count)]


def _json(*args: str, code: int = 0) -> object:
    out = kvpool(*args, "--json")
    assert out.returncode == code, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def pool(node_factory, pool_url):
    a, b = node_factory(dram="64MiB"), node_factory(dram="32MiB")
    return pool_url, a, b


def test_status_nodes_ls_and_stats_report_the_real_numbers(pool):
    url, a, b = pool
    model_a = _data("org/model-a", 10, 10 * KIB)
    model_b = _data("org/model-b", 4, 2 * KIB)
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(model_a + model_b)
        client.get([c.key for c in model_a[:6]])
    status = _json("status", "--url", url)
    assert status["nodes"] == {"alive": 2, "dead": 0, "draining": 0}
    assert status["objects"] == 14
    # DRAM counts each chunk at the room it occupies: 10 KiB in three pages, 2 KiB in a cell
    assert status["used_bytes"] == 10 * room_of(10 * KIB) + 4 * room_of(2 * KIB) == 10 * 12 * KIB + 4 * 2 * KIB
    assert status["recent"]["gets"] == 6 and status["recent"]["hit_rate"] == 1.0

    rows = _json("nodes", "--url", url)
    assert {r["node_id"] for r in rows} == {a.node_id, b.node_id}
    assert sum(r["tiers"]["dram"]["objects"] for r in rows) == 14
    assert {r["tiers"]["dram"]["capacity_bytes"] for r in rows} == {64 * 2**20, 32 * 2**20}
    assert all(r["alive"] and r["last_heartbeat_s"] is not None for r in rows)

    listed = kvpool("ls", "--url", url, "--model", "org/model-b", "--json")
    entries = [json.loads(line) for line in listed.stdout.splitlines()]
    assert sorted(e["key"] for e in entries) == sorted(c.key for c in model_b)
    assert all(e["nbytes"] == 2 * KIB and e["tier"] == "dram" and e["epoch"] >= 1 for e in entries)
    limited = kvpool("ls", "--url", url, "--prefix", "org/model-", "--limit", "5", "--json")
    assert len(limited.stdout.splitlines()) == 5

    stats = _json("stats", "--url", url)
    assert stats["counters"]["puts"] == 14
    assert stats["counters"]["hits"] == 6
    assert stats["counters"]["put_bytes"] == 10 * 10 * KIB + 4 * 2 * KIB
    latency = stats["latency"]["get_batch"]
    assert latency["count"] >= 1 and 0 < latency["p50_ms"] <= latency["p99_ms"] < 30_000
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        per_node = [client.node_stats(n)["latency"]["ops"].get("get_batch") for n in client.nodes()]
    # the pool's count is the nodes' histograms added up
    assert latency["count"] == sum(sum(h["counts"]) for h in per_node if h is not None)


def test_node_admin_requests_answer_typed_values_for_one_node(node_factory, pool_url):
    node = node_factory()
    chunks = _data("typed", 5, 3 * KIB)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as sync:
        sync.put(chunks)
        client, info = sync._client, sync.nodes()[0]
        admin = client.node_admin
        first = sync._call(admin.inventory(info, limit=2))
        assert [r.key for r in first.rows] == sorted(c.key for c in chunks)[:2] and first.more
        assert first.rows[0] == InventoryRow(first.rows[0].key, "dram", 3 * KIB, first.rows[0].checksum)
        rest = sync._call(admin.inventory(info, after=first.rows[-1].key, limit=10))
        assert len(rest.rows) == 3 and not rest.more

        async def pages() -> list[list[InventoryRow]]:
            return [page async for page in admin.inventory_pages(info, limit=2)]

        assert [len(p) for p in sync._call(pages())] == [2, 2, 1]
        keys = [chunks[0].key, "typed@absent"]
        assert sync._call(admin.exists(info, keys)) == [True, False]
        assert sync._call(admin.verify(info, keys)) == [Verified.OK, Verified.MISSING]
        assert sync._call(admin.delete_on(info, keys)) == [True, False]
        assert sync._call(admin.exists(info, keys[:1])) == [False]
        assert sync._call(admin.stats(info)).node_id == node.node_id
        with pytest.raises(ProtocolError, match="limit"):
            sync._call(admin.inventory(info, limit=0))  # refused before anything is sent


def test_evict_by_key_model_and_prefix(pool):
    url, _, _ = pool
    chunks = _data("m1", 3, 100) + _data("m2", 3, 100) + _data("other", 2, 100)
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        assert _json("evict", "--url", url, chunks[0].key) == {"evicted": 1, "kept": 0, "refused": {}}
        assert _json("evict", "--url", url, "--model", "m2")["evicted"] == 3
        assert _json("evict", "--url", url, "--prefix", "oth")["evicted"] == 2
        assert client.contains([c.key for c in chunks]) == [False, True, True] + [False] * 5
        assert _json("status", "--url", url)["objects"] == 2


def test_drain_moves_every_chunk_verified_and_resumes_after_being_killed(pool):
    url, a, b = pool
    chunks = _data("drain", 300, 64 * KIB)
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        on_a = int(client.node_stats(next(n for n in client.nodes() if n.node_id == a.node_id))["objects"])
        assert on_a > 50
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "drain", a.node_id, "--url", url, "--batch", "1"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        node_a = next(n for n in client.nodes() if n.node_id == a.node_id)
        assert wait_until(lambda: int(client.node_stats(node_a)["objects"]) < on_a - 10, 30.0, 0.02)
        proc.send_signal(signal.SIGKILL)  # killed half-way
        proc.wait(10)
        left = int(client.node_stats(node_a)["objects"])
        assert 0 < left < on_a
        assert all(g is not None for g in client.get([c.key for c in chunks]))  # nothing lost meanwhile
        result = _json("drain", a.node_id, "--url", url)  # resume
        assert result["moved"] + result["already_elsewhere"] == left
        assert int(client.node_stats(node_a)["objects"]) == 0
        got = client.get([c.key for c in chunks])
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]
        entries = asyncio.run(_lookup(url, [c.key for c in chunks]))
        assert all([loc.node_id for loc in entry] == [b.node_id] for entry in entries)
        assert [n.draining for n in client.nodes() if n.node_id == a.node_id] == [True]
        client.put(_data("after", 20, 100))  # placement now skips the drained node
        assert int(client.node_stats(node_a)["objects"]) == 0


async def _lookup(url: str, keys: list[str]):
    config = PoolConfig.from_url(url)
    store = MetadataStore(config.redis_url, config.namespace)
    try:
        return await store.index.lookup(keys)
    finally:
        await store.close()


def test_check_finds_each_injected_inconsistency_and_fix_repairs_it(node_factory, pool_url, tmp_path):
    nvme = tmp_path / "nvme"
    disk = node_factory("--nvme-dir", str(nvme), "--nvme", "64MiB", dram="1MiB")
    mem = node_factory(dram="64MiB")
    config = PoolConfig.from_url(pool_url)
    chunks = _data("chk", 30, 128 * KIB)
    with SyncPoolClient(config) as client:
        for chunk in chunks:
            client.put([chunk])
        keys = [c.key for c in chunks]
        entries = asyncio.run(_lookup(pool_url, keys))
        on_disk = [k for k, e in zip(keys, entries) if e and e[0].node_id == disk.node_id and e[0].tier == "nvme"]
        on_mem = [k for k, e in zip(keys, entries) if e and e[0].node_id == mem.node_id]
        assert wait_until(lambda: chunk_path(nvme, on_disk[0]).exists(), 5.0)
        # 1. corrupted file
        path = chunk_path(nvme, on_disk[0])
        record = read_header(path)
        with open(path, "r+b") as f:
            f.seek(record.data_offset + 5)
            f.write(b"\xff\x00\xff")
        # 2. orphan bytes: the index entry vanishes, the node still holds the chunk
        subprocess.run(
            ["redis-cli", "-p", str(config.redis_port), "DEL", index_key(config.namespace, on_mem[0])],
            check=True,
            capture_output=True,
        )
        mem_epoch = next(n.epoch for n in client.nodes() if n.node_id == mem.node_id)

        async def inject() -> None:
            store = MetadataStore(config.redis_url, config.namespace)
            try:
                # 3. orphan entry: points at a live node that never had the chunk
                await store.index.commit([("ghost@1@0@1@bfloat16", Location(mem.node_id, mem_epoch, "dram", 10, 1))])
                # 4. a dead node with an entry
                dead = NodeInfo("dead-node", "127.0.0.1", 1, 99)
                redis = store.connection.redis
                await redis.hset(store.connection.nodes_key, "dead-node", dead.to_json())
                await store.index.commit([("dead@1@0@1@bfloat16", Location("dead-node", 99, "dram", 10, 2))])
            finally:
                await store.close()

        asyncio.run(inject())
    report = _json("check", "--url", pool_url, "--deep", code=3)  # 3: problems found
    assert [r["key"] for r in report["corrupt"]] == [on_disk[0]]
    assert [r["key"] for r in report["orphan_bytes"]] == [on_mem[0]]
    assert [r["key"] for r in report["orphan_entries"]] == ["ghost@1@0@1@bfloat16"]
    assert [r["key"] for r in report["dead_node_entries"]] == ["dead@1@0@1@bfloat16"]
    assert report["dead_nodes"] == ["dead-node"]
    # The node quarantined the corrupt copy (and dropped its entry) the moment it verified it,
    # as on any read; --fix repairs the rest.
    assert not path.exists() and (nvme / "quarantine" / path.name).exists()
    fixed = _json("check", "--url", pool_url, "--deep", "--fix", code=3)["fixed"]  # found (and fixed) problems
    assert fixed == {"entries_removed": 2, "bytes_reindexed": 1, "dead_nodes_forgotten": 1, "legacy_entries_removed": 0}
    again = _json("check", "--url", pool_url, "--deep")
    assert again["problems"] == 0
    with SyncPoolClient(config) as client:
        assert client.get([on_mem[0]])[0] is not None  # the re-indexed chunk is found again
        assert client.get([on_disk[0]]) == [None]


def test_flush_asks_unless_yes_and_wipes_the_namespace(pool):
    url, _, _ = pool
    chunks = _data("fl", 10, 1000)
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        ns = PoolConfig.from_url(url).namespace
        refused = kvpool("flush", "--url", url, "--namespace", ns)
        assert refused.returncode == 2 and "--yes" in refused.stderr
        assert client.hit_prefix([c.key for c in chunks]) == 10  # nothing changed
        result = _json("flush", "--url", url, "--namespace", ns, "--yes")
        assert result["chunks_deleted"] == 10
        assert client.contains([c.key for c in chunks]) == [False] * 10
        assert _json("status", "--url", url)["objects"] == 0


def test_bad_arguments_are_usage_errors_and_change_nothing(pool):
    url, _, _ = pool
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(_data("keep", 2, 10))
        for args in (
            ["ls", "--url", url, "--limit", "x"],
            ["drain"],
            ["check", "--url", url, "--bogus"],
            ["evict", "--url", url, "--model"],
        ):
            assert kvpool(*args).returncode == 2, args
        assert client.hit_prefix(["keep@1@0@0@bfloat16", "keep@1@0@1@bfloat16"]) == 2


@pytest.mark.usefixtures("processes")
def test_unreachable_redis_is_one_line_and_exit_1_for_every_verb():
    url = f"kvpool://127.0.0.1:{free_port()}/x?progress_timeout_s=0.3"
    for verb in (["status"], ["nodes"], ["ls"], ["stats"], ["evict", "k"], ["drain", "n"], ["check"]):
        out = kvpool(*verb, "--url", url)
        assert out.returncode == 1, (verb, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and "Redis" in out.stderr, (verb, out.stderr)


def test_doctor_passes_on_a_good_config_and_names_the_fix_for_bad_ones(pool, tmp_path):
    url, _, _ = pool
    good = tmp_path / "good.yaml"
    good.write_text(kvpool("lmcache-config", "--url", url).stdout)
    ok = kvpool("doctor", "--lmcache-config", str(good), "--json", timeout=180)
    findings = json.loads(ok.stdout)
    assert ok.returncode == 0, findings
    assert {f["check"] for f in findings} >= {"plugin loaded", "round trip", "nodes", "Redis"}

    config = yaml.safe_load(good.read_text())
    config["remote_storage_plugins"] = []
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump(config))
    out = kvpool("doctor", "--lmcache-config", str(missing), timeout=180)
    assert out.returncode == 1 and "remote_storage_plugins" in out.stdout and "fix:" in out.stdout

    config = yaml.safe_load(good.read_text())
    config["extra_config"]["remote_storage_plugin.kvpool.url"] = (
        f"kvpool://127.0.0.1:{free_port()}/x?progress_timeout_s=0.3"
    )
    down = tmp_path / "down.yaml"
    down.write_text(yaml.safe_dump(config))
    out = kvpool("doctor", "--lmcache-config", str(down), timeout=180)
    assert out.returncode == 1 and "[FAIL] Redis" in out.stdout and "kvpool up" in out.stdout


def test_doctor_checks_the_remote_url_form_end_to_end_and_fails_it_beside_the_plugin(pool, tmp_path):
    url, _, _ = pool
    alone = tmp_path / "remote_url.yaml"
    alone.write_text(kvpool("lmcache-config", "--url", url, "--form", "remote_url").stdout)
    ok = kvpool("doctor", "--lmcache-config", str(alone), "--json", timeout=180)
    findings = json.loads(ok.stdout)
    assert ok.returncode == 0, findings
    assert {f["check"] for f in findings} >= {"remote_url connector", "connector loaded", "round trip", "nodes"}

    plugin = tmp_path / "plugin.yaml"
    plugin.write_text(kvpool("lmcache-config", "--url", url).stdout)
    remote_url = yaml.safe_load(alone.read_text())["remote_url"]
    both = kvpool("doctor", "--lmcache-config", str(plugin), timeout=180, env={"LMCACHE_REMOTE_URL": remote_url})
    assert both.returncode == 1 and "[FAIL] remote_url" in both.stdout and "every chunk twice" in both.stdout

    config = yaml.safe_load(alone.read_text())
    config["remote_url"] = config["remote_url"].replace("KVPoolRemoteURLConnector", "KVPoolConnector") + "&replica=2"
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump(config))
    out = kvpool("doctor", "--lmcache-config", str(wrong), timeout=180)
    assert out.returncode == 1 and "[FAIL] remote_url connector" in out.stdout
    assert "connector_name=KVPoolRemoteURLConnector" in out.stdout  # the fix names the right class
    assert "[FAIL] pool URL: replica: unknown option" in out.stdout


@pytest.mark.usefixtures("processes")
def test_node_reads_its_options_from_a_config_file(redis_server, namespace, tmp_path):
    cfg = tmp_path / "node.yaml"
    cfg.write_text(
        yaml.safe_dump({"redis": redis_server.url, "namespace": namespace, "dram": "8MiB", "node-id": "from-yaml"})
    )
    node = NodeProcess(["--config", str(cfg)], {**os.environ}).start()
    try:
        assert node.node_id == "from-yaml"
        with SyncPoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{redis_server.port}/{namespace}")) as client:
            assert client.nodes()[0].capacity_bytes == 8 * 2**20
    finally:
        node.kill()
    cfg.write_text(yaml.safe_dump({"redis": redis_server.url, "dramm": "8MiB"}))
    out = subprocess.run(
        [sys.executable, "-m", "backend.cli", "node", "--config", str(cfg)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 2 and "dramm" in out.stderr


def test_drain_copies_a_chunk_whose_other_copy_is_on_a_dead_node(pool):
    url, a, _ = pool
    chunks = _data("dead-replica", 20, 4 * KIB)
    config = PoolConfig.from_url(url)
    with SyncPoolClient(config) as client:
        client.put(chunks)
        entries = asyncio.run(_lookup(url, [c.key for c in chunks]))
        on_a = [c for c, e in zip(chunks, entries) if e[0].node_id == a.node_id]
        assert on_a

        async def fake_replicas() -> None:  # copies on a node that is gone
            store = MetadataStore(config.redis_url, config.namespace)
            try:
                await store.index.commit(
                    [
                        (c.key, Location("gone-node", 7, "dram", len(c.data), e[0].checksum))
                        for c, e in zip(chunks, entries)
                        if e[0].node_id == a.node_id
                    ]
                )
            finally:
                await store.close()

        asyncio.run(fake_replicas())
        result = _json("drain", a.node_id, "--url", url)
        assert result["moved"] == len(on_a) and result["already_elsewhere"] == 0
        got = client.get([c.key for c in chunks])
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]


# -- Round 3: drains have an owner and an end; auth failures are failures -----------------------------

TOKEN = "r3-token-8c1f-0123456789abcdef01"


@pytest.fixture
def token_pool(node_factory, pool_url, tmp_path):
    """Two nodes that require TOKEN; the URL with it, and the same URL without it."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    a = node_factory("--token-file", str(token_file), dram="64MiB")
    b = node_factory("--token-file", str(token_file), dram="64MiB")
    return pool_url.replace("kvpool://", f"kvpool://:{TOKEN}@"), pool_url, a, b


def _draining(url: str) -> dict[str, bool]:
    return {row["node_id"]: row["draining"] for row in _json("status", "--url", url)["node_list"]}


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.stderr.strip().count("\n") == 0, out.stderr
    return out.stderr


def test_a_drain_the_node_refuses_marks_nothing_and_puts_still_land(token_pool):
    url, _, a, _ = token_pool
    wrong = url.replace(TOKEN, "not-the-token-0123456789abcdef01")
    out = kvpool("drain", a.node_id, "--url", wrong)
    assert out.returncode == 1
    line = _one_line(out)
    assert a.node_id in line and "token" in line
    assert _draining(url) == {a.node_id: False, token_pool[3].node_id: False}  # nothing was marked
    chunks = _data("after-refused-drain", 40, 1000)
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        on_a = next(n for n in client.nodes() if n.node_id == a.node_id)
        assert int(client.node_stats(on_a)["objects"]) > 0  # placement still sends it writes


def test_draining_the_only_node_is_refused_and_marks_nothing(node_factory, pool_url):
    only = node_factory()
    out = kvpool("drain", only.node_id, "--url", pool_url)
    assert out.returncode == 1
    line = _one_line(out)
    assert "nowhere to move" in line and only.node_id in line
    assert _draining(pool_url) == {only.node_id: False}
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(_data("only", 3, 100))  # the pool still takes writes


def test_undrain_ends_a_drain_and_puts_say_when_every_node_is_draining(pool):
    url, a, b = pool
    config = PoolConfig.from_url(url)
    assert _json("drain", a.node_id, "--url", url)["draining"] is True

    async def killed_drain_of_b() -> None:  # what a drain killed with SIGKILL leaves: b marked, nobody to clear it
        store = MetadataStore(config.redis_url, config.namespace)
        try:
            await store.registry.set_draining(b.node_id, True)
        finally:
            await store.close()

    asyncio.run(killed_drain_of_b())
    status = kvpool("status", "--url", url)
    assert "2 draining" in status.stdout and "kvpool undrain NODE" in status.stdout
    with SyncPoolClient(config) as client:
        with pytest.raises(CapacityError) as refused:
            client.put(_data("all-draining", 2, 100))
        assert "draining" in str(refused.value) and "no room" not in str(refused.value)
        assert "kvpool undrain" in str(refused.value)
        out = kvpool("undrain", b.node_id, "--url", url)
        assert out.returncode == 0 and f"undrained {b.node_id}" in out.stdout
        assert _draining(url) == {a.node_id: True, b.node_id: False}
        assert wait_until(lambda: not next(n for n in client.nodes() if n.node_id == b.node_id).draining, 5.0)
        client.put(_data("after-undrain", 2, 100))
        assert _json("undrain", b.node_id, "--url", url) == {"node_id": b.node_id, "was_draining": False}


def test_a_drain_stopped_by_ctrl_c_clears_its_mark(pool):
    url, a, b = pool
    chunks = _data("ctrl-c", 300, 64 * KIB)
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        node_a = next(n for n in client.nodes() if n.node_id == a.node_id)
        on_a = int(client.node_stats(node_a)["objects"])
        # SIGINT as a terminal sends it (a shell's background job would start with it ignored)
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "drain", a.node_id, "--url", url, "--batch", "1"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert wait_until(lambda: int(client.node_stats(node_a)["objects"]) < on_a - 10, 30.0, 0.02)
        # Hold the drain mid-way (its next put waits on the frozen target), so that Ctrl-C
        # surely finds it running, however fast the rest of it would have gone.
        b.pause()
        try:
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            b.resume()
        assert proc.returncode == 130, err
        assert _draining(url)[a.node_id] is False  # the run that set the mark cleared it
        assert all(g is not None for g in client.get([c.key for c in chunks]))  # nothing lost


def test_a_drained_node_that_stops_and_comes_back_under_its_id_takes_writes(node_factory, pool_url):
    a = node_factory("--node-id", "comes-back", dram="64MiB")
    b = node_factory(dram="64MiB")
    assert _json("drain", a.node_id, "--url", pool_url)["draining"] is True
    a.terminate()  # SIGTERM: the node deregisters, and its drain ends with it
    again = node_factory("--node-id", "comes-back", dram="64MiB")
    assert _draining(pool_url) == {again.node_id: False, b.node_id: False}


def test_stats_with_a_wrong_or_no_token_fails_naming_the_node(token_pool):
    url, bare, a, b = token_pool
    for shown_url in (bare, url.replace(TOKEN, "not-the-token-0123456789abcdef01")):
        for verb in ("stats", "status", "nodes"):
            out = kvpool(verb, "--url", shown_url)
            assert out.returncode == 1, (verb, out.stdout)
            line = _one_line(out)
            assert "token" in line and (a.node_id in line or b.node_id in line), line
    assert _json("stats", "--url", url)["nodes"] == 2


def test_evict_a_node_refuses_exits_1_and_keeps_what_it_could_not_delete(token_pool):
    url, bare, _, _ = token_pool
    chunks = _data("refused-evict", 20, 1000)
    keys = [c.key for c in chunks]
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(chunks)
        out = kvpool("evict", "--url", bare, "--prefix", "refused-evict")
        assert out.returncode == 1
        line = _one_line(out)
        assert "refused" in line and "token" in line and "20 chunks kept" in line
        assert client.contains(keys) == [True] * 20  # index entries and bytes both still there
        got = client.get(keys)
        assert [bytes(g.data) for g in got] == [bytes(c.data) for c in chunks]
        assert _json("evict", "--url", url, "--prefix", "refused-evict") == {"evicted": 20, "kept": 0, "refused": {}}
        assert client.contains(keys) == [False] * 20
        assert _json("status", "--url", url)["objects"] == 0  # the bytes went too


def test_check_without_fix_says_what_it_did_and_what_fix_would_do(node_factory, pool_url, tmp_path):
    nvme = tmp_path / "nvme"
    node_factory("--nvme-dir", str(nvme), "--nvme", "64MiB", dram="1MiB")
    chunks = _data("dry", 8, 256 * KIB)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        for chunk in chunks:
            client.put([chunk])
    entries = asyncio.run(_lookup(pool_url, [c.key for c in chunks]))
    on_disk = next(c.key for c, e in zip(chunks, entries) if e and e[0].tier == "nvme")
    path = chunk_path(nvme, on_disk)
    assert wait_until(path.exists, 5.0)
    record = read_header(path)
    with open(path, "r+b") as f:
        f.seek(record.data_offset + 5)
        f.write(b"\xff\x00\xff")
    out = kvpool("check", "--url", pool_url, "--deep")
    assert out.returncode == 3, out.stderr
    assert "quarantined" in out.stdout
    assert "check --fix" not in out.stdout  # nothing is left for --fix to repair: it would not change a thing
    assert _json("check", "--url", pool_url, "--deep", "--fix")["fixed"] == {}  # indeed


def test_doctor_prints_no_secret_written_into_the_config_it_checks(token_pool, tmp_path):
    url, bare, _, _ = token_pool
    config = yaml.safe_load(kvpool("lmcache-config", "--url", bare).stdout)
    key = "remote_storage_plugin.kvpool.url"
    config["extra_config"][key] = url  # the token written inline, as the doctor's warning says not to
    inline = tmp_path / "inline.yaml"
    inline.write_text(yaml.safe_dump(config))
    out = kvpool("doctor", "--lmcache-config", str(inline), "--verbose", timeout=180)
    assert out.returncode == 0, out.stdout  # the whole way: config, Redis, nodes, a round trip with the token
    shown = out.stdout + out.stderr
    assert "LMCache Configuration" in shown  # --verbose: LMCache's config dump is printed, masked
    assert TOKEN not in shown
    assert "kvpool://:***@" in shown
