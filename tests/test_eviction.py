"""Which chunks leave a full tier first: the prefix-aware orders in-process, and the policies on real nodes.

LMCache looks a request's chunks up in prefix order and stops at the first miss, so a
chunk is worth something only while the chunks before it are held. ``eviction=prefix-recency``
(``backend/node/store/eviction.py`` ``PrefixRecencyOrder``) keeps whole prefixes where LRU keeps tails;
``eviction=prefix`` (``PrefixOrder``) keeps the most-read chains on top of that.
"""

from __future__ import annotations

import random

import pytest

from backend.node.memory.columns import MIN_ITEMS
from backend.node.store.eviction import (
    AGE_EVERY_HELD,
    MAX_READS,
    NEW_READS,
    SKETCH_ROWS,
    SKETCH_WIDTH,
    LruOrder,
    PrefixOrder,
    PrefixRecencyOrder,
)
from kvpool import PoolConfig, SyncPoolClient
from tests.support.chunks import numbered_chunks

CHUNK_BYTES = 256 * 1024


def _order(order: LruOrder | PrefixRecencyOrder | PrefixOrder) -> list[int]:
    return list(order.coldest())


# -- PrefixRecencyOrder (prefix-recency) in-process -----------------------------------------------------------------
def test_a_chains_tail_leaves_first_and_its_head_last():
    order = PrefixRecencyOrder()
    for slot in range(4):  # a put: the chunks enter head first ...
        order.add(slot)
    order.touch_chain([0, 1, 2, 3])  # ... and the batch is touched as one chain
    assert _order(order) == [3, 2, 1, 0]

    lru = LruOrder()
    for slot in range(4):
        lru.add(slot)
    lru.touch_chain([0, 1, 2, 3])
    assert _order(lru) == [0, 1, 2, 3]  # LRU: the head, and with it the whole chain's value, goes first


def test_a_head_shared_by_many_chains_stays_while_their_tails_leave():
    order = PrefixRecencyOrder()
    shared = [0, 1]  # a system prompt
    for user in range(3):
        tail = [10 * (user + 1), 10 * (user + 1) + 1]
        for slot in tail if user else shared + tail:
            order.add(slot)
        order.touch_chain(shared + tail)
    coldest = _order(order)
    assert coldest[-2:] == [1, 0]  # the shared head is the most recent: it leaves last
    assert coldest[:2] == [11, 10]  # the first user's tail, tail first


def test_when_a_chunk_leaves_the_chunks_after_it_leave_before_anything_reachable():
    order = PrefixRecencyOrder()
    for slot in range(8):
        order.add(slot)
    order.touch_chain([0, 1, 2, 3])  # chain A
    order.touch_chain([4, 5, 6, 7])  # chain B, more recent
    order.remove(1)  # A's second chunk leaves (deleted): 2 and 3 can no longer be reached
    assert _order(order)[:1] == [2]  # its child is cut off: first to go
    order.remove(2)
    assert _order(order)[:1] == [3]  # and then the child's child
    order.remove(3)
    assert _order(order) == [0, 7, 6, 5, 4]  # only then the reachable chains, by recency
    assert len(order) == 5


def test_a_pinned_chunk_keeps_its_chain_and_a_cut_off_chunk_linked_again_is_reachable():
    order = PrefixRecencyOrder()
    for slot in range(3):
        order.add(slot)
    order.touch_chain([0, 1, 2])
    order.pin(0)  # a lease on the head: not walked, but its chain holds
    assert _order(order) == [2, 1]
    order.unpin(0)
    assert _order(order) == [2, 1, 0]
    order.remove(0)
    assert _order(order)[:1] == [1]  # cut off
    order.add(0)  # the head is put again, with its chain
    order.touch_chain([0, 1, 2])
    assert _order(order) == [2, 1, 0]  # reachable again, tail first


def test_a_slot_reused_after_leaving_carries_nothing_of_its_old_chain():
    order = PrefixRecencyOrder()
    for slot in range(3):
        order.add(slot)
    order.touch_chain([0, 1, 2])
    order.remove(1)
    order.remove(2)
    order.add(1)  # slot 1 now holds another key, a chain head of its own
    order.remove(0)
    assert _order(order) == [1]  # not cut off by its slot's old parent


