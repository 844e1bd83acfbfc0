"""The same-host fast path: shared-memory arena, leases, locks.

Real node processes with their DRAM tier in /dev/shm; the client in this process
maps it read-only. Leases must keep bytes in place: a chunk under lease is never
evicted or overwritten, and a lease its client never releases still ends.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import backend.client.arena as client_module
from backend.client import BytesSink, Chunk, Fetched, PoolClient, SyncPoolClient
from backend.config import PoolConfig
from backend.errors import ConfigError, KVPoolError, ProtocolError
from backend.metadata import NodeInfo
from backend.node.memory.arena import ShmArena, remove_stale_arenas
from backend.node.memory.pages import GROW_AHEAD_BYTES, GROWER_STEP_BYTES
from backend.node.store.leases import MAX_LEASES
from backend.protocol import ItemMeta, Op, checksum
from backend.protocol.reads import LEASE_MAP, Lease, Release
from backend.shm import ArenaView
from tests.conftest import REPO, raw_request
from tests.support.waits import wait_until

MiB = 1024 * 1024


def _chunks(prefix: str, count: int, size: int, seed: int = 0) -> list[Chunk]:
    rng = random.Random(seed)
    return [Chunk(f"{prefix}@{i}", rng.randbytes(size)) for i in range(count)]


def _node_info(client: SyncPoolClient) -> NodeInfo:
    (node,) = client.nodes()
    return node


def _stats(client: SyncPoolClient) -> dict:
    return client.node_stats(_node_info(client))


# -- the arena on its own ------------------------------------------------------------------


def test_arena_region_is_reused_only_after_its_last_view_is_dropped():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = ShmArena(Path(directory), 8 * MiB)
        try:
            first = arena.alloc(1 * MiB)
            assert first is not None
            offset = arena.offset_of(first)
            tail = first[MiB // 2 :]  # a slice still being sent keeps the whole region
            del first
            gc.collect()
            second = arena.alloc(1 * MiB)
            assert second is not None and arena.offset_of(second) != offset
            del tail
            gc.collect()
            third = arena.alloc(1 * MiB)
            assert third is not None and arena.offset_of(third) == offset
        finally:
            arena.close()


def test_arena_full_answers_none_and_frees_coalesce_back_into_one_region():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = ShmArena(Path(directory), 4 * MiB)
        try:
            held = [arena.alloc(MiB) for _ in range(4)]
            assert all(h is not None for h in held)
            assert arena.alloc(MiB) is None and arena.fallbacks == 1
            del held
            gc.collect()
            whole = arena.alloc(4 * MiB)  # only possible if the four regions merged again
            assert whole is not None
            assert arena.report().allocated_bytes == 4 * MiB
        finally:
            arena.close()


def test_an_arena_in_use_keeps_pages_ready_ahead_and_an_idle_one_takes_none():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = ShmArena(Path(directory), GROW_AHEAD_BYTES + 64 * MiB)
        try:
            time.sleep(0.2)
            assert arena.grown_bytes == 0  # no allocation yet: no memory taken
            first = arena.alloc(MiB)
            assert first is not None
            # the grower thread, not the allocation, takes the next GROW_AHEAD_BYTES
            assert wait_until(lambda: arena.grown_bytes >= MiB + GROW_AHEAD_BYTES, timeout_s=20.0)
            assert arena.report().allocated_bytes == MiB
            big = arena.alloc(GROW_AHEAD_BYTES)  # served from the pages grown ahead
            assert big is not None and arena.fallbacks == 0
        finally:
            arena.close()


def test_an_allocation_takes_only_its_own_pages_and_waits_for_at_most_a_small_grower_step(monkeypatch):
    """The node's event loop allocates (a put), and also accepts and answers every connection: it takes only the
    pages it lacks inline, never a whole GROW_STEP_BYTES step, and the grower's steps, which it may wait for
    (the grower runs at the lowest CPU priority: under load, a step lasts as long as the machine leaves it no
    core), are GROWER_STEP_BYTES. A flaky CLI test's drain timed out on a node whose loop was held so."""
    taken: list[tuple[str, int]] = []
    real_back = ShmArena._back

    def back(self, start, step):
        taken.append((threading.current_thread().name, step))
        real_back(self, start, step)

    monkeypatch.setattr(ShmArena, "_back", back)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = ShmArena(Path(directory), GROW_AHEAD_BYTES + 64 * MiB)
        try:
            first = arena.alloc(MiB)
            assert first is not None and taken[0] == (threading.current_thread().name, MiB)  # only its own pages
            assert wait_until(lambda: arena.grown_bytes >= MiB + GROW_AHEAD_BYTES, timeout_s=20.0)
            grower = {step for name, step in taken if name == "kvpool-arena-grow"}
            assert grower == {GROWER_STEP_BYTES}
            big = arena.alloc(GROW_AHEAD_BYTES)  # served from the pages grown ahead, none taken inline
            assert big is not None and arena.fallbacks == 0
            assert [step for name, step in taken if name != "kvpool-arena-grow"] == [MiB]
        finally:
            arena.close()


