"""Eviction policies for a prefix cache, simulated on a serving trace: what a hit is worth.

    python -m bench.workload.sim --trace multi-round --capacity 0.5
    python -m bench.workload.sim --all                     # every trace x 0.25, 0.5, 1.0
    python -m bench.workload.sim --all --plot docs/pictures

A pool of C chunks (a fraction of the trace's working set) replays the trace
(:mod:`bench.workload.traces`): each request looks its chunks up in prefix order (hits until
the first miss, as LMCache does), loads the hits and stores the chunks after the first miss
that the pool does not hold. A request's own chunks are not evicted while it is served (the
node leases them); a chunk that finds no room ends the request's store. The node's orders
(``lru``, ``prefix-recency``, ``prefix``, and ``tail-first`` on ``lru``'s lists) are the node's
own classes (``backend/node/store/eviction.py``) driven through :class:`NodeOrder`, so a simulated
row is what the node's rule does with the calls the node would make. Policies:

* ``lru``: the node's ``eviction=lru``: a request's chunks touched head first, so the head of a
  chain is its oldest chunk;
* ``tail-first``: LMCache's local-tier rule (suffixes before prefixes): touched tail first;
* ``lfu``: fewest reads first, the least recent among equals;
* ``s3-fifo``: a small FIFO (10 %) for new chunks, a main FIFO with second chances, a ghost
  list of keys evicted from the small one (a chunk read again while small, or seen in the
  ghost list, goes to main);
* ``prefix-recency``: the node's ``eviction=prefix-recency``: a request's chunks touched tail
  first, and when a chunk leaves, the chunks after it in its chain (now unreachable: a lookup
  stops before them) leave before anything still reachable (:class:`PrefixRecency`);
* ``prefix``: the node's ``eviction=prefix``: which chains stay: the fewest reads leave first
  (counts halved each time the chunks held were named four times over by batches), unreachable
  chunks before all, tail first inside a chain, and a newcomer does not evict a chunk read as
  often as it, its past refusals counted as reads (:class:`Prefix`; named ``prefix-freq`` until
  it became the node's ``prefix``);
* ``belady``: the chunk whose next request is furthest away (or never) leaves. A reference,
  not a bound: for prefix chains keeping the furthest-used chunk is not optimal (a chunk is
  worth nothing without its prefix), so a policy may beat it;
* ``+oracle``: admission with Belady's knowledge: a chunk no later request reads is not stored;
* ``+second``: a practical admission rule (a doorkeeper): a chunk is stored the second time a
  lookup misses it, never the first.

Modeled TTFT per request = hit bytes / load rate + missed tokens / prefill rate. The load
rate defaults to kvpool's measured get (docs/benchmarks.md); the prefill side is modeled,
not measured: the preset's 2 x parameters FLOPs per token at a fraction of an H100's dense
BF16 peak (docs/benchmarks.md, "What a hit is worth (simulated)").
"""

from __future__ import annotations

import argparse
import heapq
import statistics
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from backend.node.store.eviction import EvictionOrder, order_named
from bench.workload.plots import NO_MATPLOTLIB, pyplot, save
from bench.workload.traces import PRESETS, TRACES, ModelPreset, Trace, make_trace

CAPACITIES = (0.25, 0.5, 1.0)
H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA H100 SXM datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity)
PREFILL_MFU = 0.5  # the fraction of that peak a prefill reaches (assumed)
LOAD_GBPS = 5.41  # kvpool's median get, make demo, 2026-12-04 (docs/benchmarks.md, first table)
NEVER = float("inf")


def modeled_prefill_tokens_per_s(preset: ModelPreset, mfu: float = PREFILL_MFU) -> float:
    """Prefill tokens per second on one H100: peak x MFU / (2 x parameters) FLOPs per token."""
    return H100_BF16_DENSE_FLOPS * mfu / (2 * preset.params_billion * 1e9)


