"""The eviction simulator (bench/workload/sim.py) and its traces (bench/workload/traces.py).

Fast tier: no process. The hit rates asserted are the ones the reduced multi-round trace
gave (16 users, 6 rounds, 392 chunks: at 0.5, lru 55.7 %, prefix-recency 55.7 %, lfu 67.6 %,
s3-fifo 63.1 %, prefix 69.5 %, belady 67.9 %), with a margin. The node's orders are the node's
classes (``backend/node/store/eviction.py``, tested in ``tests/test_eviction.py``): here, what the
simulator's adapter (``NodeOrder``) tells them.
"""

from __future__ import annotations

import pytest

from backend.node.store.eviction import LruOrder, PrefixOrder, PrefixRecencyOrder
from bench.workload.sim import (
    CAPACITIES,
    DEFAULT_RUNS,
    LRU,
    POLICIES,
    Costs,
    NodeOrder,
    Prefix,
    PrefixRecency,
    main,
    simulate,
    unbounded_hit_tokens,
)
from bench.workload.traces import PRESETS, TRACES, Trace, chunk_keys, make_trace

COSTS = Costs(
    kv_bytes_per_token=PRESETS["llama-3.1-8b"].kv_bytes_per_token, load_bytes_per_s=5e9, prefill_tokens_per_s=3e4
)


@pytest.fixture(scope="module")
def reduced() -> Trace:
    return make_trace("multi-round", users=16, rounds=6)


@pytest.fixture(scope="module")
def small_traces() -> list[Trace]:
    return [
        make_trace("multi-round", users=16, rounds=6),
        make_trace("long-doc-qa", documents=8, document_chunks=12),
        make_trace("agent", agents=6, steps=8),
        make_trace("mooncake", requests=150),
    ]


def test_every_policy_stays_within_the_capacity(small_traces: list[Trace]) -> None:
    for trace in small_traces:
        for fraction in (0.1, 0.25, 0.5):
            for policy, admission in DEFAULT_RUNS:
                result = simulate(trace, policy, fraction, COSTS, admission)
                assert result.peak_chunks <= result.capacity_chunks, (trace.name, policy, admission, fraction)
                assert 0 <= result.hit_tokens <= unbounded_hit_tokens(trace)


def test_a_pool_as_large_as_the_working_set_hits_every_chunk_seen_before(small_traces: list[Trace]) -> None:
    for trace in small_traces:
        for policy in POLICIES:
            result = simulate(trace, policy, 1.0, COSTS)
            assert result.hit_tokens == unbounded_hit_tokens(trace), (trace.name, policy)


def test_after_a_warm_up_a_full_size_pool_hits_every_token(reduced: Trace) -> None:
    twice = Trace("twice", {}, reduced.requests + reduced.requests)
    for policy in POLICIES:
        second_pass = simulate(twice, policy, 1.0, COSTS).request_hit_tokens[len(reduced.requests) :]
        assert sum(second_pass) == reduced.total_tokens, policy


def test_furthest_next_use_beats_lru(small_traces: list[Trace]) -> None:
    for trace in small_traces:
        for fraction in (0.25, 0.5):
            belady = simulate(trace, "belady", fraction, COSTS).token_hit_rate
            assert belady >= simulate(trace, "lru", fraction, COSTS).token_hit_rate, (trace.name, fraction)


def test_furthest_next_use_is_no_bound_for_prefix_chains(small_traces: list[Trace]) -> None:
    """Keeping the chunk used soonest can keep a tail whose head is gone: tail first did better here."""
    agent = small_traces[2]
    # seen: belady 26.7 %, tail-first 28.9 %, s3-fifo 32.4 %
    belady = simulate(agent, "belady", 0.25, COSTS).token_hit_rate
    assert simulate(agent, "tail-first", 0.25, COSTS).token_hit_rate > belady + 0.01
    assert simulate(agent, "s3-fifo", 0.25, COSTS).token_hit_rate > belady + 0.03