# -- PrefixOrder (prefix) in-process -------------------------------------------------
def _put_and_read(order: PrefixOrder, chain: list[int], reads: int) -> None:
    for slot in chain:
        order.add(slot)
    order.touch_chain(chain, read=False)  # the put
    for _ in range(reads):
        order.touch_chain(chain)  # a get, a lease, a lookup's touch


def test_prefix_keeps_the_most_read_chain_over_a_more_recent_one_read_less():
    """A chain read twice outlasts one put after it and never read (prefix-recency would evict the older chain first);
    inside each chain the tail leaves first."""
    order = PrefixOrder()
    _put_and_read(order, [0, 1, 2], reads=2)
    _put_and_read(order, [3, 4, 5], reads=0)
    assert _order(order) == [5, 4, 3, 2, 1, 0]
    assert [order.reads(s) for s in (0, 5)] == [NEW_READS + 2, NEW_READS]


def test_prefix_refuses_a_newcomer_while_the_coldest_is_read_as_often_and_counts_refusals():
    """The coldest chunk read at least as often as a newcomer counts: refused (and counted); refused once, the
    same key counts its refusal as a read and gets in against a chunk only put."""
    order = PrefixOrder()
    _put_and_read(order, [0, 1], reads=1)
    assert not order.admits("new") and order.refused == 1 and order.refusals("new") == 1
    assert not order.admits("new")  # worth 1 + 1, the coldest was read twice: still refused
    fresh = PrefixOrder()
    _put_and_read(fresh, [0, 1], reads=0)
    assert not fresh.admits("again")  # a newcomer against a chunk only put: as often, refused
    assert fresh.admits("again")  # offered again, its refusal counts: it gets in
    assert fresh.refused == 1


def test_prefix_lets_cut_off_chunks_go_first_whatever_their_reads():
    """A chunk whose prefix left is worth nothing: it leaves first even read often (before a newer chunk only
    put), and never refuses a newcomer."""
    order = PrefixOrder()
    _put_and_read(order, [0, 1, 2], reads=2)
    _put_and_read(order, [3], reads=0)
    order.remove(0)
    assert _order(order) == [1, 3, 2]  # 1 is cut off; 3 was read less than 2
    assert order.admits("new")


def test_prefix_ages_counts_so_a_chain_nobody_reads_cools_and_newcomers_get_in():
    """Every AGE_EVERY_HELD times the chunks held were named by batches, every count halves (lazily: no pass
    over the chunks), so a chain nobody reads any more cools and stops refusing newcomers."""
    order = PrefixOrder()
    others = list(range(10, 110))
    _put_and_read(order, others, reads=0)
    _put_and_read(order, [0, 1], reads=MAX_READS + 5)  # capped
    assert order.agings == 0 and order.reads(0) == MAX_READS
    batches = 0
    while order.agings < 4:  # 15 -> 7 -> 3 -> 1 -> 0
        order.touch_chain(others, read=False)
        batches += 1
    assert batches * len(others) >= 4 * AGE_EVERY_HELD * len(order) - 2 * len(others)  # ages with traffic
    assert order.reads(0) == order.reads(1) == 0
    assert sorted(_order(order)) == sorted([0, 1, *others])
    assert order.admits("new")  # the coldest is read 0 times now


def test_prefix_remembers_refused_keys_in_fixed_bytes():
    """Refused keys are counted in a sketch of fixed size (never a set of keys), an estimate never under the
    count (a key sharing all its counters with others may be over: let in at once): each of 2,000 keys refused
    once gets in when offered again."""
    order = PrefixOrder()
    for slot in range(3000):
        order.add(slot)  # each only put: NEW_READS
    keys = [f"key{n}" for n in range(2000)]
    refused_first = [key for key in keys if not order.admits(key)]
    assert len(refused_first) > 0.8 * len(keys) and order.refused == len(refused_first)
    assert len(order._sketch) == SKETCH_ROWS * SKETCH_WIDTH and order.agings == 0
    assert all(order.refusals(key) >= 1 for key in refused_first)
    assert all(order.admits(key) for key in refused_first)