class Policy:
    """What a pool keeps: the cached keys and the choice of a victim. The simulator drives it."""

    name = "base"

    def __init__(self, capacity: int, trace: Trace) -> None:
        self.capacity = capacity

    def __contains__(self, key: int) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def begin(self, index: int, keys: Sequence[int]) -> None:
        """Request ``index`` arrives (Belady learns the time)."""

    def store(self, key: int, pinned: set[int]) -> bool:
        """Hold ``key``, evicting what is not ``pinned`` to make room; False: no room (or not let in)."""
        raise NotImplementedError

    def served(self, read: Sequence[int], new: Sequence[int]) -> None:
        """A request was served: the chunks the node saw read, then those it stored, head first."""


class NodeOrder(Policy):
    """A node's eviction order (``backend/node/store/eviction.py``, the ``eviction`` setting ``order_name``) as the pool.

    The rule is the node's own class, not a copy: this maps the simulator's keys to slots as the
    node's chunk table does (a freed slot is reused first) and tells the order what the node
    would. A store that needs room asks ``admits`` (the node's put refuses the newcomer when the
    order does), then evicts the coldest chunk; a chunk of the request (``pinned``: found, or
    just stored) met on the way is pinned, as a lease or a landing put pins it on the node, and a
    stored chunk stays pinned (out of the order) until its request is served. Served, the request's
    pins end, and the node hears two batches: the chunks it saw read (``touch_chain(read=True)``:
    its get, or, where lookups are seen, their touch) and the chunks stored
    (``touch_chain(read=False)``, the put). The node links a chunk to its parent only inside a batch, so the first stored
    chunk joins the chain read before it when a later request reads both.
    """

    name = "lru"
    order_name = "lru"

    def __init__(self, capacity: int, trace: Trace) -> None:
        super().__init__(capacity, trace)
        self.order: EvictionOrder = order_named(self.order_name)
        self._slots: dict[int, int] = {}  # key -> slot
        self._keys: list[int | None] = []  # slot -> key
        self._free: list[int] = []  # freed slots, the last freed reused first (as ChunkTable)
        self._pinned: dict[int, None] = {}  # slots out of the order until the request is served, in pin order

    def __contains__(self, key: int) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def store(self, key: int, pinned: set[int]) -> bool:
        if len(self._slots) >= self.capacity and not self.order.admits(key):
            return False  # the order keeps what it holds: the node answers the put "no room"
        while len(self._slots) >= self.capacity:
            victim = self._coldest(pinned)
            if victim is None:
                return False
            self.order.remove(victim)
            gone, self._keys[victim] = self._keys[victim], None
            assert gone is not None, f"slot {victim} is in the order but holds no key"
            del self._slots[gone]
            self._free.append(victim)
        slot = self._free.pop() if self._free else len(self._keys)
        if slot == len(self._keys):
            self._keys.append(key)
        else:
            self._keys[slot] = key
        self._slots[key] = slot
        self._pinned[slot] = None  # landing: out of the order until its put commits
        return True

    def _coldest(self, pinned: set[int]) -> int | None:
        """The first slot to leave that holds no chunk of the request; those met first are pinned (out of the
        walk, which is valid only until the order changes: it starts again)."""
        while (slot := next(self.order.coldest(), None)) is not None and self._keys[slot] in pinned:
            self.order.pin(slot)
            self._pinned[slot] = None
        return slot

    def served(self, read: Sequence[int], new: Sequence[int]) -> None:
        for slot in self._pinned:  # the request's leases end and its put commits
            self.order.unpin(slot)
        self._pinned.clear()
        self._touch([self._slots[key] for key in read], [self._slots[key] for key in new])

    def _touch(self, read: list[int], new: list[int]) -> None:
        if read:
            self.order.touch_chain(read, read=True)
        if new:
            self.order.touch_chain(new, read=False)


class LRU(NodeOrder):
    """The node's ``eviction=lru``: a request's chunks touched head first."""


class TailFirst(NodeOrder):
    """LMCache's local-tier rule (suffixes before prefixes): LRU with a request's chunks touched tail first, as one
    batch. Not a node order: the engines' local tiers of :func:`simulate`."""

    name = "tail-first"

    def _touch(self, read: list[int], new: list[int]) -> None:
        self.order.touch_chain([*read, *new][::-1])


