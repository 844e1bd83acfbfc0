"""KV events for routers (docs/fleet-events.md, "Events for routers"): real node processes, a real redis-server,
the endpoint on real ZMQ sockets, and a consumer written from vLLM's format (tests/support/vllm_events.py).

The stream is checked against the pool itself: a mirror rebuilt from it holds exactly the blocks the
live nodes' inventories hold, after puts, evictions, deletes, a node's death, a subscriber's reconnect
(replay) and a late subscriber (snapshot). A subscriber without the token gets nothing. vLLM's own
bytes (tests/data/vllm_events) decode, and the endpoint's encoder gives the same bytes.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import logging
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from backend.cli.exits import EXIT_USAGE
from backend.cli.main import main
from backend.errors import ConfigError, NodeUnavailable
from backend.events import WIRE_FORMS, EndpointConfig, EventsEndpoint, curve_keys
from backend.events.keys import block_of
from backend.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, Wire
from backend.node.events import EventRing
from kvpool import Chunk, PoolClient, PoolConfig
from tests.support import vllm_events
from tests.support.cli import REPO, events_addresses
from tests.support.waits import until

TOKEN = "events-token-0123456789abcdef0123456789"
MODEL = "llama-test"
CHUNK = 64 * 1024
GOLDEN = Path(__file__).parent / "data" / "vllm_events"
RING = ("--event-ring-keys", "100000")


def chunks(first: int, count: int, seed: int = 0, model: str = MODEL) -> list[Chunk]:
    rng = random.Random(seed + first)
    return [Chunk(f"{model}@1@0@{h:x}@bfloat16", rng.randbytes(CHUNK)) for h in range(first, first + count)]


def config(pool_url: str) -> PoolConfig:
    return PoolConfig.from_url(pool_url, {"KVPOOL_TOKEN": TOKEN})


async def pool_blocks(client: PoolClient) -> set[int]:
    """The blocks of MODEL the live nodes hold, from their inventories: what the stream must rebuild."""
    blocks: set[int] = set()
    for node in await client.nodes(refresh=True):
        async for page in client.node_admin.inventory_pages(node):
            for row in page:
                ref = block_of(row.key)
                if ref is not None and ref.model == MODEL:
                    blocks.add(ref.block_hash)
    return blocks


@contextlib.asynccontextmanager
async def endpoint(pool_url: str, **options: object) -> AsyncIterator[EventsEndpoint]:
    ep = EventsEndpoint(
        config(pool_url),
        EndpointConfig(
            model=MODEL,
            publish="tcp://127.0.0.1:*",
            replay="tcp://127.0.0.1:*",
            poll_interval_s=0.05,
            **options,  # type: ignore[arg-type]
        ),
    )
    ep.bind()
    task = asyncio.create_task(ep.run())
    try:
        yield ep
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ep.close()


def subscriber(
    ctx: zmq.asyncio.Context, ep: EventsEndpoint, token: str | None = TOKEN, array: bool = False
) -> vllm_events.Subscriber:
    keys = None
    if token is not None:
        k = curve_keys(token, ep.pool.namespace)
        keys = (k.server_public, k.client_public, k.client_secret)
    return vllm_events.Subscriber(ctx, ep.publish_address, ep.replay_address, ep.topic, keys, array=array)


async def joined(sub: vllm_events.Subscriber, start: int = 0) -> list[int]:
    """Let the SUB socket's subscription reach the endpoint, then replay from ``start``."""
    await asyncio.sleep(0.3)  # ZMQ's slow joiner: a subscription takes a moment to reach the PUB side
    return await sub.replay(start)


async def in_step(sub: vllm_events.Subscriber, client: PoolClient, timeout_s: float = 15.0) -> None:
    """Wait until the stream's mirror holds exactly what the pool holds (and the pool holds something
    of what was asked, so an empty stream cannot pass); a contiguous sequence throughout."""

    async def probe() -> bool:
        await sub.drain()
        try:
            return sub.mirror.blocks == await pool_blocks(client)
        except NodeUnavailable:  # a killed node the registry still lists: not settled yet
            return False

    await until(probe, timeout_s=timeout_s)
    assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs))) if sub.seqs else True