def _touch_chain_counting_then_touching(order: PrefixOrder, slots: list[int], read: bool) -> None:
    """PrefixOrder.touch_chain as it was: link, count every read (a move each), then touch tail first (a move
    each): the order the one-move version must leave, chunk for chunk."""
    order._link(slots)
    if read:
        for slot in slots:
            order._count_read(slot)
    for slot in reversed(slots):
        order.touch(slot)
    order._named_by_batches(len(slots))


def test_prefix_moves_each_chunk_of_a_batch_once_and_leaves_the_order_touching_twice_left():
    """Random adds, removes, pins, chains with repeats and pinned chunks, reads and puts, agings: the same walk
    and the same counts as counting the batch first and touching it after."""
    rng = random.Random(11)
    fast, slow = PrefixOrder(), PrefixOrder()
    held: set[int] = set()
    pinned: set[int] = set()
    for step in range(30_000):
        op, slot = rng.random(), rng.randrange(2 * MIN_ITEMS)
        if slot not in held and slot not in pinned:
            for order in (fast, slow):
                order.add(slot)
            held.add(slot)
        elif op < 0.1:
            for order in (fast, slow):
                order.remove(slot)
            held.discard(slot)
            pinned.discard(slot)
        elif op < 0.15 and slot in held:
            for order in (fast, slow):
                order.pin(slot)
            held.remove(slot)
            pinned.add(slot)
        elif op < 0.2 and slot in pinned:
            for order in (fast, slow):
                order.unpin(slot)
            pinned.remove(slot)
            held.add(slot)
        else:
            known = sorted(held | pinned)
            chain = rng.choices(known, k=rng.randrange(1, 9))  # repeats and pinned chunks included
            read = op < 0.8
            fast.touch_chain(chain, read)
            _touch_chain_counting_then_touching(slow, chain, read)
        if step % 1000 == 0:
            assert _order(fast) == _order(slow), step
    assert fast.agings > 5  # the counts were halved along the way
    assert _order(fast) == _order(slow)
    assert [fast.reads(s) for s in range(2 * MIN_ITEMS)] == [slow.reads(s) for s in range(2 * MIN_ITEMS)]


@pytest.mark.parametrize("policy", [LruOrder, PrefixRecencyOrder, PrefixOrder])
def test_an_order_keeps_no_object_per_chunk_and_stays_consistent_under_random_use(policy):
    """Columns only (26 bytes a slot for prefix, 24 for prefix-recency, 8 for LRU); every listed slot walked once,
    whatever the ops."""
    rng = random.Random(7)
    order = policy()
    held: set[int] = set()
    pinned: set[int] = set()
    for _ in range(20_000):
        op = rng.random()
        slot = rng.randrange(3 * MIN_ITEMS)
        if slot not in held and slot not in pinned:
            order.add(slot)
            held.add(slot)
        elif op < 0.2:
            order.remove(slot)
            held.discard(slot)
            pinned.discard(slot)
        elif op < 0.3 and slot in held:
            order.pin(slot)
            held.discard(slot)
            pinned.add(slot)
        elif op < 0.4 and slot in pinned:
            order.unpin(slot)
            pinned.discard(slot)
            held.add(slot)
        elif op < 0.7:
            chain = [s for s in rng.sample(range(3 * MIN_ITEMS), 6) if s in held or s in pinned]
            order.touch_chain(chain, read=op < 0.6)
        else:
            order.touch(slot)
    walked = _order(order)
    assert sorted(walked) == sorted(held) and len(order) == len(held)
    columns = [v for v in vars(order).values() if isinstance(v, memoryview)]
    columns += [v for v in vars(getattr(order, "_lists", None) or order._list).values() if isinstance(v, memoryview)]
    per_slot = sum(c.itemsize for c in columns)
    assert per_slot == {LruOrder: 8, PrefixRecencyOrder: 24, PrefixOrder: 26}[policy]