class PrefixRecency(NodeOrder):
    """The node's ``eviction=prefix-recency`` (``PrefixRecencyOrder``)."""

    name = order_name = "prefix-recency"


class Prefix(NodeOrder):
    """The node's ``eviction=prefix`` (``PrefixOrder``): the most-read chains stay, held against newcomers until
    they cool (named ``prefix-freq`` until it became the node's ``prefix``)."""

    name = order_name = "prefix"


class LFU(Policy):
    name = "lfu"

    def __init__(self, capacity: int, trace: Trace) -> None:
        super().__init__(capacity, trace)
        self._freq: dict[int, tuple[int, int]] = {}  # key -> (reads, last tick)
        self._heap: list[tuple[int, int, int]] = []
        self._tick = 0

    def __contains__(self, key: int) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def _set(self, key: int, reads: int) -> None:
        self._tick += 1
        self._freq[key] = (reads, self._tick)
        heapq.heappush(self._heap, (reads, self._tick, key))

    def store(self, key: int, pinned: set[int]) -> bool:
        skipped: list[tuple[int, int, int]] = []
        while len(self._freq) >= self.capacity and self._heap:
            reads, tick, victim = heapq.heappop(self._heap)
            if self._freq.get(victim) != (reads, tick):
                continue  # stale entry
            if victim in pinned:
                skipped.append((reads, tick, victim))
                continue
            del self._freq[victim]
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(self._freq) >= self.capacity:
            return False
        self._set(key, 0)
        return True

    def served(self, read: Sequence[int], new: Sequence[int]) -> None:
        for key in [*read, *new]:
            self._set(key, self._freq[key][0] + 1)


class S3FIFO(Policy):
    name = "s3-fifo"
    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: int, trace: Trace) -> None:
        super().__init__(capacity, trace)
        self._small_capacity = max(1, int(capacity * self.SMALL_FRACTION))
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._freq: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def _evict(self, pinned: set[int]) -> bool:
        for _ in range(4 * (len(self._freq) + 1)):  # every chunk can be passed over a few times
            if self._small and (len(self._small) >= self._small_capacity or not self._main):
                key, _ = self._small.popitem(last=False)
                if key in pinned:
                    self._small[key] = None
                elif self._freq[key] > 0:
                    self._main[key] = None
                else:
                    del self._freq[key]
                    self._ghost[key] = None
                    while len(self._ghost) > self.capacity - self._small_capacity:
                        self._ghost.popitem(last=False)
                    return True
            elif self._main:
                key, _ = self._main.popitem(last=False)
                if key in pinned or self._freq[key] > 0:
                    self._freq[key] = max(0, self._freq[key] - 1)
                    self._main[key] = None
                else:
                    del self._freq[key]
                    return True
            else:
                return False
        return False

    def store(self, key: int, pinned: set[int]) -> bool:
        while len(self._freq) >= self.capacity:
            if not self._evict(pinned):
                return False
        self._freq[key] = 0
        if key in self._ghost:  # evicted too early once: straight to main
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        return True

    def served(self, read: Sequence[int], new: Sequence[int]) -> None:
        for key in read:
            self._freq[key] = min(self.MAX_FREQ, self._freq[key] + 1)


class Belady(Policy):
    """Furthest next request first (a reference; see the module's docstring)."""

    name = "belady"

    def __init__(self, capacity: int, trace: Trace) -> None:
        super().__init__(capacity, trace)
        self._uses: defaultdict[int, deque[int]] = defaultdict(deque)
        for index, request in enumerate(trace.requests):
            for key in request.keys:
                self._uses[key].append(index)
        self._cached: set[int] = set()
        self._heap: list[tuple[float, int]] = []  # (-next use, key), stale entries skipped

    def __contains__(self, key: int) -> bool:
        return key in self._cached

    def __len__(self) -> int:
        return len(self._cached)

    def next_use(self, key: int) -> float:
        uses = self._uses.get(key)
        return uses[0] if uses else NEVER

    def begin(self, index: int, keys: Sequence[int]) -> None:
        for key in keys:
            uses = self._uses[key]
            while uses and uses[0] <= index:
                uses.popleft()
            if key in self._cached:  # its next use moved on: index it again
                heapq.heappush(self._heap, (-self.next_use(key), key))

    def store(self, key: int, pinned: set[int]) -> bool:
        skipped: list[tuple[float, int]] = []
        while len(self._cached) >= self.capacity and self._heap:
            negative_use, victim = heapq.heappop(self._heap)
            if victim not in self._cached or -negative_use != self.next_use(victim):
                continue
            if victim in pinned:
                skipped.append((negative_use, victim))
                continue
            self._cached.discard(victim)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(self._cached) >= self.capacity:
            return False
        self._cached.add(key)
        return True

    def served(self, read: Sequence[int], new: Sequence[int]) -> None:
        for key in new:  # the request's keys already held were indexed again in begin()
            heapq.heappush(self._heap, (-self.next_use(key), key))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (LRU, TailFirst, LFU, S3FIFO, PrefixRecency, Prefix, Belady)}


