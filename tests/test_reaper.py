"""The dead-node reaper's sweep (``backend.node.index.reaper``) against a real redis-server, stepped by hand.

A step reads the registry and sweeps: back to back (within its budget) while some dead slot or
a live node's newer epoch is not covered by a walk begun since, else one page. The nodes here
are registry entries written through ``MetadataStore`` (heartbeats), not processes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from backend.metadata import Location, MetadataStore, NodeInfo
from backend.node.index.reaper import SCAN_COUNT, DeadNodeReaper

KEYS = [f"reap/model@8@0@{i:x}@bfloat16" for i in range(20_000)]
TTL_MS = 60_000
MOST_STEPS = 4  # a walk of 20,000 keys takes 0.1-0.2 s here; one page per step would take 80 steps


async def _beat(store: MetadataStore, node_id: str, epoch: int, ttl_ms: int = TTL_MS) -> None:
    await store.registry.heartbeat(NodeInfo(node_id, "127.0.0.1", 1, epoch), ttl_ms=ttl_ms, changed=True)


async def _fields(store: MetadataStore, node_id: str) -> dict[int, int]:
    """Epoch -> how many of KEYS have a copy of ``node_id`` written under it."""
    out: dict[int, int] = {}
    for start in range(0, len(KEYS), 1000):
        for entry in await store.index.lookup(KEYS[start : start + 1000]):
            for loc in entry:
                if loc.node_id == node_id:
                    out[loc.epoch] = out.get(loc.epoch, 0) + 1
    return out


async def _steps_until(reaper: DeadNodeReaper, done: Callable[[], Awaitable[bool]]) -> int:
    for steps in range(1, 200):
        await reaper.step()
        if await done():
            return steps
    return 200


async def test_a_restarted_nodes_ended_run_and_a_dead_nodes_fields_go_in_a_few_steps(redis_server, namespace):
    store = MetadataStore(redis_server.url, namespace)
    try:
        await _beat(store, "a", 1)
        await _beat(store, "b", 1)
        await store.index.commit([(k, Location("b", 1, "dram", 10, i)) for i, k in enumerate(KEYS)])
        reaper = DeadNodeReaper(store, "a", grace_s=0.0)
        await _steps_until(reaper, lambda: _true())  # the first walk, which covers the pool as it is
        while reaper.counters["collector_sweeps"] == 0:
            await reaper.step()
        assert await _fields(store, "b") == {1: len(KEYS)}  # nothing to remove yet

        # b restarts (epoch 2) and republishes half; its first run's other half died with it.
        await store.connection.redis.delete(store.connection.heartbeat_key("b"))  # its first run's claim ended
        await _beat(store, "b", 2)
        await store.index.commit([(k, Location("b", 2, "dram", 10, i)) for i, k in enumerate(KEYS[: len(KEYS) // 2])])
        steps = await _steps_until(reaper, lambda: _no_epoch(store, "b", 1))
        assert steps <= MOST_STEPS, steps
        assert await _fields(store, "b") == {2: len(KEYS) // 2}

        # b dies: its beat lapses; with no grace, its fields go at the reaper's next steps.
        await store.connection.redis.delete(store.connection.heartbeat_key("b"))
        steps = await _steps_until(reaper, lambda: _none_of(store, "b"))
        assert steps <= MOST_STEPS, steps
        assert reaper.counters["collected_index_fields"] == len(KEYS)
        assert reaper.counters["collected_nodes"] == 1
        assert await store.connection.slot_map() == {
            "a": store.connection.slots.slot_of("a")
        }  # b's slot taken back with it
    finally:
        await store.close()


async def test_with_nothing_to_collect_a_step_reads_one_page(redis_server, namespace):
    """An idle pool costs Redis one page per heartbeat, not a walk."""
    store = MetadataStore(redis_server.url, namespace)
    try:
        await _beat(store, "a", 1)
        await store.index.commit([(k, Location("a", 1, "dram", 10, i)) for i, k in enumerate(KEYS)])
        reaper = DeadNodeReaper(store, "a", grace_s=0.0)
        while reaper.counters["collector_sweeps"] == 0:  # the first walk after taking over runs whole
            await reaper.step()
        read = reaper.counters["collector_keys_read"]
        for _ in range(3):
            await reaper.step()
        assert 0 < reaper.counters["collector_keys_read"] - read <= 3 * SCAN_COUNT * 2  # SCAN's COUNT is a hint
        assert reaper.counters["collected_index_fields"] == 0
    finally:
        await store.close()


async def _true() -> bool:
    return True


async def _no_epoch(store: MetadataStore, node_id: str, epoch: int) -> bool:
    return epoch not in await _fields(store, node_id)


async def _none_of(store: MetadataStore, node_id: str) -> bool:
    return not await _fields(store, node_id)
