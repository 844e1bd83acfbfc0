"""Serving traces as LMCache sees them: requests of chunk keys in prefix order, seeded.

    python -m bench.workload.traces                     # every trace's parameters and size
    python -m bench.workload.traces --trace multi-round --users 8

A trace is a list of requests; a request is the engine that serves it and its prompt as
chunks of token ids. A chunk's key is the one LMCache 0.5.6 gives it
(``lmcache/v1/token_database.py``, ``ChunkedTokenDatabase`` without vLLM: the builtin
``hash`` of ``(prefix hash, chunk tokens as a tuple, ())``, the first prefix hash 0), so key
*k* depends on chunks 0..k, and a replay that feeds a request's ``token_ids()`` to a real
LMCache engine finds the same keys (:func:`chunk_keys` is that rule). Builtin ``hash`` of a
tuple of ints does not depend on ``PYTHONHASHSEED``.

A chunk's tokens come from a *content id* (:func:`chunk_tokens`): two chunks with one
content id and one length hold the same tokens. Generators hand out content ids; the
prefix structure of a trace is which content ids its requests share, in which order.

Traces (:data:`TRACES`):

* ``long-doc-qa``: LMCache's ``long_doc_qa`` shape: D documents of L chunks, read once in
  a warm-up round, then asked Q questions in later rounds (each a new chunk after the
  document), in a shuffled order, by any engine;
* ``multi-round``: U users behind one shared system prompt; every round each user appends
  new chunks to their conversation and sends all of it; users wander between engines;
* ``agent``: agents over a shared tool prompt and a long task context, each step a short
  append (one tool result) on everything before: long contexts, high reuse;
* ``mooncake``: the first 1,000 requests of Mooncake's released conversation trace
  (``bench/data/``; block hashes of 512 tokens, each block two chunks of 256 here).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from bench.paths import DATA

CHUNK_TOKENS = 256  # LMCache's default chunk size
VOCAB = 128_256  # Llama 3's vocabulary: token ids below it
LMCACHE_NONE_HASH = 0  # LMCache's first prefix hash without vLLM
MOONCAKE_SAMPLE = DATA / "mooncake_conversation_1000.jsonl.gz"
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class ModelPreset:
    """A model's KV cache size per token and the figures the prefill side is modeled from."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params_billion: float  # for the modeled prefill rate (bench/workload/sim.py)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, bf16 (2 bytes)."""
        return self.layers * self.kv_heads * self.head_dim * 2 * 2

    @property
    def kv_bytes_per_chunk(self) -> int:
        return self.kv_bytes_per_token * CHUNK_TOKENS

    def describe(self) -> str:
        return (
            f"{self.name}: {self.layers} layers x {self.kv_heads} kv heads x {self.head_dim} head dim x 2 (K, V) x 2 bytes"
            f" = {self.kv_bytes_per_token / 1024:g} KiB/token, {self.kv_bytes_per_chunk / 2**20:g} MiB per {CHUNK_TOKENS}-token chunk"
        )


# From each model's config.json (num_hidden_layers, num_key_value_heads, hidden_size / num_attention_heads).
PRESETS: dict[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        ModelPreset("llama-3.1-8b", layers=32, kv_heads=8, head_dim=128, params_billion=8.03),
        ModelPreset("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128, params_billion=7.62),
        # A small model for CI: KV of 1 KiB/token (256 KiB a chunk) keeps a replay on two cores short.
        ModelPreset("ci-tiny", layers=2, kv_heads=2, head_dim=64, params_billion=0.05),
        # Smaller still, for the Mooncake sample's 42,560-chunk working set (16 KiB a chunk: 665 MiB in all).
        ModelPreset("ci-micro", layers=1, kv_heads=1, head_dim=16, params_billion=0.01),
    )
}


@lru_cache(maxsize=1 << 16)
def _content_tokens(content: int) -> tuple[int, ...]:
    rng = random.Random(content)
    return tuple(rng.randrange(VOCAB) for _ in range(CHUNK_TOKENS))


def chunk_tokens(content: int, ntokens: int = CHUNK_TOKENS) -> tuple[int, ...]:
    """The token ids of a chunk of content id ``content``: the first ``ntokens`` of its 256."""
    if not 0 < ntokens <= CHUNK_TOKENS:
        raise ValueError(f"a chunk holds 1 to {CHUNK_TOKENS} tokens, not {ntokens}")
    return _content_tokens(content)[:ntokens]


def chunk_key(prefix_key: int, tokens: tuple[int, ...]) -> int:
    """LMCache's prefix-chained hash of one chunk (``TokenDatabase._hash_tokens``, no extra keys)."""
    return hash((prefix_key, tokens, ()))