def test_an_allocation_waits_for_the_grower_step_under_way_and_no_further_one(monkeypatch):
    """A grower slow to finish its step (as a starved nice-19 thread is under load) is injected: the allocation
    that needs pages waits for that step, then takes what it still lacks itself, before the grower starts
    another (which it could otherwise do again and again while the allocation waited)."""
    taken: list[tuple[str, int]] = []
    step_may_end = threading.Event()
    real_back = ShmArena._back

    def back(self, start, step):
        taken.append((threading.current_thread().name, step))
        if threading.current_thread().name == "kvpool-arena-grow":
            step_may_end.wait(30.0)
        real_back(self, start, step)

    monkeypatch.setattr(ShmArena, "_back", back)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = ShmArena(Path(directory), GROW_AHEAD_BYTES + 64 * MiB)
        try:
            first = arena.alloc(MiB)  # inline (and kept); then the grower's first step is under way, held
            assert first is not None
            assert wait_until(lambda: arena._growing, timeout_s=10.0)
            got: list[object] = []
            waiting = threading.Thread(target=lambda: got.append(arena.alloc(8 * MiB)), name="put")
            waiting.start()
            assert wait_until(lambda: arena._waiting == 1, timeout_s=10.0)
            step_may_end.set()
            waiting.join(30.0)
            assert got and got[0] is not None
            assert taken[:3] == [
                (threading.current_thread().name, MiB),
                ("kvpool-arena-grow", GROWER_STEP_BYTES),
                ("put", 8 * MiB - GROWER_STEP_BYTES),  # what the grower's step left it lacking, and no more
            ]
        finally:
            step_may_end.set()
            arena.close()


def test_a_region_freed_while_the_allocator_holds_its_lock_does_not_deadlock():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = ShmArena(Path(directory), 2 * MiB)
        try:
            buf = arena.alloc(2 * MiB)
            assert buf is not None and arena.alloc(MiB) is None
            with arena._lock:  # as when a garbage collection runs a finalizer inside alloc()
                del buf
                gc.collect()
            assert arena.alloc(2 * MiB) is not None  # the region came back at the next alloc
        finally:
            arena.close()


def test_client_maps_only_the_arena_whose_token_the_node_published():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = ShmArena(Path(directory), MiB)
        try:
            buf = arena.alloc(4096)
            assert buf is not None
            buf[:] = b"k" * 4096
            view = ArenaView(str(arena.path), arena.token)
            out = bytearray(4096)
            view.copy_into(memoryview(out), arena.offset_of(buf))
            assert out == b"k" * 4096
            with pytest.raises(ValueError, match="outside the arena"):
                view.copy_into(memoryview(out), view.size_bytes)
            with pytest.raises(ValueError, match="not the arena"):
                ArenaView(str(arena.path), "0" * 32)
        finally:
            arena.close()
    client = PoolClient(PoolConfig())
    elsewhere = NodeInfo("n", "10.0.0.9", 1, 1, shm_path="/dev/shm/kvpool-1-none.arena", shm_token="x")
    assert client.arena.view(elsewhere) is None  # another host's file does not exist here: TCP


@pytest.mark.usefixtures("processes")
def test_arenas_and_stages_of_dead_processes_are_removed():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        stale = [Path(directory) / f"kvpool-{int(dead.stdout)}-deadbeef{suffix}" for suffix in (".arena", ".stage")]
        live = [Path(directory) / f"kvpool-{os.getpid()}-cafecafe{suffix}" for suffix in (".arena", ".stage")]
        for path in stale + live:
            path.write_bytes(b"x")
            os.utime(path, (time.time() - 60, time.time() - 60))  # past STAGE_MIN_AGE_S
        assert remove_stale_arenas(Path(directory)) == 2
        assert not any(p.exists() for p in stale) and all(p.exists() for p in live)


# -- through a node ------------------------------------------------------------------------