# -- both policies on real nodes ----------------------------------------------------------------
def test_a_prefix_recency_node_keeps_whole_prefixes_where_an_lru_node_keeps_tails(node_factory, redis_server):
    """Four chains of 4 chunks into a DRAM of 10: LRU keeps the third chain's tail (unreachable: no prefix
    hits), prefix-recency keeps its head."""
    chains = [numbered_chunks(f"chain{c}", 4, CHUNK_BYTES, seed=c) for c in range(4)]
    found = {}
    for policy in ("lru", "prefix-recency"):
        node = node_factory("--eviction", policy, dram=str(10 * CHUNK_BYTES), ns=f"ev-{policy}")
        url = f"kvpool://127.0.0.1:{redis_server.port}/ev-{policy}?connections_per_node=1"
        with SyncPoolClient(PoolConfig.from_url(url)) as client:
            for chain in chains:
                client.put(chain)  # one batch each, in prefix order
            found[policy] = [client.hit_prefix([c.key for c in chain]) for chain in chains]
            held = [sum(client.contains([c.key for c in chain])) for chain in chains]
        assert sum(held) == 10, (policy, held)
        node.stop()
    assert found["lru"] == [0, 0, 4, 4]  # the third chain's head went first; its tail stays, unreachable
    assert found["prefix-recency"] == [0, 2, 4, 4]  # the third chain's tail went first; its head still hits


@pytest.mark.parametrize("touched", [False, True])
def test_a_lookups_touch_keeps_a_looked_up_only_prefix_in_the_pool(node_factory, redis_server, touched):
    """Chain A is put, then only looked up (served from an engine's own tier, say) while B and C are put:
    told by TOUCH, the node keeps A's head and lets B's tail go; not told, A's tail goes first and
    then its head."""
    import asyncio

    from backend.protocol import Op
    from backend.protocol.reads import Touch
    from kvpool import PoolClient

    ns = f"touch-{int(touched)}"
    node_factory("--eviction", "prefix-recency", dram=str(10 * CHUNK_BYTES), ns=ns)
    a, b, c = (numbered_chunks(name, 4, CHUNK_BYTES, seed=i) for i, name in enumerate("abc"))

    async def scenario() -> list[int]:
        url = f"kvpool://127.0.0.1:{redis_server.port}/{ns}?connections_per_node=1&touch=off"
        async with PoolClient(PoolConfig.from_url(url)) as client:
            await client.put(a)
            await client.put(b)
            if touched:
                (node,) = await client.nodes(refresh=True)
                answer = await client.connections.to(node).request(Op.TOUCH, Touch.encode_request([[x.key for x in a]]))
                assert answer is not None
            await client.put(c)  # 12 chunks in a DRAM of 10: two leave
            return [await client.hit_prefix([x.key for x in chain]) for chain in (a, b, c)]

    found = asyncio.run(scenario())
    assert found == ([4, 2, 4] if touched else [2, 4, 4])


@pytest.mark.parametrize("touch", ["off", "on", "auto"])
def test_a_lookup_keeps_the_prefix_it_found_hot_on_a_prefix_node_unless_touch_is_off(node_factory, redis_server, touch):
    """The client's side of the test above: ``hit_prefix`` alone (no get) is told to the node, batched; by
    default (``touch=auto``) too, since the node's registry entry names a prefix order."""
    from backend.counters import ClientCounter
    from tests.support.waits import wait_until

    ns = f"client-touch-{touch}"
    node_factory("--eviction", "prefix-recency", dram=str(10 * CHUNK_BYTES), ns=ns)
    a, b, c = (numbered_chunks(name, 4, CHUNK_BYTES, seed=i) for i, name in enumerate("abc"))
    query = "" if touch == "auto" else f"&touch={touch}"  # auto: the URL says nothing
    url = f"kvpool://127.0.0.1:{redis_server.port}/{ns}?connections_per_node=1{query}"
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(a)
        client.put(b)
        assert client.hit_prefix([x.key for x in a]) == 4  # a lookup that found A; no get follows
        (node,) = client.nodes()
        assert node.eviction == "prefix-recency" and node.takes_touches
        if touch != "off":
            assert wait_until(lambda: client.node_stats(node)["counters"].get("touched_keys", 0) == 4)
            assert client.counters[ClientCounter.TOUCHES_SENT] == 1
        client.put(c)
        found = [client.hit_prefix([x.key for x in chain]) for chain in (a, b, c)]
    assert found == ([2, 4, 4] if touch == "off" else [4, 2, 4])