def test_on_multi_round_at_half_the_working_set_prefix_recency_is_no_worse_than_lru_and_below_the_scan_resistant_policies(
    reduced: Trace,
) -> None:
    rate = {policy: simulate(reduced, policy, 0.5, COSTS).token_hit_rate for policy in POLICIES}
    assert rate["prefix-recency"] >= rate["lru"]
    # the node hears a request's read chunks and its stored ones as two batches (tail-first touches them as one):
    # seen 55.7 % against tail-first's 56.1 %
    assert rate["prefix-recency"] >= rate["tail-first"] - 0.01
    # chains are reused whole, so the order inside one does not decide what stays: keeping the
    # right chains does (seen: lfu +11.9 points, s3-fifo +7.4, belady +12.2 over prefix-recency)
    assert rate["lfu"] >= rate["prefix-recency"] + 0.08
    assert rate["s3-fifo"] >= rate["prefix-recency"] + 0.04
    assert rate["belady"] >= rate["lfu"]


def test_keeping_the_most_read_chains_beats_every_practical_baseline_on_multi_round(reduced: Trace) -> None:
    rate = {policy: simulate(reduced, policy, 0.5, COSTS).token_hit_rate for policy in POLICIES}
    # seen: prefix 69.5 %, lru 55.7 %, lfu 67.6 %, s3-fifo 63.1 %, prefix-recency 55.7 %
    assert rate["prefix"] >= rate["lru"] + 0.10
    assert rate["prefix"] >= rate["prefix-recency"] + 0.10
    assert rate["prefix"] > max(rate["lfu"], rate["s3-fifo"])


def test_the_simulated_node_orders_are_the_nodes_own_classes() -> None:
    """One implementation of each rule: the simulator's lru, prefix-recency and prefix rows run the node's orders."""
    trace = make_trace("agent", agents=1, steps=1)
    made = {}
    for name in ("lru", "tail-first", "prefix-recency", "prefix"):
        pool = POLICIES[name](4, trace)
        assert isinstance(pool, NodeOrder), name
        made[name] = type(pool.order)
    assert made == {
        "lru": LruOrder,
        "tail-first": LruOrder,
        "prefix-recency": PrefixRecencyOrder,
        "prefix": PrefixOrder,
    }


def test_a_requests_own_chunks_stay_while_it_is_served_and_a_freed_slot_is_reused() -> None:
    """The adapter's part: a chunk of the request being served (found, or stored by it) is pinned on the node's
    order when the walk meets it, the coldest other chunk leaves, and the newcomer takes its slot (the node's
    chunk table reuses the last freed slot first)."""
    pool = LRU(2, make_trace("agent", agents=1, steps=1))
    x, y, z, w = range(4)
    assert pool.store(x, set()) and pool.store(y, {x})
    pool.served([], [x, y])  # stored head first: x is the coldest
    freed = pool._slots[y]
    assert pool.store(z, {x})  # x was found by this request: y leaves instead
    assert x in pool and y not in pool and pool._slots[z] == freed
    assert not pool.store(w, {x, z})  # everything left is the request's own: no room
    pool.served([x], [z])  # its pins end; x read, then z put
    assert pool.store(w, set())
    assert x not in pool and z in pool and w in pool


def test_a_newcomer_does_not_evict_a_chunk_read_as_often_as_it() -> None:
    pool = Prefix(2, make_trace("agent", agents=1, steps=1))
    a0, a1, b0 = range(3)
    assert pool.store(a0, set()) and pool.store(a1, {a0})
    pool.served([], [a0, a1])  # put: NEW_READS each
    assert not pool.store(b0, set())  # a full pool keeps the chain it holds
    assert a0 in pool and a1 in pool and b0 not in pool


def test_a_refused_chunk_offered_again_counts_its_refusals_as_reads() -> None:
    pool = Prefix(2, make_trace("agent", agents=1, steps=1))
    a0, a1, b0 = range(3)
    assert pool.store(a0, set()) and pool.store(a1, {a0})
    pool.served([], [a0, a1])
    assert not pool.store(b0, set())  # one read each: the newcomer is refused once
    assert pool.store(b0, set())  # one refusal + its own read outweigh a chunk read once
    assert a1 not in pool and a0 in pool  # the chain's tail made the room


def test_held_chains_cool_and_a_new_working_set_gets_in() -> None:
    first = make_trace("multi-round", users=16, rounds=6, seed=1)
    second = make_trace("multi-round", users=16, rounds=6, seed=2)
    both = Trace("two phases", {}, first.requests + second.requests)
    hits = simulate(both, "prefix", 0.25, COSTS).request_hit_tokens[len(first.requests) :]
    # seen: 37.1 % of the second phase's tokens (lru 53.8 %). The node ages by the chunks its batches name:
    # a request whose first new chunk is refused names that one only (the simulator offers no more of it)
    assert sum(hits) >= 0.30 * sum(request.tokens for request in second.requests)