class Admission:
    """Whether a missed chunk is stored at all (``all``: always)."""

    name = "all"

    def admit(self, index: int, key: int) -> bool:
        return True


class OracleAdmission(Admission):
    """Not stored if no later request reads it (Belady's knowledge: an upper reference)."""

    name = "oracle"

    def __init__(self, trace: Trace) -> None:
        self._last: dict[int, int] = {}
        for index, request in enumerate(trace.requests):
            for key in request.keys:
                self._last[key] = index

    def admit(self, index: int, key: int) -> bool:
        return self._last[key] > index


class SecondSight(Admission):
    """A doorkeeper: stored the second time a lookup misses it."""

    name = "second"

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def admit(self, index: int, key: int) -> bool:
        if key in self._seen:
            return True
        self._seen.add(key)
        return False


def _admission(name: str, trace: Trace) -> Admission:
    if name == "oracle":
        return OracleAdmission(trace)
    if name == "second":
        return SecondSight()
    return Admission()


# The rows of a table: policy, admission.
DEFAULT_RUNS: tuple[tuple[str, str], ...] = (
    *((name, "all") for name in POLICIES),
    ("lru", "oracle"),
    ("prefix-recency", "oracle"),
    ("prefix-recency", "second"),
    ("prefix", "oracle"),
    ("belady", "oracle"),
)


@dataclass(frozen=True)
class Costs:
    """What a token costs: KV bytes, the load rate, the (modeled) prefill rate."""

    kv_bytes_per_token: int
    load_bytes_per_s: float
    prefill_tokens_per_s: float

    def ttft_s(self, hit_tokens: int, missed_tokens: int) -> float:
        return hit_tokens * self.kv_bytes_per_token / self.load_bytes_per_s + missed_tokens / self.prefill_tokens_per_s


@dataclass(frozen=True)
class Result:
    """One policy on one trace at one capacity."""

    trace: str
    policy: str
    capacity_fraction: float
    capacity_chunks: int
    hit_tokens: int  # found locally or in the pool
    pool_hit_tokens: int  # loaded from the pool
    total_tokens: int
    loaded_bytes: int
    stored_bytes: int
    peak_chunks: int
    request_hit_tokens: tuple[int, ...]
    ttft_s: tuple[float, ...]
    no_cache_ttft_s: tuple[float, ...]

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens

    @property
    def pool_hit_rate(self) -> float:
        return self.pool_hit_tokens / self.total_tokens

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(self.ttft_s)

    @property
    def ttft_vs_no_cache(self) -> float:
        return self.mean_ttft_s / statistics.fmean(self.no_cache_ttft_s)


def policy_label(policy: str, admission: str) -> str:
    return policy if admission == "all" else f"{policy}+{admission}"