def test_by_default_a_client_keeps_no_lookup_for_an_lru_node_and_touches_it_only_when_told_to(
    node_factory, redis_server
):
    """``touch=auto`` against a pool of lru nodes: no TOUCH sent, none counted as dropped (no found prefix is
    kept); ``touch=on`` still touches it."""
    import time

    from backend.counters import ClientCounter
    from tests.support.waits import wait_until

    ns = "client-touch-lru"
    node_factory(dram=str(10 * CHUNK_BYTES), ns=ns)  # --eviction lru, the default
    a = numbered_chunks("a", 4, CHUNK_BYTES, seed=0)
    base = f"kvpool://127.0.0.1:{redis_server.port}/{ns}?connections_per_node=1"
    with SyncPoolClient(PoolConfig.from_url(base)) as client:
        client.put(a)
        assert client.hit_prefix([x.key for x in a]) == 4
        (node,) = client.nodes()
        assert node.eviction == "lru" and not node.takes_touches
        time.sleep(0.3)  # six flush periods: a touch kept would have gone by now
        assert client.node_stats(node)["counters"].get("touched_keys", 0) == 0
        counters = client.counters
        assert counters.get(ClientCounter.TOUCHES_SENT, 0) == counters.get(ClientCounter.TOUCHES_DROPPED, 0) == 0
    with SyncPoolClient(PoolConfig.from_url(base + "&touch=on")) as client:
        assert client.hit_prefix([x.key for x in a]) == 4
        assert wait_until(lambda: client.node_stats(node)["counters"].get("touched_keys", 0) == 4)


def test_a_registry_entry_without_an_eviction_order_is_an_lru_node_that_takes_no_touches_by_default():
    """An entry written by an older build has no ``eviction`` field: lru, untouched under ``touch=auto``."""
    import asyncio
    import json

    from backend.client.context import ClientContext
    from backend.client.touch import LookupTouches
    from backend.metadata import Location, NodeInfo

    fields = json.loads(NodeInfo("old", "127.0.0.1", 1, 7).to_json())
    del fields["eviction"]
    old = NodeInfo.from_json(json.dumps(fields))
    new = NodeInfo("new", "127.0.0.1", 2, 1, eviction="prefix")
    assert (old.eviction, old.takes_touches, new.takes_touches) == ("lru", False, True)
    sent: list[str] = []

    async def locate(keys):
        return [[Location("old", 7, "dram", 1, 0), Location("new", 1, "dram", 1, 0)] for _ in keys]

    async def send(node, meta):
        sent.append(node.node_id)

    async def scenario(touch: str, nodes: dict[str, NodeInfo]) -> bool:
        ctx = ClientContext(PoolConfig.from_url(f"kvpool://127.0.0.1:1/ns?touch={touch}"))
        touches = LookupTouches(ctx, locate, nodes.get, send)
        touches.nodes_changed({(n.node_id, n.epoch) for n in nodes.values()})
        await touches.flush([["k@0", "k@1"]])
        return touches.wanted

    assert asyncio.run(scenario("auto", {"old": old, "new": new})) is True
    assert sent == ["new"]
    assert asyncio.run(scenario("auto", {"old": old})) is False  # nothing takes them: no lookup is kept
    sent.clear()
    assert asyncio.run(scenario("on", {"old": old, "new": new})) is True
    assert sorted(sent) == ["new", "old"]
    assert asyncio.run(scenario("off", {"old": old, "new": new})) is False


