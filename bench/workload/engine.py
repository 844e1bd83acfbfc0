"""One serving engine of the replay: LMCache's storage in its own process, fed requests on stdin.

    python -m bench.workload.engine CONFIG.json    # one JSON request a line in, one JSON outcome a line out

``bench.workload.run`` starts several of these against one pool. Each builds LMCache's
``LocalCPUBackend`` + ``RemoteBackend`` from the peer's LMCache config
(``backend.lmcache.stack``) and turns a request's chunks into token ids and those into
keys with LMCache's own ``ChunkedTokenDatabase`` (256-token chunks, each key's hash
chained on the hashes before it), so the pool sees real prefix-chained keys.

A request is what LMCache's storage manager does for one prompt, without the model:

1. lookup: the local tier's ``batched_async_contains`` in prefix order, then the
   remote's on what follows (both stop at the first miss);
2. load: the local hits, then the remote hits (``batched_get_blocking``); every byte
   is compared with what the storing engine wrote (a stamp of the key at both ends
   around the shared KV bytes), and a remote hit is kept in the local tier as LMCache
   does; a remote chunk gone since the lookup ends the hit prefix there;
3. store: the chunks after the hit prefix (the ones prefill would recompute), to the
   remote and the local tier.

The KV bytes are those of the preset model's 256-token chunk; a prompt's last chunk
under 256 tokens gets no key (LMCache's ``save_unfull_chunk`` is off by default) and is
always recomputed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from backend.lmcache.stack import LMCacheStack
from bench.harness.cells import allocate, base_bytes, byte_view, identical, stamp
from bench.workload.traces import chunk_tokens

MODEL = "kvpool-bench/replay"
HASH_MASK = (1 << 64) - 1  # LMCache's builtin hash is a signed 64-bit int; the stamp takes it unsigned
PUT_TIMEOUT_S = 120.0
READY = "ready"


@dataclass(frozen=True)
class EngineSpec:
    """What one engine process is built from: the peer's LMCache config and the KV shape of a chunk."""

    lmcache_config: dict[str, Any]
    layers: int
    kv_heads: int
    head_size: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Served:
    """What one request cost and found: the engine's answer to the replay."""

    request: int
    chunks: int  # chunks with a key (full 256-token chunks)
    local_hits: int  # chunks found in this engine's local tier (the prefix's head)
    pool_hits: int  # chunks after those, found in the pool and loaded
    lost: int  # chunks the pool's lookup found but its get no longer had
    wrong: int  # chunks loaded whose bytes differ from what was stored
    lookup_s: float
    load_s: float
    store_s: float
    bytes_loaded: int  # from the pool (the local tier's bytes move no wire)
    bytes_stored: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Served:
        return cls(**json.loads(text))


class Engine:
    """LMCache's storage of one engine and the keys its token database makes."""

    def __init__(self, spec: EngineSpec) -> None:
        from lmcache.v1.token_database import ChunkedTokenDatabase

        shape = (spec.layers, spec.kv_heads, spec.head_size)
        self.stack = LMCacheStack(
            spec.lmcache_config, model=MODEL, num_layers=spec.layers, hidden=(spec.kv_heads, spec.head_size)
        )
        self.tokens = ChunkedTokenDatabase(self.stack.config, self.stack.metadata)
        self.base = base_bytes(shape)
        self.chunk_bytes = self.stack.chunk_bytes

    def keys(self, contents: Sequence[int], ntokens: Sequence[int], expected: Sequence[int]) -> list[Any]:
        """LMCache's keys of the prompt (a last chunk under 256 tokens gets none: ``save_unfull_chunk`` off).

        They must be the trace's keys: the pool sees what the simulator counts.
        """
        tokens = [t for content, n in zip(contents, ntokens, strict=True) for t in chunk_tokens(content, n)]
        keys = [key for _start, _end, key in self.tokens.process_tokens(tokens)]
        if [key.chunk_hash for key in keys] != list(expected[: len(keys)]):
            raise RuntimeError("LMCache's token database made other keys than the trace's")
        return keys

    def serve(self, request: int, contents: Sequence[int], ntokens: Sequence[int], expected: Sequence[int]) -> Served:
        keys = self.keys(contents, ntokens, expected)
        local, remote = self.stack.local, self.stack.remote
        start = time.perf_counter()
        local_hits = self._contains(local, keys)
        pool_found = self._contains(remote, keys[local_hits:])
        lookup_s = time.perf_counter() - start

        start = time.perf_counter()  # the gets are timed, the byte checks after them are not
        from_local = [local.get_blocking(key) for key in keys[:local_hits]]
        found = keys[local_hits : local_hits + pool_found]
        loaded = self.stack.get(found) if found else []
        load_s = time.perf_counter() - start

        wrong, pool_hits = 0, 0
        try:
            for key, obj in zip(keys, from_local, strict=False):
                wrong += obj is None or not identical(obj, self.base, key.chunk_hash & HASH_MASK)
            for key, obj in zip(found, loaded, strict=True):
                if obj is None:  # gone since the lookup: the hit prefix ends here
                    break
                wrong += not identical(obj, self.base, key.chunk_hash & HASH_MASK)
                local.submit_put_task(key, obj)  # LMCache keeps a remote hit in its local tier
                pool_hits += 1
        finally:
            self.stack.release(from_local)
            self.stack.release(loaded)

        missed = keys[local_hits + pool_hits :]
        start = time.perf_counter()
        self._store(missed)
        return Served(
            request=request,
            chunks=len(keys),
            local_hits=local_hits,
            pool_hits=pool_hits,
            lost=pool_found - pool_hits,
            wrong=wrong,
            lookup_s=lookup_s,
            load_s=load_s,
            store_s=time.perf_counter() - start,
            bytes_loaded=pool_hits * self.chunk_bytes,
            bytes_stored=len(missed) * self.chunk_bytes,
        )

    def _contains(self, backend: Any, keys: Sequence[Any]) -> int:
        if not keys:
            return 0
        found = asyncio.run_coroutine_threadsafe(backend.batched_async_contains("replay", list(keys)), self.stack.loop)
        return int(found.result(PUT_TIMEOUT_S))

    def _store(self, keys: Sequence[Any]) -> None:
        """What prefill would compute, stored as LMCache stores it: to the remote and the local tier."""
        if not keys:
            return
        objs: list[Any] = []
        try:
            for key in keys:
                obj = allocate(self.stack)  # from the local tier's buffer, evicting its least recently used
                byte_view(obj).copy_(self.base)
                stamp(obj, key.chunk_hash & HASH_MASK)
                objs.append(obj)
            self.stack.put(keys, objs, timeout_s=PUT_TIMEOUT_S)
            self.stack.local.batched_submit_put_task(list(keys), objs)
        finally:
            self.stack.release(objs)

    def close(self) -> None:
        from bench.harness.cells import close_stack

        close_stack(self.stack)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path, help="the engine's EngineSpec, as JSON")
    args = parser.parse_args(argv)
    engine = Engine(EngineSpec.from_json(args.spec.read_text()))
    print(READY, flush=True)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            served = engine.serve(request["request"], request["contents"], request["chunk_tokens"], request["keys"])
            print(served.to_json(), flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