def test_same_host_get_copies_from_the_arena_and_returns_identical_bytes(node_factory, pool_url):
    node_factory(shm=True)
    chunks = [
        Chunk(f"m@1@0@{i}@bfloat16", os.urandom(MiB + 4096 * i), "bfloat16", (MiB // 2 + 2048 * i,), 1)
        for i in range(6)
    ]
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        got = client.get([c.key for c in chunks] + ["m@1@0@missing@bfloat16"])
        assert got[-1] is None
        for chunk, fetched in zip(chunks, got):
            assert fetched is not None and bytes(fetched.data) == chunk.data
            assert fetched.meta.shape == chunk.shape and fetched.meta.dtype == "bfloat16"
        assert client.counters["shm_get_bytes"] == sum(len(c.data) for c in chunks)
        stats = _stats(client)
        assert stats["counters"].get("get_bytes", 0) == 0  # nothing went over the socket
        assert stats["counters"]["shm_get_bytes"] == sum(len(c.data) for c in chunks)
        wait_until(lambda: _stats(client)["leases"] == 0, timeout_s=5.0)  # released after the copy


def test_shm_off_reads_over_tcp_from_the_same_node(node_factory, pool_url):
    node_factory(shm=True)
    chunks = _chunks("tcp", 3, 256 * 1024)
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?shm=off")) as client:
        client.put(chunks)
        got = client.get([c.key for c in chunks])
        assert [bytes(g.data) for g in got] == [c.data for c in chunks]
        assert client.counters.get("shm_get_bytes", 0) == 0
        assert _stats(client)["counters"]["get_bytes"] == 3 * 256 * 1024


def test_a_leased_chunk_is_never_evicted_or_overwritten(node_factory, pool_url):
    node_factory(shm=True, dram="8MiB")  # no NVMe: DRAM pressure evicts
    config = PoolConfig.from_url(pool_url)
    with SyncPoolClient(config) as client:
        (held,) = _chunks("held", 1, MiB, seed=1)
        client.put([held])
        node = _node_info(client)
        reply = client._call(
            raw_request(client._client, node, Op.LEASE, Lease.encode_request([held.key], 60_000, LEASE_MAP))
        )
        lease_id, [(item, offset)] = Lease.decode_answer(reply, [held.key])
        assert lease_id and offset is not None and item.nbytes == MiB
        client.delete([held.key])  # gone from the index, but the lease still holds its region
        for round_ in range(4):  # 4 x 8 MiB through an 8 MiB tier: every unleased region is reused
            client.put(_chunks(f"fill{round_}", 8, MiB, seed=10 + round_))
        view = ArenaView(node.shm_path, node.shm_token)
        out = bytearray(MiB)
        view.copy_into(memoryview(out), offset)
        assert out == held.data
        released = client._call(raw_request(client._client, node, Op.RELEASE, Release.encode_request(lease_id)))
        assert b'"released":1' in released
        assert _stats(client)["leases"] == 0


def test_a_locked_chunk_survives_eviction_pressure_and_an_unlocked_one_goes(node_factory, pool_url):
    node_factory(shm=True, dram="8MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        locked, unlocked = _chunks("lk", 2, MiB, seed=2)
        client.put([locked, unlocked])
        locks = client.lock([locked.key, "lk@absent"], ttl_ms=60_000)
        assert locks[0] is not None and locks[0].key == locked.key and locks[1] is None
        for round_ in range(3):
            client.put(_chunks(f"press{round_}", 6, MiB, seed=20 + round_))  # 6 + the locked 1 fit in 8
        assert client.contains([locked.key, unlocked.key]) == [True, False]
        got = client.get([locked.key])
        assert got[0] is not None and bytes(got[0].data) == locked.data
        client.unlock(locks)
        client.unlock(locks)  # idempotent
        assert _stats(client)["leases"] == 0
        for round_ in range(3):
            client.put(_chunks(f"after{round_}", 6, MiB, seed=30 + round_))
        assert client.contains([locked.key]) == [False]  # unlocked: LRU may evict it now


def test_a_lease_whose_client_hangs_with_its_connection_open_ends_at_its_deadline(node_factory, pool_url):
    """A client that dies closes its connection, and the node ends its leases then
    (tests/faults/test_client_faults.py). One that hangs, or whose host vanished without a
    FIN, keeps the connection open: its leases end at their deadline."""
    node_factory(shm=True, dram="8MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        (chunk,) = _chunks("orphan", 1, MiB, seed=3)
        client.put([chunk])
        code = (
            "import sys, time\n"
            "from backend.client import SyncPoolClient\n"
            "from backend.config import PoolConfig\n"
            f"c = SyncPoolClient(PoolConfig.from_url({pool_url!r}))\n"
            f"assert c.lock([{chunk.key!r}], ttl_ms=1500)[0] is not None\n"
            "print('locked', flush=True)\n"
            "time.sleep(600)  # never unlocks\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
            proc.send_signal(signal.SIGSTOP)  # hung: its sockets stay open
            assert _stats(client)["leases"] == 1
            assert wait_until(lambda: _stats(client)["leases"] == 0, timeout_s=10.0)
            counters = _stats(client)["counters"]
            assert counters["leases_expired"] == 1 and counters.get("leases_disconnected", 0) == 0
            for round_ in range(3):
                client.put(_chunks(f"evict{round_}", 6, MiB, seed=40 + round_))
            assert client.contains([chunk.key]) == [False]  # no longer pinned
        finally:
            proc.kill()
            proc.wait(10)


def test_bad_lock_and_lease_requests_are_refused_with_the_reason(node_factory, pool_url):
    node_factory(shm=True)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(_chunks("bad", 1, 4096))
        with pytest.raises(ConfigError, match="ttl_ms"):
            client.lock(["bad@0"], ttl_ms=0)
        node = _node_info(client)
        with pytest.raises(ProtocolError, match="exceeds"):
            client._call(raw_request(client._client, node, Op.LEASE, Lease.encode_request(["bad@0"], 10**9, 0)))
        with pytest.raises(ProtocolError, match="unknown LEASE flags"):
            client._call(raw_request(client._client, node, Op.LEASE, Lease.encode_request(["bad@0"], 1000, 0x80)))
        # the node still serves, and an unknown lease id releases nothing
        reply = client._call(raw_request(client._client, node, Op.RELEASE, Release.encode_request(12345)))
        assert b'"released":0' in reply
        assert client.get(["bad@0"])[0] is not None


# -- when a mapped read cannot be trusted ------------------------------------------------


class _SlowSink(BytesSink):
    """A sink that keeps the reader waiting, as LMCache's does while its buffer is full."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def allocate(self, meta: ItemMeta) -> tuple[Fetched, bytearray] | None:
        await asyncio.sleep(self.delay_s)
        return await super().allocate(meta)


def test_a_read_held_up_past_the_trusted_share_of_its_lease_goes_over_tcp(node_factory, pool_url, monkeypatch):
    node_factory(shm=True)
    monkeypatch.setattr(client_module, "SHM_LEASE_TRUST", 0.005)  # trust the arena for 50 ms of the lease
    chunks = _chunks("slow", 3, 256 * 1024, seed=5)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        got = client._call(client._client.get([c.key for c in chunks], _SlowSink(0.2)))
        assert [bytes(g.data) for g in got] == [c.data for c in chunks]
        assert client.counters.get("shm_get_bytes", 0) == 0
        assert _stats(client)["counters"]["get_bytes"] == 3 * 256 * 1024
        assert client.counters.get("integrity_failures", 0) == 0


def test_a_mapped_copy_failing_its_checksum_is_reread_over_tcp_and_the_copy_kept(node_factory, pool_url, monkeypatch):
    node_factory(shm=True)

    def torn_copy(self: ArenaView, out: memoryview, offset: int) -> int:  # a region reused mid-copy
        out[:] = bytes(len(out))
        return checksum(out)

    monkeypatch.setattr(ArenaView, "copy_checked", torn_copy)
    chunks = _chunks("torn", 2, 128 * 1024, seed=6)
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put(chunks)
        got = client.get([c.key for c in chunks])
        assert [bytes(g.data) for g in got] == [c.data for c in chunks]
        assert client.counters.get("integrity_failures", 0) == 0
        assert client.contains([c.key for c in chunks]) == [True, True]  # not dropped from the index


def test_a_node_whose_lease_table_is_full_still_serves_the_read_over_tcp(node_factory, pool_url):
    node_factory(shm=True)
    (chunk,) = _chunks("full", 1, 64 * 1024, seed=7)
    # 1,024 leases in flight at once on one connection: a loaded machine may leave it silent past 2 s
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?progress_timeout_s=20")) as client:
        client.put([chunk])
        node = _node_info(client)

        async def fill_lease_table() -> None:
            request = Lease.encode_request([chunk.key], 60_000, 0)
            for _ in range(MAX_LEASES // 1024):
                await asyncio.gather(*(raw_request(client._client, node, Op.LEASE, request) for _ in range(1024)))

        client._call(fill_lease_table())
        assert _stats(client)["leases"] == MAX_LEASES
        (got,) = client.get([chunk.key])
        assert got is not None and bytes(got.data) == chunk.data
        assert client.counters.get("shm_get_bytes", 0) == 0
        assert _stats(client)["counters"]["leases_refused"] == 1


def test_unlock_raises_when_a_node_cannot_be_told_and_a_retry_is_harmless(node_factory, pool_url):
    node = node_factory(shm=True)
    (chunk,) = _chunks("unl", 1, 4096, seed=8)
    with SyncPoolClient(PoolConfig.from_url(pool_url + "?progress_timeout_s=1")) as client:
        client.put([chunk])
        locks = client.lock([chunk.key], ttl_ms=60_000)
        node.pause()  # stopped, still registered: the RELEASE is not answered
        try:
            with pytest.raises(KVPoolError):
                client.unlock(locks)
        finally:
            node.resume()
        client.unlock(locks)  # the retry ends the lease
        assert _stats(client)["leases"] == 0
        client.unlock(locks)  # and one more is a no-op