def test_a_node_that_refuses_touch_is_not_touched_again_and_is_counted_once(caplog):
    """An older node answers TOUCH with a protocol error (its decode_header knows no op 15); one cannot be
    started from this tree, so the refusal is injected through the sender, the part's transport seam."""
    import asyncio

    from backend.client.context import ClientContext
    from backend.client.touch import LookupTouches
    from backend.counters import ClientCounter
    from backend.errors import ProtocolError
    from backend.metadata import Location, NodeInfo

    old, new = NodeInfo("old", "127.0.0.1", 1, 7), NodeInfo("new", "127.0.0.1", 2, 1)
    sent: list[tuple[str, bytes]] = []

    async def locate(keys):
        return [[Location("old", 7, "dram", 1, 0), Location("new", 1, "dram", 1, 0)] for _ in keys]

    async def send(node, meta):
        sent.append((node.node_id, meta))
        if node.node_id == "old":
            raise ProtocolError("node: unknown op code 15")

    async def scenario() -> ClientContext:
        ctx = ClientContext(PoolConfig.from_url("kvpool://127.0.0.1:1/ns?touch=on"))
        touches = LookupTouches(ctx, locate, {"old": old, "new": new}.get, send)
        for _ in range(3):
            await touches.flush([["k@0", "k@1"]])
        return ctx

    ctx = asyncio.run(scenario())
    assert [node for node, _ in sent] == ["old", "new", "new", "new"]  # tried once, then left alone
    assert ctx.counters[ClientCounter.TOUCH_REFUSALS] == 1
    assert ctx.counters[ClientCounter.TOUCHES_SENT] == 3
    assert ctx.counters[ClientCounter.TOUCHES_DROPPED] == 6  # the old node's share of each batch
    assert sum("does not take lookup touches" in r.message for r in caplog.records) == 1


def test_a_prefix_node_keeps_a_read_chain_and_refuses_newcomers_chunk_by_chunk(node_factory, redis_server):
    """Chain A is put and read twice, B put, then C into a DRAM of 10: prefix-recency would evict A's tail; prefix
    keeps A (read more often than any newcomer counts) and refuses C's last two chunks, each as "no room"
    (not stored, the rest of the put stored), counted by the node."""
    from backend.errors import CapacityError, PutOutcome

    ns = "ev-prefix"
    node_factory("--eviction", "prefix", dram=str(10 * CHUNK_BYTES), ns=ns)
    a, b, c = (numbered_chunks(name, 4, CHUNK_BYTES, seed=i) for i, name in enumerate("abc"))
    url = f"kvpool://127.0.0.1:{redis_server.port}/{ns}?connections_per_node=1"
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(a)
        for _ in range(2):
            assert all(client.get([x.key for x in a]))
        client.put(b)
        with pytest.raises(CapacityError) as refused:
            client.put(c)
        found = [client.hit_prefix([x.key for x in chain]) for chain in (a, b, c)]
        (node,) = client.nodes()
        counters = client.node_stats(node)["counters"]
    assert found == [4, 4, 2]
    assert [refused.value.outcomes[x.key] for x in c] == [PutOutcome.STORED] * 2 + [PutOutcome.NO_ROOM] * 2
    assert counters.get("put_rejected_capacity") == 2


def test_a_prefix_node_refuses_the_rest_of_a_put_after_a_refused_chunk(node_factory, redis_server):
    """A chunk refused by the order cuts its put's chain: a later chunk of the same put that the order alone
    would let in (refused before, its refusal now counts as a read) is refused too, since no lookup could
    reach it past the missing one; it would only have evicted a reachable chunk."""
    from backend.errors import CapacityError, PutOutcome

    ns = "ev-cut"
    node_factory("--eviction", "prefix", dram=str(10 * CHUNK_BYTES), ns=ns)
    a, b, c = (numbered_chunks(name, 4, CHUNK_BYTES, seed=i) for i, name in enumerate("abc"))
    (x,) = numbered_chunks("x", 1, CHUNK_BYTES, seed=7)
    url = f"kvpool://127.0.0.1:{redis_server.port}/{ns}?connections_per_node=1"
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put(a)
        for _ in range(2):
            assert all(client.get([k.key for k in a]))
        client.put(b)
        with pytest.raises(CapacityError):
            client.put(c)  # c2 and c3 refused, each remembered in the node's sketch
        with pytest.raises(CapacityError) as refused:
            client.put([x, c[3]])  # x is new and refused; c3, offered again, is worth more than the coldest
        held = client.get([x.key, c[3].key])
        (node,) = client.nodes()
        counters = client.node_stats(node)["counters"]
    assert [refused.value.outcomes[k.key] for k in (x, c[3])] == [PutOutcome.NO_ROOM] * 2
    assert held == [None, None]
    assert counters.get("put_rejected_capacity") == 4