def test_oracle_admission_stores_less_and_hits_no_less(small_traces: list[Trace]) -> None:
    for trace in small_traces:
        plain = simulate(trace, "prefix-recency", 0.5, COSTS)
        admitted = simulate(trace, "prefix-recency", 0.5, COSTS, "oracle")
        assert admitted.stored_bytes <= plain.stored_bytes, trace.name
        assert admitted.token_hit_rate >= plain.token_hit_rate, trace.name


def test_the_prefix_recency_rule_evicts_a_departed_chunks_successors_before_anything_reachable() -> None:
    pool = PrefixRecency(4, make_trace("agent", agents=1, steps=1))
    a0, a1, a2, b0, c0, c1, c2 = range(7)
    for key in (a0, a1, a2):
        assert pool.store(key, {a0, a1, a2})
    pool.served([], [a0, a1, a2])  # one put: the node links the chain a0 <- a1 <- a2
    assert pool.store(b0, set())
    pool.served([], [b0])
    # the node saw a1 and a2 read (their head came from an engine's own tier): a0 is now the oldest
    pool.served([a1, a2], [])
    assert pool.store(c0, set())  # a0 leaves: a1 can no longer be reached, nor a2 after it
    assert a0 not in pool
    assert pool.store(c1, {c0})
    assert pool.store(c2, {c0, c1})
    assert a1 not in pool and a2 not in pool
    assert b0 in pool  # older than a1 and a2 by recency, but still reachable


def test_trace_keys_are_the_keys_lmcache_gives_the_tokens() -> None:
    from lmcache.v1.token_database import ChunkedTokenDatabase

    database = ChunkedTokenDatabase(None, None)
    for name in TRACES:
        trace = make_trace(name, **({"requests": 20} if name == "mooncake" else {}))
        for request in (trace.requests[1], trace.requests[-1]):
            tokens = request.token_ids()
            lmcache_keys = [key for _, _, key in database.process_tokens(tokens, make_key=False)]
            assert tuple(lmcache_keys) == request.keys == tuple(chunk_keys(tokens)), name


def test_traces_are_seeded_and_the_model_presets_sized_from_their_configs() -> None:
    assert make_trace("multi-round", seed=3).requests == make_trace("multi-round", seed=3).requests
    assert make_trace("multi-round", seed=3).requests != make_trace("multi-round", seed=4).requests
    trace = make_trace("multi-round")
    assert (len(trace.requests), trace.working_set_chunks) == (320, 8 + 40 * 8 * 4)
    assert PRESETS["llama-3.1-8b"].kv_bytes_per_token == 128 * 1024
    assert PRESETS["qwen2.5-7b"].kv_bytes_per_token == 28 * 4 * 128 * 2 * 2
    assert PRESETS["ci-micro"].kv_bytes_per_chunk == 16 * 1024  # the Mooncake sample's 42,560 chunks: 665 MiB


def test_the_command_prints_a_row_per_policy_at_each_capacity() -> None:
    lines: list[str] = []
    results = main(["--trace", "agent", "--capacity", "0.5"], lines.append)
    assert len(results) == len(DEFAULT_RUNS)
    assert sum(1 for line in lines if line.startswith("| agent | 0.5")) == len(DEFAULT_RUNS)
    assert CAPACITIES == (0.25, 0.5, 1.0)


def test_an_engine_local_tier_serves_the_heads_and_the_pool_only_what_follows(reduced: Trace) -> None:
    for policy in POLICIES:
        pool_only = simulate(reduced, policy, 0.5, COSTS)
        with_local = simulate(reduced, policy, 0.5, COSTS, local_fraction=0.05)
        assert pool_only.pool_hit_tokens == pool_only.hit_tokens, policy
        assert with_local.pool_hit_tokens < with_local.hit_tokens, policy
        assert with_local.hit_tokens >= pool_only.hit_tokens, policy
        assert with_local.mean_ttft_s < pool_only.mean_ttft_s, policy  # local hits load for free in the model