async def test_the_stream_rebuilds_the_pool_through_puts_evictions_deletes_and_a_node_death(node_factory, pool_url):
    env = {"KVPOOL_TOKEN": TOKEN}
    node_factory(*RING, dram="1MiB", env=env)  # 16 chunks of 64 KiB: puts past that evict
    second = node_factory(*RING, dram="2MiB", env=env)
    ctx = zmq.asyncio.Context()
    async with PoolClient(config(pool_url)) as client, endpoint(pool_url) as ep:
        sub = subscriber(ctx, ep)
        try:
            await joined(sub)
            await client.put(chunks(0, 8))
            await in_step(sub, client)
            assert len(sub.mirror.blocks) == 8
            stored = sub.mirror.stored_events[-1]
            assert (stored.block_size, stored.medium, stored.group_idx, stored.kv_cache_spec_kind) == (
                256,
                "CPU",
                0,
                "full_attention",
            )
            # No chain is claimed: a node sees only the chunks of a put it took (docs/fleet-events.md).
            assert all(len(e.block_hashes) == 1 and e.parent_block_hash is None for e in sub.mirror.stored_events)

            for first in range(100, 400, 10):  # far past the small node's DRAM: it evicts
                await client.put(chunks(first, 10))
            await in_step(sub, client)
            stats = [await client.node_admin.stats(n) for n in await client.nodes(refresh=True)]
            assert sum(s.counters.get("evictions", 0) for s in stats) > 0, "the pressure evicted"

            doomed = [c.key for c in chunks(0, 4)] + [c.key for c in chunks(300, 5)]
            await client.delete(doomed)
            await in_step(sub, client)
            assert not {0, 1, 2, 3, 300, 301, 302, 303, 304} & sub.mirror.blocks

            before = await pool_blocks(client)
            second.kill()  # SIGKILL: its blocks go when the registry stops listing it
            await in_step(sub, client, timeout_s=20.0)
            assert sub.mirror.blocks < before, "the dead node's blocks were removed"
        finally:
            sub.close()
            ctx.destroy(linger=0)


async def test_a_reconnecting_subscriber_replays_and_a_late_one_gets_a_snapshot(node_factory, pool_url):
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})
    ctx = zmq.asyncio.Context()
    async with PoolClient(config(pool_url)) as client, endpoint(pool_url, replay_batches=4) as ep:
        first = subscriber(ctx, ep)
        try:
            await joined(first)
            await client.put(chunks(0, 4))
            await in_step(first, client)
            seen = first.mirror.last_seq
            first.close()  # dropped: what follows it misses

            await client.put(chunks(10, 3))
            await client.delete([c.key for c in chunks(0, 2)])
            # The endpoint published what was missed (it keeps the last 4 batches).

            async def caught_up() -> bool:
                return ep.view.blocks() == await pool_blocks(client)

            await until(caught_up, timeout_s=10)
            assert ep.last_seq > seen

            again = subscriber(ctx, ep)
            again.mirror.blocks, again.mirror.last_seq = set(first.mirror.blocks), seen
            replayed = await joined(again, seen + 1)
            assert replayed and replayed[0] == seen + 1, f"kept batches from {seen + 1} came back: {replayed}"
            await in_step(again, client)

            for first_hash in range(100, 160, 6):  # more batches than the endpoint keeps
                await client.put(chunks(first_hash, 6))
                await asyncio.sleep(0.1)
            before = ep.last_seq
            late = subscriber(ctx, ep)
            got = await joined(late, 0)
            assert len(got) == 1, "a late subscriber gets one snapshot batch, not history"
            assert got[0] > before, "the snapshot has a sequence of its own: no number is reused for another payload"
            assert got[0] == late.mirror.last_seq
            await in_step(late, client)
            assert len(late.mirror.blocks) > 40
            await in_step(again, client)  # contiguous: the snapshot came on the stream too, under its own number
            assert got[0] in again.seqs
            again.close()
            late.close()
        finally:
            ctx.destroy(linger=0)