def chunk_keys(token_ids: Sequence[int]) -> list[int]:
    """The keys LMCache gives a prompt's chunks, in prefix order (the last chunk may be partial)."""
    keys: list[int] = []
    prefix = LMCACHE_NONE_HASH
    for start in range(0, len(token_ids), CHUNK_TOKENS):
        prefix = chunk_key(prefix, tuple(token_ids[start : start + CHUNK_TOKENS]))
        keys.append(prefix)
    return keys


@dataclass(frozen=True)
class Request:
    """One prompt: the engine that serves it and its chunks in prefix order."""

    engine: int
    keys: tuple[int, ...]  # LMCache's chunk keys, prefix order
    chunk_tokens: tuple[int, ...]  # tokens in each chunk (256 but maybe the last)
    contents: tuple[int, ...]  # each chunk's content id (its tokens: chunk_tokens(content, n))

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    def token_ids(self) -> list[int]:
        """The prompt's token ids, for a real engine: LMCache makes ``keys`` of them."""
        ids: list[int] = []
        for content, ntokens in zip(self.contents, self.chunk_tokens, strict=True):
            ids.extend(chunk_tokens(content, ntokens))
        return ids


class _KeyChain:
    """Keys of content chains, memoised by (prefix key, content, length): a shared prefix is hashed once."""

    def __init__(self) -> None:
        self._keys: dict[tuple[int, int, int], int] = {}

    def request(self, engine: int, chunks: Sequence[tuple[int, int]]) -> Request:
        keys: list[int] = []
        prefix = LMCACHE_NONE_HASH
        for content, ntokens in chunks:
            memo = (prefix, content, ntokens)
            key = self._keys.get(memo)
            if key is None:
                key = self._keys[memo] = chunk_key(prefix, chunk_tokens(content, ntokens))
            keys.append(key)
            prefix = key
        return Request(
            engine=engine,
            keys=tuple(keys),
            chunk_tokens=tuple(n for _, n in chunks),
            contents=tuple(c for c, _ in chunks),
        )


