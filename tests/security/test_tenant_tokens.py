"""Token rotation and tenant tokens (docs/security.md, "Rotating the token" and "Tenant tokens").

Rotation: a node given a second pool token (``--token-file-next``) accepts clients of either,
the key id in AUTH naming which one a client proves; once restarted without the old token,
its clients are refused and counted. Tenant tokens (``--tenant-tokens DIR``): a connection
that proved tenant NAME's token touches only keys ``~t/NAME/...``, whatever key it names, and
never the node's arena, stages or channel; the pool token still touches every tenant's keys.
Real redis-server and node processes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backend.config import NodeConfig
from backend.protocol import Op
from backend.protocol.channel import ChannelGet
from backend.protocol.inventory import Inventory
from backend.protocol.meta import decode_flags, decode_json, encode_keys
from backend.protocol.pins import Pin, PinRequest, Unpin
from backend.protocol.puts import PutStaged
from backend.protocol.reads import LEASE_MAP, GetBatch, Lease, Release, Touch
from backend.tenants import scoped
from kvpool import AuthError, Chunk, ConfigError, PoolClient, PoolConfig

OLD = "old-token-" + "a1" * 16
NEW = "new-token-" + "b2" * 16
POOL = "pool-token-" + "c3" * 16
ALICE = "alice-token-" + "d4" * 16
BOB = "bob-token-" + "e5" * 16


def _file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return path


def _tenant_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tenants"
    directory.mkdir()
    _file(directory / "alice", ALICE)
    _file(directory / "bob", BOB)
    return directory


def _client(pool_url: str, token: str, tenant: str = "", **options: str) -> PoolClient:
    url = pool_url.replace("kvpool://", f"kvpool://:{token}@")
    query = {**({"tenant": tenant} if tenant else {}), **options}
    if query:
        url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
    return PoolClient(PoolConfig.from_url(url))


async def _counter(client: PoolClient, name: str) -> int:
    node = (await client.nodes(refresh=True))[0]
    return int((await client.node_stats(node))["counters"].get(name, 0))


# -- rotation -------------------------------------------------------------------------------
async def test_during_a_rotation_old_and_new_tokens_both_work_and_after_it_the_old_one_is_refused(
    node_factory, pool_url, namespace, tmp_path
):
    old_file, new_file = _file(tmp_path / "old", OLD), _file(tmp_path / "new", NEW)
    rotating = node_factory("--token-file", str(old_file), "--token-file-next", str(new_file))
    async with _client(pool_url, OLD) as old, _client(pool_url, NEW) as new:
        await old.put([Chunk("from-old", b"written with the old token")])
        await new.put([Chunk("from-new", b"written with the new token")])
        for client in (old, new):
            got = await client.get(["from-old", "from-new"])
            assert [bytes(c.data) for c in got if c is not None] == [
                b"written with the old token",
                b"written with the new token",
            ]
        assert await _counter(new, "auth_failures") == 0
    rotating.kill()
    # The rotation's end: the node restarted without the old token (in a namespace of its own here, so
    # that the killed node's registry entry, alive until its heartbeat lapses, takes no put).
    after_ns = namespace + "-after"
    node_factory("--token-file", str(new_file), ns=after_ns)
    after_url = pool_url.replace(f"/{namespace}", f"/{after_ns}")
    async with _client(after_url, OLD) as old, _client(after_url, NEW) as new:
        node = (await new.nodes(refresh=True))[0]
        with pytest.raises(AuthError, match="does not hold"):
            await old.node_stats(node)
        await new.put([Chunk("after", b"new token only")])
        assert bytes((await new.get(["after"]))[0].data) == b"new token only"  # type: ignore[union-attr]
        assert (await new.node_stats(node))["counters"]["auth_failures"] >= 1


def test_a_second_token_needs_a_first_and_is_checked_like_it(tmp_path, redis_server):
    new_file = _file(tmp_path / "new", NEW)
    with pytest.raises(ConfigError, match="give --token-file too") as refused:
        NodeConfig.from_sources({"redis": redis_server.url, "token_file_next": str(new_file)}, environ={})
    assert refused.value.key == "--token-file-next"
    short = _file(tmp_path / "short", "t0k3n")
    with pytest.raises(ConfigError, match="at least 16") as refused:
        NodeConfig.from_sources(
            {"redis": redis_server.url, "token_file": str(new_file), "token_file_next": str(short)}, environ={}
        )
    assert refused.value.key == "--token-file-next"


# -- tenant tokens: configuration --------------------------------------------------------------
def test_tenant_tokens_are_read_from_a_directory_and_refused_when_ambiguous_or_alone(tmp_path, redis_server):
    pool_file, tenants = _file(tmp_path / "pool", POOL), _tenant_dir(tmp_path)
    (tenants / "..data").mkdir()  # a Kubernetes secret volume's own entries are skipped
    config = NodeConfig.from_sources(
        {"redis": redis_server.url, "token_file": str(pool_file), "tenant_tokens": str(tenants)}, environ={}
    )
    assert dict(config.tenant_tokens) == {"alice": ALICE, "bob": BOB}
    assert ALICE not in repr(config) and BOB not in repr(config)
    with pytest.raises(ConfigError, match="need the pool token") as refused:
        NodeConfig.from_sources({"redis": redis_server.url, "tenant_tokens": str(tenants)}, environ={})
    assert refused.value.key == "--tenant-tokens"
    _file(tenants / "carol", POOL)
    with pytest.raises(ConfigError, match="carol's token is also the pool token"):
        NodeConfig.from_sources(
            {"redis": redis_server.url, "token_file": str(pool_file), "tenant_tokens": str(tenants)}, environ={}
        )
    (tenants / "carol").unlink()
    _file(tenants / "not a tenant", "x" * 40)
    with pytest.raises(ConfigError, match="A-Z a-z 0-9") as refused:
        NodeConfig.from_sources(
            {"redis": redis_server.url, "token_file": str(pool_file), "tenant_tokens": str(tenants)}, environ={}
        )
    assert "not a tenant" in str(refused.value)


# -- a tenant token's rotation ------------------------------------------------------------------
ALICE_NEXT = "alice-next-token-" + "f6" * 16


async def test_during_a_tenants_rotation_both_its_tokens_touch_only_its_keys_and_after_it_the_old_one_is_refused(
    node_factory, pool_url, namespace, tmp_path
):
    pool_file, tenants = _file(tmp_path / "pool", POOL), _tenant_dir(tmp_path)
    _file(tenants / "alice.next", ALICE_NEXT)
    rotating = node_factory("--token-file", str(pool_file), "--tenant-tokens", str(tenants))
    async with (
        _client(pool_url, ALICE, "alice") as old,
        _client(pool_url, ALICE_NEXT, "alice") as new,
        _client(pool_url, ALICE_NEXT) as rogue,  # the new token, naming bob's key raw
        _client(pool_url, BOB, "bob") as bob,
    ):
        await old.put([Chunk("k-old", b"put with alice's old token")])
        await new.put([Chunk("k-new", b"put with alice's new token")])
        await bob.put([Chunk("k", b"bob's bytes")])
        for client in (old, new):
            got = await client.get(["k-old", "k-new"])
            assert [bytes(c.data) for c in got if c is not None] == [
                b"put with alice's old token",
                b"put with alice's new token",
            ]
        node = (await new.nodes(refresh=True))[0]
        assert old.connections.to(node).tenant == new.connections.to(node).tenant == "alice"
        with pytest.raises(AuthError, match="only keys ~t/alice/KEY, not '~t/bob/k'"):
            await rogue.connections.to(node).request(Op.GET_BATCH, GetBatch.encode_request([scoped("bob", "k")], 0))
        with pytest.raises(Exception, match="only keys ~t/alice/KEY"):
            await rogue.put([Chunk(scoped("bob", "k"), b"rogue bytes")])
        assert bytes((await bob.get(["k"]))[0].data) == b"bob's bytes"  # type: ignore[union-attr]
    rotating.kill()
    # The rotation's end: DIR/alice holds the new token, no .next; the node restarted (in a namespace of its
    # own here, so that the killed node's registry entry, alive until its heartbeat lapses, takes no put).
    _file(tenants / "alice", ALICE_NEXT)
    (tenants / "alice.next").unlink()
    after_ns = namespace + "-after"
    node_factory("--token-file", str(pool_file), "--tenant-tokens", str(tenants), ns=after_ns)
    after_url = pool_url.replace(f"/{namespace}", f"/{after_ns}")
    async with (
        _client(after_url, ALICE, "alice") as old,
        _client(after_url, ALICE_NEXT, "alice") as new,
        _client(after_url, POOL) as operator,
    ):
        node = (await new.nodes(refresh=True))[0]
        with pytest.raises(AuthError, match="does not hold"):
            await old.put([Chunk("late", b"old token")])
        await new.put([Chunk("after", b"new token only")])
        assert bytes((await new.get(["after"]))[0].data) == b"new token only"  # type: ignore[union-attr]
        assert new.connections.to(node).tenant == "alice"
        assert (await operator.node_stats(node))["counters"]["auth_failures"] >= 1


def test_a_tenants_next_token_without_its_token_or_equal_to_another_stops_the_node_naming_the_file(
    tmp_path, redis_server
):
    pool_file, tenants = _file(tmp_path / "pool", POOL), _tenant_dir(tmp_path)
    flags = {"redis": redis_server.url, "token_file": str(pool_file), "tenant_tokens": str(tenants)}
    _file(tenants / "alice.next", ALICE_NEXT)
    config = NodeConfig.from_sources(flags, environ={})
    assert dict(config.tenant_tokens) == {"alice": ALICE, "bob": BOB}
    assert dict(config.tenant_tokens_next) == {"alice": ALICE_NEXT}
    assert ALICE_NEXT not in repr(config)
    _file(tenants / "carol.next", "carol-next-token-" + "a7" * 16)
    with pytest.raises(ConfigError, match=r"carol\.next is tenant carol's next token .*/carol is missing") as refused:
        NodeConfig.from_sources(flags, environ={})
    assert refused.value.key == "--tenant-tokens" and str(tenants) in str(refused.value)
    (tenants / "carol.next").unlink()
    _file(tenants / "bob.next", ALICE_NEXT)  # one token for two tenants
    with pytest.raises(ConfigError, match="every token must name one tenant"):
        NodeConfig.from_sources(flags, environ={})
    _file(tenants / "bob.next", BOB)  # a rotation's two tokens must differ
    with pytest.raises(ConfigError, match=r"bob's next token is also tenant bob's token \(.*bob.next\)"):
        NodeConfig.from_sources(flags, environ={})
    (tenants / "bob.next").unlink()
    _file(tenants / "not a tenant.next", "x" * 40)
    with pytest.raises(ConfigError, match="A-Z a-z 0-9") as refused:
        NodeConfig.from_sources(flags, environ={})
    assert "not a tenant.next" in str(refused.value)


# -- tenant tokens: what a tenant's connection may touch -----------------------------------------
@pytest.fixture
def tenant_node(node_factory, tmp_path):
    pool_file, tenants = _file(tmp_path / "pool", POOL), _tenant_dir(tmp_path)
    return node_factory("--token-file", str(pool_file), "--tenant-tokens", str(tenants), shm=True)


async def test_a_tenant_token_touches_only_its_tenants_keys_even_naming_anothers(tenant_node, pool_url):
    async with (
        _client(pool_url, POOL) as operator,
        _client(pool_url, ALICE, "alice") as alice,
        _client(pool_url, BOB, "bob") as bob,
        _client(pool_url, ALICE) as rogue,  # alice's token, naming raw keys: bob's included
    ):
        await alice.put([Chunk("k", b"alice's bytes")])
        await bob.put([Chunk("k", b"bob's bytes")])
        assert bytes((await alice.get(["k"]))[0].data) == b"alice's bytes"  # type: ignore[union-attr]
        assert bytes((await bob.get(["k"]))[0].data) == b"bob's bytes"  # type: ignore[union-attr]
        node = (await rogue.nodes(refresh=True))[0]
        conns = rogue.connections.to(node)
        bobs_key = scoped("bob", "k")
        refused_before = await _counter(operator, "tenant_refusals")
        for op, meta in (
            (Op.GET_BATCH, GetBatch.encode_request([bobs_key], 0)),
            (Op.EXISTS_BATCH, encode_keys([bobs_key])),
            (Op.DELETE_BATCH, encode_keys([bobs_key])),
            (Op.VERIFY_BATCH, encode_keys([bobs_key])),
            (Op.LEASE, Lease.encode_request([bobs_key], 1000, 0)),
            (Op.TOUCH, Touch.encode_request([[bobs_key]])),
            (Op.PIN, Pin.encode_request(PinRequest("rogue", (bobs_key,), 60.0))),
            (Op.UNPIN, Unpin.encode_request("bob-engine", [bobs_key])),
            (Op.GET_BATCH, GetBatch.encode_request([scoped("alice", "k"), bobs_key], 0)),  # one foreign key is enough
        ):
            with pytest.raises(AuthError, match="only keys ~t/alice/KEY, not '~t/bob/k'"):
                await conns.request(op, meta)
        with pytest.raises(Exception, match="only keys ~t/alice/KEY"):
            await rogue.put([Chunk(bobs_key, b"rogue bytes")])
        # Its own tenant's key, named raw, is its own: the node scopes by the token, not the client's word.
        assert decode_flags(await conns.request(Op.EXISTS_BATCH, encode_keys([scoped("alice", "k")])), 1) == [1]
        # Nothing of bob's changed, and the operator's token still reaches every tenant.
        assert bytes((await bob.get(["k"]))[0].data) == b"bob's bytes"  # type: ignore[union-attr]
        got = await operator.get([scoped("alice", "k"), bobs_key])
        assert [bytes(c.data) for c in got if c is not None] == [b"alice's bytes", b"bob's bytes"]
        assert sorted(await operator.list_keys()) == [scoped("alice", "k"), bobs_key]
        assert await _counter(operator, "tenant_refusals") >= refused_before + 10
        # A lease of another connection is not the tenant's to end, even by its id.
        lease = await operator.connections.to(node).request(Op.LEASE, Lease.encode_request([bobs_key], 60_000, 0))
        lease_id, _ = Lease.decode_answer(lease, [bobs_key])
        assert lease_id
        assert decode_json(await conns.request(Op.RELEASE, Release.encode_request(lease_id))) == {"released": 0}
        assert decode_json(
            await operator.connections.to(node).request(Op.RELEASE, Release.encode_request(lease_id))
        ) == {"released": 1}


async def test_a_tenant_token_gets_no_arena_stage_channel_or_listing_and_reads_over_tcp(tenant_node, pool_url):
    async with _client(pool_url, POOL) as operator, _client(pool_url, ALICE, "alice") as alice:
        node = (await alice.nodes(refresh=True))[0]
        assert node.shm_path  # the node serves an arena on this host: the operator maps it
        # Same host, same user: the client would map the arena; the tenant's token makes it use TCP.
        await alice.put([Chunk("k", b"x" * 4096)])
        assert bytes((await alice.get(["k"]))[0].data) == b"x" * 4096  # type: ignore[union-attr]
        assert alice.connections.to(node).tenant == "alice"
        assert not alice.arena.serves(node)
        conns = alice.connections.to(node)
        own = scoped("alice", "k")
        with pytest.raises(AuthError, match="mapped read"):
            await conns.request(Op.LEASE, Lease.encode_request([own], 1000, LEASE_MAP, fingerprint=0))
        for op, meta in (
            (Op.PUT_STAGED, PutStaged.encode_request("kvpool-stage-x", "t" * 32, [], [])),
            (Op.CHANNEL_GET, ChannelGet.encode_request("pair", [own], fingerprint=0)),
            (Op.INVENTORY, Inventory.encode_request("", 10)),
            (Op.PINS, b"{}"),
            (Op.EVENTS, b"{}"),
            (Op.STAT, b""),
        ):
            with pytest.raises(AuthError, match=f"{op.name} is refused .* tenant alice's token"):
                await conns.request(op, meta)
        # The operator's token maps the same chunk's region.
        lease = await operator.connections.to(node).request(
            Op.LEASE, Lease.encode_request([own], 1000, LEASE_MAP, fingerprint=0)
        )
        _, found = Lease.decode_answer(lease, [own], fingerprints=True)
        assert found[0] is not None