async def test_only_the_newest_snapshot_is_kept_for_replays(node_factory, pool_url):
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})
    ctx = zmq.asyncio.Context()
    async with PoolClient(config(pool_url)) as client, endpoint(pool_url, replay_batches=3) as ep:
        subs = [subscriber(ctx, ep) for _ in range(3)]
        try:
            for first in range(0, 40, 10):  # four batches at least: the first ones leave what is kept
                seen = ep.last_seq
                await client.put(chunks(first, 2))
                await until(lambda: ep.last_seq > seen, timeout_s=15.0)  # noqa: B023
            older = await subs[0].replay(0)
            newer = await subs[1].replay(0)
            assert len(older) == len(newer) == 1 and newer[0] > older[0], (older, newer)
            # The older snapshot is no longer kept: a replay from its number gets the newer one, which supersedes it.
            assert await subs[2].replay(older[0]) == [newer[0]]
            assert subs[2].mirror.blocks == await pool_blocks(client)
        finally:
            for sub in subs:
                sub.close()
            ctx.destroy(linger=0)


async def test_a_subscriber_without_the_token_gets_nothing(node_factory, pool_url):
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})
    ctx = zmq.asyncio.Context()
    async with PoolClient(config(pool_url)) as client, endpoint(pool_url) as ep:
        good = subscriber(ctx, ep)
        plain = subscriber(ctx, ep, token=None)
        wrong = subscriber(ctx, ep, token="another-token-0123456789abcdef0123456789")
        try:
            await joined(good)
            await asyncio.sleep(0.2)
            await client.put(chunks(0, 6))
            await in_step(good, client)
            # Nothing to await for a message that must not come: poll each for a second.
            assert await plain.sub.poll(1000) == 0 and await wrong.sub.poll(1000) == 0
            assert plain.replay_socket is not None
            try:  # once the CURVE handshake has failed the socket has no peer: a non-blocking send cannot leave
                await plain.replay_socket.send_multipart((b"", (0).to_bytes(8, "big")), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            assert await plain.replay_socket.poll(500) == 0
        finally:
            for s in (good, plain, wrong):
                s.close()
            ctx.destroy(linger=0)


async def test_a_stock_subscriber_reads_a_plain_endpoint_on_loopback_a_put_and_a_delete(node_factory, pool_url, caplog):
    """vLLM's conventions only (tests/support/vllm_events.py imports no kvpool): a plain SUB on the topic, a DEALER
    asking for a replay, vLLM 0.33's decoder; through a real node."""
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})
    put = chunks(0, 3)
    hashes = [block_of(c.key).block_hash for c in put]  # type: ignore[union-attr]
    ctx = zmq.asyncio.Context()
    with caplog.at_level(logging.WARNING, logger="backend.events.endpoint"):
        async with PoolClient(config(pool_url)) as client, endpoint(pool_url, plain=True) as ep:
            assert f"plain mode (--plain): no CURVE on {ep.publish_address} and {ep.replay_address}" in caplog.text
            sub = vllm_events.Subscriber(ctx, ep.publish_address, ep.replay_address, ep.topic, keys=None)
            try:
                replayed = await joined(sub)
                assert replayed[:1] == [0], "the replay answered from the first batch"
                await client.put(put)

                async def announced() -> bool:
                    await sub.drain()
                    return sub.mirror.blocks == set(hashes)

                await until(announced, timeout_s=15.0)
                stored = {h: e for e in sub.mirror.stored_events for h in e.block_hashes}
                for h in hashes:
                    event = stored[h]
                    # A put without an LMCache engine in the process has no token ids to announce (docs/fleet-events.md).
                    assert (event.token_ids, event.block_size, event.medium) == ([], 256, "CPU")

                await client.delete([put[0].key])

                async def removed() -> bool:
                    await sub.drain()
                    return [hashes[0]] in sub.mirror.removed

                await until(removed, timeout_s=15.0)
                assert sub.mirror.blocks == set(hashes[1:])
                assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
            finally:
                sub.close()
                ctx.destroy(linger=0)