@dataclass(frozen=True)
class Trace:
    """A generated (or read) serving trace: its requests, in arrival order, and what made it."""

    name: str
    params: dict[str, object]
    requests: tuple[Request, ...]
    working_set_chunks: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "working_set_chunks", len({k for r in self.requests for k in r.keys}))

    @property
    def engines(self) -> int:
        return 1 + max(r.engine for r in self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        chunks = sum(len(r.keys) for r in self.requests)
        return (
            f"trace {self.name} ({params}): {len(self.requests)} requests on {self.engines} engines,"
            f" {chunks} chunk reads, {self.total_tokens} tokens, working set {self.working_set_chunks} chunks"
        )


def _route(routing: str, rng: random.Random, engines: int, turn: int) -> int:
    if routing == "round-robin":
        return turn % engines
    if routing == "random":
        return rng.randrange(engines)
    raise ValueError(f"routing is round-robin or random, not {routing!r}")


class _Contents:
    """Content ids handed out in order: each new chunk of text gets the next."""

    def __init__(self, seed: int) -> None:
        self._next = seed << 32

    def new(self, count: int) -> list[int]:
        start = self._next
        self._next += count
        return list(range(start, start + count))


def long_doc_qa(
    *,
    documents: int = 20,
    document_chunks: int = 40,
    questions: int = 3,
    engines: int = 4,
    routing: str = "random",
    seed: int = 0,
) -> Trace:
    """D documents read once (warm-up), then Q rounds asking each document a question, shuffled."""
    rng = random.Random(seed)
    contents = _Contents(seed)
    chain = _KeyChain()
    docs = [contents.new(document_chunks) for _ in range(documents)]
    requests: list[Request] = []
    order = list(range(documents))
    for doc in order:  # warm-up: every document once, in order
        requests.append(
            chain.request(_route(routing, rng, engines, len(requests)), [(c, CHUNK_TOKENS) for c in docs[doc]])
        )
    for _ in range(questions):
        rng.shuffle(order)
        for doc in order:
            chunks = [(c, CHUNK_TOKENS) for c in docs[doc]] + [(contents.new(1)[0], CHUNK_TOKENS // 4)]
            requests.append(chain.request(_route(routing, rng, engines, len(requests)), chunks))
    params: dict[str, object] = {
        "documents": documents,
        "document_chunks": document_chunks,
        "questions": questions,
        "engines": engines,
        "routing": routing,
        "seed": seed,
    }
    return Trace("long-doc-qa", params, tuple(requests))


def multi_round(
    *,
    users: int = 40,
    system_chunks: int = 8,
    rounds: int = 8,
    round_chunks: int = 4,
    engines: int = 4,
    routing: str = "round-robin",
    seed: int = 0,
) -> Trace:
    """U users behind one system prompt; each round every user (shuffled) appends and sends all."""
    rng = random.Random(seed)
    contents = _Contents(seed)
    chain = _KeyChain()
    system = contents.new(system_chunks)
    conversations: list[list[int]] = [list(system) for _ in range(users)]
    requests: list[Request] = []
    for turn in range(rounds):
        order = list(range(users))
        rng.shuffle(order)
        for user in order:
            conversations[user].extend(contents.new(round_chunks))
            # round-robin routing moves each user to the next engine every round
            engine = _route(routing, rng, engines, user + turn)
            requests.append(chain.request(engine, [(c, CHUNK_TOKENS) for c in conversations[user]]))
    params: dict[str, object] = {
        "users": users,
        "system_chunks": system_chunks,
        "rounds": rounds,
        "round_chunks": round_chunks,
        "engines": engines,
        "routing": routing,
        "seed": seed,
    }
    return Trace("multi-round", params, tuple(requests))


def agent_loop(
    *,
    agents: int = 12,
    tool_chunks: int = 8,
    context_chunks: int = 24,
    steps: int = 12,
    engines: int = 4,
    routing: str = "random",
    seed: int = 0,
) -> Trace:
    """Agents over one tool prompt and a long task context; each step appends one short tool result."""
    rng = random.Random(seed)
    contents = _Contents(seed)
    chain = _KeyChain()
    tools = contents.new(tool_chunks)
    contexts: list[list[tuple[int, int]]] = [
        [(c, CHUNK_TOKENS) for c in tools + contents.new(context_chunks)] for _ in range(agents)
    ]
    requests: list[Request] = []
    for _ in range(steps):
        active = [a for a in range(agents) if rng.random() < 0.8]  # some agents wait on a tool this step
        rng.shuffle(active)
        for agent in active:
            # a tool result: a whole chunk, so the next step's prompt extends this one's keys
            contexts[agent].append((contents.new(1)[0], CHUNK_TOKENS))
            requests.append(chain.request(_route(routing, rng, engines, len(requests)), contexts[agent]))
    params: dict[str, object] = {
        "agents": agents,
        "tool_chunks": tool_chunks,
        "context_chunks": context_chunks,
        "steps": steps,
        "engines": engines,
        "routing": routing,
        "seed": seed,
    }
    return Trace("agent", params, tuple(requests))


def mooncake(*, requests: int = 1000, engines: int = 4, routing: str = "random", seed: int = 0) -> Trace:
    """Mooncake's released conversation trace (first ``requests`` of the 1,000 kept), blocks as chunks.

    A block id is a 512-token block whose whole prefix is the same; it becomes two chunks of
    content ids ``2 * id`` and ``2 * id + 1``, the last block cut to the request's input length.
    """
    rng = random.Random(seed)
    chain = _KeyChain()
    out: list[Request] = []
    with gzip.open(MOONCAKE_SAMPLE, "rt") as lines:
        for line in lines:
            if len(out) == requests:
                break
            row = json.loads(line)
            left = int(row["input_length"])
            chunks: list[tuple[int, int]] = []
            for block in row["hash_ids"]:
                for half in (0, 1):
                    if left <= 0:
                        break
                    ntokens = min(CHUNK_TOKENS, left)
                    chunks.append((2 * int(block) + half, ntokens))
                    left -= ntokens
            out.append(chain.request(_route(routing, rng, engines, len(out)), chunks))
    params: dict[str, object] = {"requests": len(out), "engines": engines, "routing": routing, "seed": seed}
    return Trace("mooncake", params, tuple(out))


TRACES: dict[str, Callable[..., Trace]] = {
    "long-doc-qa": long_doc_qa,
    "multi-round": multi_round,
    "agent": agent_loop,
    "mooncake": mooncake,
}


def make_trace(name: str, **params: object) -> Trace:
    """The trace ``name`` with its defaults, any of them overridden by ``params``."""
    try:
        generator = TRACES[name]
    except KeyError:
        raise ValueError(f"no trace {name!r}: one of {', '.join(TRACES)}") from None
    return generator(**params)


def _lines() -> Iterator[str]:
    for name in TRACES:
        yield make_trace(name).describe()
    for preset in PRESETS.values():
        yield preset.describe()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.workload.traces", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", choices=list(TRACES), help="one trace (default: all, with the model presets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--users", type=int, help="multi-round: users")
    args = parser.parse_args(argv)
    if args.trace is None:
        for line in _lines():
            print(line)
        return
    params: dict[str, object] = {"seed": args.seed, "engines": args.engines}
    if args.users is not None:
        params["users"] = args.users
    print(make_trace(args.trace, **params).describe())


if __name__ == "__main__":
    main()
