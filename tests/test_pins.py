"""Pins (docs/fleet.md): real node processes, a real redis-server, the admin verbs and the CLI.

A pinned chunk survives pressure that evicts everything else; its ttl's end makes it evictable
again; pins are reference-counted; a node full of pins answers puts with no room; pins survive
a node restart with NVMe (the chunk too) and a Redis loss. The codec and the ttl rules are
checked in-process.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from backend import admin
from backend.embedded import EmbeddedRedis
from backend.errors import ConfigError, KVPoolError, ProtocolError
from backend.node.store.leases import LeaseTable
from backend.node.store.pins import PinOwner, PinTtl
from backend.protocol import Status
from backend.protocol.frame import status_for_error
from backend.protocol.pins import Pin, PinRequest, Pins
from kvpool import CapacityError, PoolClient, PoolConfig
from tests.support.chunks import numbered_chunks
from tests.support.cli import kvpool
from tests.support.waits import wait_until

CHUNK = 128 * 1024


async def _held(client: PoolClient, keys: list[str]) -> list[bool]:
    return await client.contains(keys)


async def _pressure(client: PoolClient, name: str, count: int = 16) -> None:
    """Put ``count`` chunks of CHUNK bytes one at a time: twice a 1 MiB DRAM tier."""
    for chunk in numbered_chunks(name, count, CHUNK, seed=7):
        await client.put([chunk])


async def test_a_pinned_chunk_survives_pressure_that_evicts_everything_else(node_factory, pool_url):
    node_factory(dram="1MiB")
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        kept, other = numbered_chunks("keep", 2, CHUNK)
        await client.put([kept, other])
        report = await admin.pin(client, [kept.key], ttl_s=60)
        assert (report.keys, report.copies, report.ttl_s) == (1, 1, 60.0)
        await _pressure(client, "press")
        assert await _held(client, [kept.key, other.key]) == [True, False]
        got = await client.get([kept.key])
        assert got[0] is not None and bytes(got[0].data) == bytes(kept.data)
        node = (await client.nodes())[0]
        stats = await client.node_admin.stats(node)
        assert (stats.pinned_chunks, stats.pinned_bytes) == (1, CHUNK)
        assert stats.counters.get("evictions", 0) >= 8  # the pressure did evict: everything else


async def test_the_end_of_its_ttl_makes_a_pinned_chunk_evictable_again(node_factory, pool_url):
    node_factory(dram="1MiB")
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        (kept,) = numbered_chunks("ttl", 1, CHUNK)
        await client.put([kept])
        await admin.pin(client, [kept.key], ttl_s=0.3)
        assert [row.pin.key for row in await admin.list_pins(client)] == [kept.key]
        deadline = time.monotonic() + 5  # the node ends expired pins once a second, and on every look
        while await admin.list_pins(client) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await admin.list_pins(client) == []
        await _pressure(client, "press")
        assert await _held(client, [kept.key]) == [False]


async def test_two_pins_one_unpin_still_pinned_and_the_second_unpin_lets_go(node_factory, pool_url):
    node_factory(dram="1MiB")
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        (kept,) = numbered_chunks("refs", 1, CHUNK)
        await client.put([kept])
        await admin.pin(client, [kept.key], owner="a")
        await admin.pin(client, [kept.key], owner="a")
        assert [(r.pin.owner, r.pin.refs) for r in await admin.list_pins(client)] == [("a", 2)]
        assert (await admin.unpin(client, [kept.key], owner="b")).not_pinned == (kept.key,)  # not b's pin
        assert (await admin.unpin(client, [kept.key], owner="a")).unpinned == 1
        assert [(r.pin.owner, r.pin.refs) for r in await admin.list_pins(client)] == [("a", 1)]
        await _pressure(client, "press1")
        assert await _held(client, [kept.key]) == [True]
        await admin.unpin(client, [kept.key], owner="a")
        assert await admin.list_pins(client) == []
        await _pressure(client, "press2")
        assert await _held(client, [kept.key]) == [False]


async def test_a_node_full_of_pins_answers_puts_with_no_room(node_factory, pool_url):
    node_factory(dram="1MiB")
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        chunks = numbered_chunks("full", 8, CHUNK)  # exactly the DRAM tier
        for chunk in chunks:
            await client.put([chunk])
        assert await _held(client, [c.key for c in chunks]) == [True] * 8
        await admin.pin(client, prefix="full@")
        with pytest.raises(CapacityError) as caught:
            await client.put(numbered_chunks("late", 1, CHUNK))
        assert "no room" in str(caught.value)
        assert await _held(client, [c.key for c in chunks]) == [True] * 8


async def test_a_ttl_one_node_refuses_pins_nothing_on_any_node(node_factory, pool_url):
    node_factory("--pin-ttl-max-s", "100000", "--node-id", "lenient")
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        only, both = numbered_chunks("caps", 2, CHUNK)
        await client.put([only])  # on "lenient" alone: it comes first among the holders
    node_factory("--pin-ttl-max-s", "3600", "--node-id", "strict")
    async with PoolClient(PoolConfig.from_url(pool_url + "?replicas=2")) as client:
        await client.put([both])
        assert {loc.node_id for loc in (await client.index.lookup([both.key]))[0]} == {"lenient", "strict"}
        with pytest.raises(ConfigError, match=r"--ttl: node strict .* ttl_s 7200 s is over this node's cap of 3600 s"):
            await admin.pin(client, [only.key, both.key], owner="ops", ttl_s=7200)
        assert await admin.list_pins(client) == []  # what "lenient" had pinned was let go again
        report = await admin.pin(client, [only.key, both.key], owner="ops", ttl_s=600)  # the connection is back
        assert (report.keys, report.copies, report.nodes) == (2, 3, ("lenient", "strict"))


async def test_pins_and_their_chunks_survive_a_node_restart_with_nvme(node_factory, pool_url, tmp_path):
    args = ("--nvme-dir", str(tmp_path / "nvme"), "--nvme", "64MiB", "--node-id", "pinned-node")
    node = node_factory(*args, dram="1MiB")
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        kept, other = numbered_chunks("restart", 2, CHUNK)
        await client.put([kept, other])
        await admin.pin(client, [kept.key], owner="ops", ttl_s=600)
        saved = json.loads((tmp_path / "nvme" / "pins.json").read_text())
        assert [(p["owner"], p["keys"]) for p in saved["pins"]] == [("ops", [kept.key])]
    node.kill()  # a crash: nothing is written on the way out
    node_factory(*args, dram="1MiB")
    async with PoolClient(PoolConfig.from_url(pool_url)) as client:
        rows = await admin.list_pins(client)
        assert [(r.node_id, r.pin.key, r.pin.owner, r.pin.refs) for r in rows] == [("pinned-node", kept.key, "ops", 1)]
        assert 590 < (rows[0].pin.expires_in_s or 0) <= 600
        # The chunk was only in DRAM when it was pinned: it got its NVMe file then, and recovery brings it back.
        deadline = time.monotonic() + 10
        while not (await admin.list_pins(client))[0].pin.tier and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (await admin.list_pins(client))[0].pin.tier == "nvme"
        got = await client.get([kept.key])
        assert got[0] is not None and bytes(got[0].data) == bytes(kept.data)


def test_pins_hold_through_a_redis_loss(node_factory, redis_factory):
    redis = EmbeddedRedis().start()
    redis_factory.append(redis)
    node_factory(redis_url=redis.url, ns="pr", dram="1MiB")
    url = f"kvpool://127.0.0.1:{redis.port}/pr?progress_timeout_s=2"
    (kept,) = numbered_chunks("redis", 1, CHUNK)

    async def before() -> None:
        async with PoolClient(PoolConfig.from_url(url)) as client:
            await client.put([kept])
            await admin.pin(client, [kept.key])

    asyncio.run(before())
    redis.kill()
    restarted = EmbeddedRedis(redis.port)
    redis_factory.append(restarted)
    restarted.start()  # empty: the node republishes what it holds; its pins were never in Redis

    async def republished() -> bool:
        async with PoolClient(PoolConfig.from_url(url)) as client:
            return await client.contains([kept.key]) == [True]

    assert wait_until(lambda: asyncio.run(republished()), 20)

    async def after() -> None:
        async with PoolClient(PoolConfig.from_url(url)) as client:
            assert [r.pin.key for r in await admin.list_pins(client)] == [kept.key]
            await _pressure(client, "press")
            assert await client.contains([kept.key]) == [True]

    asyncio.run(after())


@pytest.mark.usefixtures("processes")
def test_the_pin_verbs_output_and_exit_codes(node_factory, pool_url):
    node_factory("--pin-ttl-max-s", "3600")
    (chunk,) = numbered_chunks("cli", 1, 1000)

    async def put() -> None:
        async with PoolClient(PoolConfig.from_url(pool_url)) as client:
            await client.put([chunk])

    asyncio.run(put())
    env = {"KVPOOL_URL": pool_url}
    done = kvpool("pin", chunk.key, "--ttl", "120", "--owner", "ops", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pinned 1 keys (1 copies on 1 nodes) for owner ops, for 120 s"
    listed = kvpool("pins", "--json", env=env)
    assert listed.returncode == 0
    (row,) = json.loads(listed.stdout)
    assert (row["key"], row["owner"], row["refs"], row["nbytes"], row["tier"]) == (chunk.key, "ops", 1, 1000, "dram")
    assert 100 < row["expires_in_s"] <= 120
    assert chunk.key in kvpool("pins", env=env).stdout

    # A ttl the node refuses is bad input: a usage error naming the ttl and the cap, and nothing pinned.
    over = kvpool("pin", chunk.key, "--ttl", "7200", "--owner", "ops", env=env)
    assert over.returncode == 2, over.stderr
    assert "--ttl: node " in over.stderr and "ttl_s 7200 s is over this node's cap of 3600 s" in over.stderr
    assert "INTERNAL" not in over.stderr and "Traceback" not in over.stderr
    forever = kvpool("pin", chunk.key, "--ttl", "0", "--owner", "ops", env=env)
    assert forever.returncode == 2 and "ttl_s 0 (no expiry) is over this node's cap of 3600 s" in forever.stderr
    (row,) = json.loads(kvpool("pins", "--json", env=env).stdout)
    assert (row["owner"], row["refs"]) == ("ops", 1)  # the first pin only: the refused ones took nothing
    negative = kvpool("pin", chunk.key, "--ttl", "-5", env=env)
    assert negative.returncode == 2 and "--ttl: -5 is not a number of seconds >= 0" in negative.stderr
    for bad_owner in ("", "x" * 129, "o p"):
        owner = kvpool("pin", chunk.key, "--owner", bad_owner, env=env)
        assert owner.returncode == 2 and "--owner: pin owner" in owner.stderr, (bad_owner, owner.stderr)
    empty = kvpool("pin", "--prefix", "", env=env)
    assert empty.returncode == 2 and "--prefix: is empty" in empty.stderr
    unknown = kvpool("pin", "no-such-key", env=env)
    assert unknown.returncode == 2 and "'no-such-key' is not held by any live node" in unknown.stderr
    none = kvpool("pin", "--prefix", "zzz", env=env)
    assert none.returncode == 2 and "no key in the pool index starts with 'zzz'" in none.stderr

    not_mine = kvpool("unpin", chunk.key, env=env)  # owner "default" pins nothing
    assert not_mine.returncode == 1 and "is not pinned by owner default on any live node" in not_mine.stderr
    done = kvpool("unpin", chunk.key, "--owner", "ops", env=env)
    assert done.returncode == 0 and done.stdout.strip() == "unpinned 1 keys for owner ops"
    assert kvpool("pins", env=env).stdout.strip() == "no pins"


def test_pin_ttl_rules_name_what_is_wrong():
    capped = PinTtl(default_s=1800, max_s=86400)
    assert capped.applied(None) == 1800 and capped.applied(5) == 5
    # Bad input, refused at protocol level (a PROTOCOL error frame), never a node failure (INTERNAL).
    with pytest.raises(ProtocolError, match="ttl_s 86401 s is over this node's cap of 86400 s"):
        capped.applied(86401)
    with pytest.raises(ProtocolError, match="ttl_s 0 \\(no expiry\\) is over this node's cap of 86400 s"):
        capped.applied(0)
    with pytest.raises(ProtocolError, match="ttl_s -1 is not a number of seconds >= 0"):
        capped.applied(-1)
    assert status_for_error(ProtocolError("x")) == Status.PROTOCOL
    assert PinTtl(default_s=0, max_s=0).applied(None) == math.inf


def test_pins_are_leases_of_no_connection_counted_per_key():
    table = LeaseTable()
    owner = PinOwner("ops")
    first = table.hold({"k"}, owner, math.inf)
    table.hold({"k", "j"}, owner, time.monotonic() + 60)
    assert table.pinned == {"k": 2, "j": 1}
    assert table.release_one(owner, "k") and table.pinned == {"k": 1, "j": 1}  # the newest pin let go of k
    assert table.owned_by(owner)[0].lease_id == first
    assert not table.release_one(PinOwner("other"), "k")
    table.hold({"x"}, owner, time.monotonic() - 1)
    table.expire()
    assert "x" not in table.pinned and table.pinned == {"k": 1, "j": 1}


def test_pin_codec_refuses_a_bad_owner_ttl_or_page():
    meta = Pin.encode_request(PinRequest("ops", ("a", "b"), None))
    assert Pin.decode_request(meta) == PinRequest("ops", ("a", "b"), None)
    with pytest.raises(ProtocolError, match="pin owner"):
        Pin.decode_request(meta.replace(b'"ops"', b'"o p"'))
    with pytest.raises(ProtocolError, match="ttl_s -1"):
        Pin.decode_request(meta.replace(b'"ttl_s":null', b'"ttl_s":-1'))
    with pytest.raises(ProtocolError, match=r"wants 1\.\.4096 keys"):
        Pin.decode_request(meta.replace(b'["a","b"]', b"[]"))
    assert Pins.decode_request(Pins.encode_request("p", ("k", "o"), 5)) == ("p", ("k", "o"), 5)
    with pytest.raises(ProtocolError, match="PINS limit"):
        Pins.encode_request(limit=0)
    with pytest.raises(KVPoolError):
        Pins.decode_request(b'{"limit": 0}')