def test_the_stock_subscriber_imports_nothing_of_kvpool():
    tree = ast.parse((REPO / "tests" / "support" / "vllm_events.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", "asyncio", "typing", "msgspec", "zmq", "zmq.asyncio"}


def test_plain_mode_is_refused_beyond_loopback_without_its_second_flag(pool_url, monkeypatch):
    for address in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557", "tcp://eth0:5557"):
        with pytest.raises(ConfigError, match=r"--plain: --publish .* is not a loopback address.*--plain-on-network"):
            EndpointConfig(model=MODEL, publish=address, plain=True)
        assert EndpointConfig(model=MODEL, publish=address, plain=True, plain_on_network=True).plain
    for address in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:5557", "ipc:///tmp/kvpool-ev"):
        assert EndpointConfig(model=MODEL, publish=address, plain=True).plain
    with pytest.raises(ConfigError, match="--plain: --replay tcp://"):
        EndpointConfig(model=MODEL, publish="tcp://127.0.0.1:1", replay="tcp://*:2", plain=True)
    with pytest.raises(ConfigError, match=r"--plain-on-network: .*--plain is not given"):
        EndpointConfig(model=MODEL, plain_on_network=True)
    with pytest.raises(ConfigError, match="--publish-next: a plain endpoint"):
        EndpointConfig(model=MODEL, publish="tcp://127.0.0.1:1", publish_next="tcp://127.0.0.1:2", plain=True)
    monkeypatch.setenv("KVPOOL_TOKEN", TOKEN)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["events", "--url", pool_url, "--model", MODEL, "--plain"])  # the default binds every interface
    assert code == EXIT_USAGE and "--plain: --publish tcp://*:5557 is not a loopback address" in err.getvalue()


async def test_the_older_all_array_form_is_a_setting(node_factory, pool_url):
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})
    ctx = zmq.asyncio.Context()
    async with PoolClient(config(pool_url)) as client, endpoint(pool_url, form="vllm-0.23") as ep:
        sub = subscriber(ctx, ep, array=True)
        try:
            await joined(sub)
            await client.put(chunks(0, 5))
            await in_step(sub, client)
            assert len(sub.mirror.blocks) == 5
        finally:
            sub.close()
            ctx.destroy(linger=0)