def simulate(
    trace: Trace,
    policy: str,
    capacity_fraction: float,
    costs: Costs,
    admission: str = "all",
    *,
    local_fraction: float = 0.0,
    sees_lookups: bool | None = None,
) -> Result:
    """Replay ``trace`` through a pool of ``capacity_fraction`` of its working set under ``policy``.

    With ``local_fraction``, each engine keeps a local tier of that fraction of the working set
    (LMCache's local CPU tier, tail first) in front of the pool: a request reads its found
    prefix locally first, and gets from the pool only the chunks after that. ``sees_lookups``
    (default: only for the ``prefix`` policies) lets the pool count every chunk a lookup found as read, as
    kvpool's batched touch does; without it the pool sees only its gets.
    """
    capacity = max(1, round(capacity_fraction * trace.working_set_chunks))
    pool = POLICIES[policy](capacity, trace)
    admit = _admission(admission, trace)
    touch_found = policy.startswith("prefix") if sees_lookups is None else sees_lookups
    local_capacity = round(local_fraction * trace.working_set_chunks)
    engines = {e: TailFirst(local_capacity, trace) for e in range(trace.engines)} if local_capacity else {}
    hit_tokens = pool_tokens = loaded = stored = peak = 0
    request_hits: list[int] = []
    ttft: list[float] = []
    no_cache: list[float] = []
    for index, request in enumerate(trace.requests):
        keys, sizes = request.keys, request.chunk_tokens
        local = engines.get(request.engine)
        local_found = _found(local, keys) if local is not None else 0
        pool.begin(index, keys)
        found = _found(pool, keys)
        pinned = set(keys[:found])
        new: list[int] = []
        storing = True
        for position in range(found, len(keys)):
            key = keys[position]
            if key in pool:  # held, but unreachable past the miss: LMCache does not store it again
                continue
            # every missed chunk is offered (a doorkeeper counts the sighting); once one is
            # refused, the chunks after it are not stored: they cannot be reached without it
            storing = admit.admit(index, key) and storing
            if not storing:
                continue
            if not pool.store(key, pinned):
                break  # no room: the rest of the request is not stored
            pinned.add(key)
            new.append(key)
            stored += sizes[position] * costs.kv_bytes_per_token
        # what the node sees read: its gets (the found chunks after the local ones), or every found chunk
        pool.served(keys[:found] if touch_found else keys[local_found:found], new)
        if len(pool) > capacity:
            raise AssertionError(f"{policy} holds {len(pool)} chunks in a pool of {capacity}")
        peak = max(peak, len(pool))
        if local is not None:
            request_keys = set(keys)
            local_new = [key for key in keys if key not in local and local.store(key, request_keys)]
            local.served([k for k in keys if k in local and k not in local_new], local_new)
        request_hit = sum(sizes[: max(found, local_found)])
        from_pool = sum(sizes[local_found:found])
        hit_tokens += request_hit
        pool_tokens += from_pool
        loaded += from_pool * costs.kv_bytes_per_token
        request_hits.append(request_hit)
        ttft.append(costs.ttft_s(from_pool, request.tokens - request_hit))
        no_cache.append(costs.ttft_s(0, request.tokens))
    return Result(
        trace=trace.name,
        policy=policy_label(policy, admission),
        capacity_fraction=capacity_fraction,
        capacity_chunks=capacity,
        hit_tokens=hit_tokens,
        pool_hit_tokens=pool_tokens,
        total_tokens=trace.total_tokens,
        loaded_bytes=loaded,
        stored_bytes=stored,
        peak_chunks=peak,
        request_hit_tokens=tuple(request_hits),
        ttft_s=tuple(ttft),
        no_cache_ttft_s=tuple(no_cache),
    )


def _found(tier: Policy, keys: Sequence[int]) -> int:
    """How many of ``keys`` a prefix lookup finds in ``tier``: up to the first miss."""
    found = 0
    while found < len(keys) and keys[found] in tier:
        found += 1
    return found


def unbounded_hit_tokens(trace: Trace) -> int:
    """Tokens a pool that never evicts would hit: every chunk whose prefix was seen before."""
    seen: set[int] = set()
    hits = 0
    for request in trace.requests:
        position = 0
        while position < len(request.keys) and request.keys[position] in seen:
            hits += request.chunk_tokens[position]
            position += 1
        seen.update(request.keys)
    return hits


def run_table(
    trace: Trace,
    capacities: Iterable[float],
    costs: Costs,
    runs: Sequence[tuple[str, str]] = DEFAULT_RUNS,
    local_fraction: float = 0.0,
) -> list[Result]:
    return [
        simulate(trace, policy, fraction, costs, admission, local_fraction=local_fraction)
        for fraction in capacities
        for policy, admission in runs
    ]