async def test_a_tenants_endpoint_publishes_only_its_blocks_and_only_to_its_tokens_holders(
    node_factory, pool_url, tmp_path
):
    alice_token, bob_token = "alice-token-0123456789abcdef0123456789", "bob-token-0123456789abcdef0123456789"
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    for name, token in (("alice", alice_token), ("bob", bob_token)):
        (tenants / name).write_text(token)
        (tenants / name).chmod(0o600)
    node_factory(*RING, "--tenant-tokens", str(tenants), env={"KVPOOL_TOKEN": TOKEN})
    alice = PoolClient(PoolConfig.from_url(pool_url + "?tenant=alice", {"KVPOOL_TOKEN": alice_token}))
    bob = PoolClient(PoolConfig.from_url(pool_url + "?tenant=bob", {"KVPOOL_TOKEN": bob_token}))
    mine, theirs, nobodys = chunks(0, 4), chunks(10, 4), chunks(20, 2)
    ep = EventsEndpoint(
        config(pool_url),
        EndpointConfig(
            model=MODEL, publish="tcp://127.0.0.1:*", replay="tcp://127.0.0.1:*", poll_interval_s=0.05, tenant="alice"
        ),
        alice_token,
    )
    assert ep.topic == f"kv@kvpool-{ep.pool.namespace}-alice@{MODEL}".encode()
    ep.bind()
    task = asyncio.create_task(ep.run())
    ctx = zmq.asyncio.Context()
    subs = {
        who: subscriber(ctx, ep, token=token)
        for who, token in (("alice", alice_token), ("bob", bob_token), ("pool", TOKEN))
    }
    try:
        async with alice, bob, PoolClient(config(pool_url)) as operator:
            await joined(subs["alice"])
            await asyncio.sleep(0.2)
            await alice.put(mine)
            await bob.put(theirs)
            await operator.put(nobodys)
            want = {block_of(c.key).block_hash for c in mine}  # type: ignore[union-attr]

            async def settled() -> bool:
                await subs["alice"].drain()
                return subs["alice"].mirror.blocks == want

            await until(settled, timeout_s=15.0)
            await alice.delete([mine[0].key])
            want.discard(block_of(mine[0].key).block_hash)  # type: ignore[union-attr]
            await until(settled, timeout_s=15.0)
            await asyncio.sleep(0.3)  # a late event of bob's or nobody's blocks would show here
            await subs["alice"].drain()
            assert subs["alice"].mirror.blocks == want
            # The pool's token and another tenant's complete no CURVE handshake with alice's endpoint.
            assert await subs["bob"].sub.poll(500) == 0 and await subs["pool"].sub.poll(500) == 0
    finally:
        for sub in subs.values():
            sub.close()
        ctx.destroy(linger=0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ep.close()


async def test_during_a_rotation_holders_of_either_token_get_the_same_stream_each_on_its_own_sockets(
    node_factory, pool_url
):
    next_token = "next-events-token-0123456789abcdef0123"
    node_factory(*RING, env={"KVPOOL_TOKEN": TOKEN})
    ep = EventsEndpoint(
        config(pool_url),
        EndpointConfig(
            model=MODEL,
            publish="tcp://127.0.0.1:*",
            replay="tcp://127.0.0.1:*",
            poll_interval_s=0.05,
            publish_next="tcp://127.0.0.1:*",
            replay_next="tcp://127.0.0.1:*",
        ),
        next_token=next_token,
    )
    ep.bind()
    task = asyncio.create_task(ep.run())
    ctx = zmq.asyncio.Context()
    k = curve_keys(next_token, ep.pool.namespace)
    next_keys = (k.server_public, k.client_public, k.client_secret)
    old = subscriber(ctx, ep)
    new = vllm_events.Subscriber(ctx, ep.next_publish_address, ep.next_replay_address, ep.topic, next_keys)
    misplaced = vllm_events.Subscriber(ctx, ep.publish_address, None, ep.topic, next_keys)  # the next token, old socket
    try:
        async with PoolClient(config(pool_url)) as client:
            await joined(old)
            await joined(new)
            await client.put(chunks(0, 5))
            await in_step(old, client)
            await in_step(new, client)
            assert new.mirror.blocks == old.mirror.blocks and len(old.mirror.blocks) == 5
            assert await misplaced.sub.poll(500) == 0
    finally:
        for sub in (old, new, misplaced):
            sub.close()
        ctx.destroy(linger=0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ep.close()


def _secret_file(path: Path, token: str) -> str:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


def _curve(token: str, namespace: str) -> tuple[bytes, bytes, bytes]:
    k = curve_keys(token, namespace)
    return k.server_public, k.client_public, k.client_secret


async def test_during_a_tenants_rotation_kvpool_events_serves_holders_of_either_of_its_tokens(
    node_factory, pool_url, tmp_path
):
    old, new = "alice-old-token-0123456789abcdef01234567", "alice-new-token-0123456789abcdef01234567"
    bob_token = "bob-token-0123456789abcdef0123456789abcd"
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    for name, token in (("alice", old), ("alice.next", new), ("bob", bob_token)):
        _secret_file(tenants / name, token)
    node_factory(*RING, "--tenant-tokens", str(tenants), env={"KVPOOL_TOKEN": TOKEN})  # takes both alice tokens
    here = tmp_path / "events"
    here.mkdir()
    anywhere = "tcp://127.0.0.1:*"
    tokens = ("--tenant-token-file", _secret_file(here / "alice", old))
    tokens += ("--tenant-token-file-next", _secret_file(here / "alice.next", new))
    sockets = ("--publish", anywhere, "--replay", anywhere, "--publish-next", anywhere, "--replay-next", anywhere)
    verb = ("events", "--url", pool_url, "--model", MODEL, "--poll-interval-s", "0.05", "--tenant", "alice")
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.cli", *verb, *tokens, *sockets],
        cwd=REPO,
        env={**os.environ, "KVPOOL_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.asyncio.Context()
    subs: dict[str, vllm_events.Subscriber] = {}
    try:
        publish, replay, publish_next, replay_next = await events_addresses(proc, 4)
        namespace = config(pool_url).namespace
        topic = f"kv@kvpool-{namespace}-alice@{MODEL}".encode()
        for who, address, replayed, token in (
            ("old", publish, replay, old),
            ("new", publish_next, replay_next, new),
            ("new on the old socket", publish, None, new),
            ("bob on the next socket", publish_next, None, bob_token),
        ):
            subs[who] = vllm_events.Subscriber(ctx, address, replayed, topic, _curve(token, namespace))
        await joined(subs["old"])
        await joined(subs["new"])
        engines = [
            PoolClient(PoolConfig.from_url(pool_url + "?tenant=alice", {"KVPOOL_TOKEN": old})),  # not moved yet
            PoolClient(PoolConfig.from_url(pool_url + "?tenant=alice", {"KVPOOL_TOKEN": new})),  # moved
            PoolClient(PoolConfig.from_url(pool_url + "?tenant=bob", {"KVPOOL_TOKEN": bob_token})),
        ]
        puts = [chunks(0, 3), chunks(10, 3), chunks(20, 2)]
        for engine, chunk_list in zip(engines, puts):
            async with engine:
                await engine.put(chunk_list)
        want = {block_of(c.key).block_hash for c in puts[0] + puts[1]}  # type: ignore[union-attr]

        async def settled() -> bool:
            await subs["old"].drain()
            await subs["new"].drain()
            return subs["old"].mirror.blocks == want and subs["new"].mirror.blocks == want

        await until(settled, timeout_s=15.0)
        assert subs["old"].mirror.last_seq == subs["new"].mirror.last_seq  # the same batches on both tokens' sockets
        # Each socket admits its own token's holders only: the next token on the old one, bob's on the next one.
        assert await subs["new on the old socket"].sub.poll(500) == 0
        assert await subs["bob on the next socket"].sub.poll(500) == 0
    finally:
        for sub in subs.values():
            sub.close()
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(timeout=30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_a_next_token_is_the_subscribers_next_token_and_kvpool_events_refuses_the_other_naming_the_flag(
    pool_url, tmp_path, monkeypatch
):
    monkeypatch.setenv("KVPOOL_TOKEN", TOKEN)  # the URL's pool token, which reads the nodes
    alice = _secret_file(tmp_path / "alice", "alice-old-token-0123456789abcdef01234567")
    alice_next = _secret_file(tmp_path / "alice.next", "alice-new-token-0123456789abcdef01234567")
    pool = _secret_file(tmp_path / "pool", TOKEN)
    base = ("events", "--url", pool_url, "--model", MODEL, "--publish-next", "tcp://127.0.0.1:*")
    tenant = ("--tenant", "alice", "--tenant-token-file", alice)
    cases = [
        ((*base, "--tenant-token-file-next", alice_next), "--tenant-token-file-next: a tenant's next token needs"),
        ((*base, *tenant, "--token-file-next", alice_next), "--token-file-next: the subscribers of tenant alice's"),
        ((*base, *tenant, "--tenant-token-file-next", pool), "--tenant-token-file-next: the tenant's next token is"),
        ((*base, *tenant, "--tenant-token-file-next", alice), "--tenant-token-file-next: the next token is the"),
    ]
    for args, said in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(list(args))
        assert code == EXIT_USAGE and said in err.getvalue(), (args, err.getvalue())


def test_a_tenants_endpoint_needs_that_tenants_own_token(pool_url):
    with pytest.raises(Exception, match="needs that tenant's token"):
        EventsEndpoint(config(pool_url), EndpointConfig(model=MODEL, tenant="alice"))
    with pytest.raises(Exception, match="is the pool token"):
        EventsEndpoint(config(pool_url), EndpointConfig(model=MODEL, tenant="alice"), TOKEN)
    with pytest.raises(Exception, match="A-Z a-z 0-9"):
        EndpointConfig(model=MODEL, tenant="a/b")


def test_the_endpoint_refuses_to_start_without_the_pool_token(pool_url):
    with pytest.raises(Exception, match="token"):
        EventsEndpoint(PoolConfig.from_url(pool_url, {}), EndpointConfig(model=MODEL))


def _golden_batches() -> dict[str, KVEventBatch]:
    common = {"token_ids": [], "block_size": 256, "lora_id": None, "medium": "CPU", "lora_name": None}
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    return {
        "stored_removed_cleared": KVEventBatch(
            ts=1767225600.25,
            events=[
                AllBlocksCleared(),
                BlockStored(
                    block_hashes=[0x1111222233334444, 0xFEDCBA9876543210],
                    parent_block_hash=None,
                    **common,  # type: ignore[arg-type]
                    **full,  # type: ignore[arg-type]
                ),
                BlockStored(
                    block_hashes=[0x0123456789ABCDEF],
                    parent_block_hash=0xFEDCBA9876543210,
                    extra_keys=[("salt-a",)],
                    **common,  # type: ignore[arg-type]
                    **full,  # type: ignore[arg-type]
                ),
                BlockRemoved(block_hashes=[0x1111222233334444], medium="CPU", group_idx=0),
            ],
            data_parallel_rank=0,
        ),
        "stored_with_tokens": KVEventBatch(
            ts=1767225601.5,
            events=[
                BlockStored(
                    block_hashes=[42, 43],
                    parent_block_hash=41,
                    token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                    block_size=4,
                    lora_id=7,
                    medium="GPU",
                    lora_name="adapter-a",
                )
            ],
        ),
    }


RELEASES = [("vllm-0.33", "vllm-0.33.0"), ("vllm-0.25", "vllm-0.25.1"), ("vllm-0.23", "vllm-0.23.0")]


@pytest.mark.parametrize("name", ["stored_removed_cleared", "stored_with_tokens"])
@pytest.mark.parametrize(("form", "release"), RELEASES)
def test_each_form_writes_the_bytes_its_vllm_release_wrote_and_reads_them(form, release, name):
    golden = (GOLDEN / release / f"{name}.msgpack").read_bytes()
    expected = _golden_batches()[name]
    decoder = vllm_events.ARRAY_DECODER if form == "vllm-0.23" else vllm_events.MAP_DECODER
    decoded = decoder.decode(golden)
    assert decoded.ts == expected.ts and decoded.data_parallel_rank == expected.data_parallel_rank
    assert [e.__struct_config__.tag for e in decoded.events] == [type(e).__name__ for e in expected.events]
    for got, want in zip(decoded.events, expected.events):
        for field in want.__struct_fields__:
            value = getattr(got, field)
            assert (list(value) if isinstance(value, list) else value) == getattr(want, field), field
    assert Wire(form).encode(expected) == golden  # the endpoint's encoder is byte-identical to the release's
    assert Wire(form).decode(golden) == expected


def test_every_form_has_its_releases_golden_bytes_and_is_named_in_the_docs():
    assert sorted(form for form, _ in RELEASES) == sorted(WIRE_FORMS)
    docs = {name: (REPO / "docs" / name).read_text() for name in ("fleet-events.md", "versions.md")}
    for form, release in RELEASES:
        assert (GOLDEN / release / "stored_removed_cleared.msgpack").is_file(), release
        for name, text in docs.items():
            assert f"`{form}`" in text, (form, name)


def test_the_default_form_is_the_newest_releases_and_only_its_newest_releases_fields_are_a_map16():
    assert EndpointConfig(model=MODEL).form == "vllm-0.33"
    stored = _golden_batches()["stored_with_tokens"]
    newest, older = Wire("vllm-0.33").encode(stored), Wire("vllm-0.25").encode(stored)
    assert newest[0] == older[0] == 0x93  # [ts, events, data_parallel_rank] in every release
    assert b"\xde\x00\x08\xa4type" in newest and b"\x88\xa4type" in older  # 15 fields: map16; 11: a fixmap


def test_the_older_form_is_arrays_all_the_way_down():
    batch = _golden_batches()["stored_removed_cleared"]
    payload = Wire("vllm-0.23").encode(batch)
    decoded = vllm_events.ARRAY_DECODER.decode(payload)
    assert [type(e).__name__ for e in decoded.events] == [
        "ArrayAllBlocksCleared",
        "ArrayBlockStored",
        "ArrayBlockStored",
        "ArrayBlockRemoved",
    ]
    assert Wire("vllm-0.23").decode(payload) == batch
    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
        vllm_events.MAP_DECODER.decode(payload)  # what a router on vLLM 0.24 or later says to it


def test_the_forms_older_names_are_refused_naming_the_release_form_meant(pool_url, monkeypatch):
    for old, meant in (("map", "vllm-0.33"), ("array", "vllm-0.23"), ("vllm-0.3", "vllm-0.33")):
        with pytest.raises(ConfigError, match=f"--form: '{old}' is not a form: did you mean {meant}\\?"):
            EndpointConfig(model=MODEL, form=old)
    monkeypatch.setenv("KVPOOL_TOKEN", TOKEN)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["events", "--url", pool_url, "--model", MODEL, "--form", "map"])
    assert code == EXIT_USAGE and "did you mean vllm-0.33?" in err.getvalue(), err.getvalue()


def test_the_node_ring_is_bounded_by_keys_and_says_when_a_reader_fell_behind():
    ring = EventRing(10)
    ring.stored([f"k{i}" for i in range(6)])
    ring.removed(["k0", "k1"])
    page = ring.since(0, 100)
    assert [(e.seq, e.kind.name, len(e.keys)) for e in page.entries] == [(0, "STORED", 6), (1, "REMOVED", 2)]
    assert (page.next_seq, page.gap) == (2, False)
    ring.stored([f"j{i}" for i in range(5)])  # 13 keys: the oldest entry leaves
    assert ring.since(0, 100).gap and not ring.since(1, 100).gap
    assert ring.since(2, 1).entries[0].keys == tuple(f"j{i}" for i in range(5))  # whole entries, at least one
    assert ring.since(1 << 62, 1) == type(page)((), 3, True)  # a cursor from another run: read it whole


def test_block_of_reads_lmcache_keys_and_refuses_others():
    ref = block_of(f"{MODEL}@1@0@ffffffffffffffff1@bfloat16@lmcache.salt%abc")
    assert ref is not None and (ref.model, ref.block_hash, ref.extra) == (
        MODEL,
        0xFFFFFFFFFFFFFFF1,
        ("lmcache.salt%abc",),
    )
    mp = block_of("mp:s1@m@0x00000000@0@00000000000000ab")
    assert mp is not None and (mp.model, mp.block_hash, mp.extra) == ("m", 0xAB, ("s1",))
    assert block_of("plain@3") is None and block_of("m@1@0@zz@bfloat16") is None