def format_table(results: Sequence[Result]) -> str:
    lines = [
        "| trace | capacity | policy | token hit rate | pool hit rate | loaded GiB | stored GiB | mean TTFT s | p99 TTFT s | TTFT vs no cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        ttft = sorted(result.ttft_s)
        p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
        lines.append(
            f"| {result.trace} | {result.capacity_fraction:g} ({result.capacity_chunks} chunks) | {result.policy}"
            f" | {100 * result.token_hit_rate:.1f} % | {100 * result.pool_hit_rate:.1f} % | {result.loaded_bytes / 2**30:.1f} | {result.stored_bytes / 2**30:.1f}"
            f" | {result.mean_ttft_s:.3f} | {p99:.3f} | {result.ttft_vs_no_cache:.2f} |"
        )
    return "\n".join(lines)


def plot(results: Sequence[Result], directory: Path) -> list[Path]:
    """One PNG per trace: token hit rate against capacity, a line per policy."""
    plt = pyplot()
    if plt is None:
        print(NO_MATPLOTLIB)
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for trace in dict.fromkeys(r.trace for r in results):
        figure, axes = plt.subplots(figsize=(6, 4))
        rows = [r for r in results if r.trace == trace]
        for policy in dict.fromkeys(r.policy for r in rows):
            points = sorted((r.capacity_fraction, 100 * r.token_hit_rate) for r in rows if r.policy == policy)
            axes.plot(*zip(*points, strict=True), marker="o", label=policy, linestyle="--" if "+" in policy else "-")
        axes.set_xlabel("pool capacity (fraction of the working set)")
        axes.set_ylabel("token hit rate (%)")
        axes.set_title(f"{trace}: token hit rate by eviction policy (simulated)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
        written.append(save(plt, figure, directory / f"workload-sim-{trace}.png"))
    return written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.workload.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", choices=list(TRACES), default="multi-round")
    parser.add_argument("--capacity", type=float, action="append", help="fraction of the working set (repeatable)")
    parser.add_argument("--all", action="store_true", help="every trace at 0.25, 0.5 and 1.0")
    parser.add_argument("--model", choices=list(PRESETS), default="llama-3.1-8b")
    parser.add_argument(
        "--local",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="each engine's local tier, fraction of the working set",
    )
    parser.add_argument("--load-gbps", type=float, default=LOAD_GBPS, help="pool load rate, GB/s")
    parser.add_argument("--prefill-tps", type=float, help="prefill tokens/s (default: modeled from the preset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write hit rate vs capacity PNGs there")
    return parser


def main(argv: Sequence[str] | None = None, print_line: Callable[[str], None] = print) -> list[Result]:
    args = _parser().parse_args(argv)
    preset = PRESETS[args.model]
    costs = Costs(
        kv_bytes_per_token=preset.kv_bytes_per_token,
        load_bytes_per_s=args.load_gbps * 1e9,
        prefill_tokens_per_s=args.prefill_tps or modeled_prefill_tokens_per_s(preset),
    )
    print_line(preset.describe())
    print_line(
        f"load {args.load_gbps:g} GB/s; prefill {costs.prefill_tokens_per_s:,.0f} tokens/s"
        + (" (given)" if args.prefill_tps else f" (modeled: {PREFILL_MFU:g} of an H100's BF16 dense peak)")
    )
    names = list(TRACES) if args.all else [args.trace]
    capacities = args.capacity or (list(CAPACITIES) if args.all or args.plot else [0.5])
    results: list[Result] = []
    for name in names:
        trace = make_trace(name, seed=args.seed)
        print_line(trace.describe())
        print_line(
            f"a pool that never evicts hits {100 * unbounded_hit_tokens(trace) / trace.total_tokens:.1f} % of tokens"
        )
        results.extend(run_table(trace, capacities, costs, local_fraction=args.local))
    for line in format_table(results).splitlines():
        print_line(line)
    if args.plot:
        for path in plot(results, args.plot):
            print_line(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
