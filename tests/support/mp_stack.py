"""LMCache's multiprocess-mode storage, built exactly as ``lmcache server`` builds it.

``MPStack`` parses the server arguments that ``kvpool lmcache-config --mode mp``
prints with LMCache's own argument parser, turns them into a
``StorageManagerConfig`` with LMCache's ``parse_args_to_config`` and builds
LMCache's ``StorageManager`` from it: L1 memory, the store and prefetch
controllers, and the L2 adapters (kvpool's, through LMCache's plugin loader).

Run as a module it is one side of a round trip in a fresh process::

    python -m tests.support.mp_stack put|get URL --chunks N --seed S

and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch

from backend.lmcache.config import lmcache_mp_server_args
from tests.support.waits import wait_until

MODEL = "kvpool-demo/tiny-model"
CHUNK_TOKENS = 16
HIDDEN = 1024  # bytes of one token's K or V in one layer / 2 (bfloat16)
NUM_LAYERS = 2
WAIT_S = 30.0  # every wait on LMCache's controllers is bounded by this


def server_args(url: str, *, l1_size_gib: float = 0.05) -> list[str]:
    """What ``kvpool lmcache-config --mode mp`` prints, sized for a test process."""
    return lmcache_mp_server_args(url, chunk_size=CHUNK_TOKENS, l1_size_gib=l1_size_gib)


def parse_server_args(args: Sequence[str]) -> Any:
    """``lmcache server``'s own parser and config builders; returns the StorageManagerConfig."""
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.multiprocess.config import add_mp_server_args

    parser = argparse.ArgumentParser(prog="lmcache server")
    add_mp_server_args(parser)
    add_storage_manager_args(parser)
    return parse_args_to_config(parser.parse_args(list(args)))


class MPStack:
    """LMCache's StorageManager (L1 + controllers + L2 adapters) from server arguments."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        salt: str = "",
        model: str = MODEL,
        dtype: torch.dtype = torch.bfloat16,
        shape: Sequence[int] = (2, NUM_LAYERS, CHUNK_TOKENS, HIDDEN),
    ) -> None:
        """``dtype`` and ``shape``: the layout the engine registers for its one object group."""
        from lmcache.v1.distributed.api import MemoryLayoutDesc
        from lmcache.v1.distributed.storage_manager import StorageManager

        self.config = parse_server_args(args)
        self.manager = StorageManager(self.config)
        self.salt = salt
        self.model = model
        self.dtype = dtype
        self.shape = torch.Size(shape)
        self.layout = MemoryLayoutDesc(shapes=[self.shape], dtypes=[self.dtype])

    @property
    def adapter(self) -> Any:
        """The one L2 adapter LMCache built (kvpool's, if the plugin loaded)."""
        adapters = [adapter for _, _, adapter in self.manager._snapshot_adapters()]
        if len(adapters) != 1:
            raise RuntimeError(f"expected one L2 adapter, LMCache built {len(adapters)}")
        return adapters[0]

    @property
    def chunk_bytes(self) -> int:
        return int(self.shape.numel()) * self.dtype.itemsize

    def key(self, index: int, salt: str | None = None) -> Any:
        from lmcache.v1.distributed.api import ObjectKey

        rank = ObjectKey.ComputeKVRank(world_size=1, global_rank=0, local_world_size=1, local_rank=0)
        chunk_hash = index.to_bytes(8, "big") * 4  # 32 bytes, like blake3 digests
        return ObjectKey(chunk_hash, self.model, rank, 0, self.salt if salt is None else salt)

    def payload(self, index: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return torch.randn(self.shape, generator=generator).to(self.dtype)

    def put(self, keys: Sequence[Any], tensors: Sequence[torch.Tensor]) -> int:
        """Write through L1 as an engine's store does; returns how many L1 accepted.

        The store controller then pushes the chunks to L2 on its own thread.
        """
        reserved = self.manager.reserve_write(list(keys), self.layout)
        for key, tensor in zip(keys, tensors):
            obj = reserved.get(key)
            if obj is not None:
                assert obj.tensor is not None
                obj.tensor.copy_(tensor)
        self.manager.finish_write([k for k in keys if k in reserved])
        return len(reserved)

    def prefetch(self, keys: Sequence[Any]) -> tuple[int, int]:
        """Prefetch ``keys`` into L1 (from L2 when L1 lacks them); returns (hits, L2 hits)."""
        from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

        spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(list(keys), 0, self.layout)])
        handle = self.manager.submit_prefetch_task(spec)
        if not self.manager.wait_prefetch_status(handle, WAIT_S):
            raise TimeoutError(f"prefetch did not finish within {WAIT_S} s")
        result = self.manager.query_prefetch_status(handle)
        assert result is not None
        hits = sum(row.popcount() for row in result.hit_cells)
        return hits, int(result.l2_hit_count)

    def read(self, keys: Sequence[Any]) -> list[torch.Tensor] | None:
        """Copies of prefetched objects (None unless every key is in L1); releases the read locks."""
        with self.manager.read_prefetched_results(list(keys)) as objs:
            if objs is None:
                return None
            out = [obj.tensor.clone() for obj in objs]
        self.manager.finish_read_prefetched(list(keys))
        return out

    def close(self) -> None:
        self.manager.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one side of an LMCache multiprocess-mode round trip")
    parser.add_argument("role", choices=("put", "get"))
    parser.add_argument("url")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--salt", default="")
    opts = parser.parse_args(argv)
    stack = MPStack(server_args(opts.url), salt=opts.salt)
    keys = [stack.key(i) for i in range(opts.chunks)]
    out: dict[str, Any] = {"adapter": type(stack.adapter).__name__}
    try:
        if opts.role == "put":
            out["accepted"] = stack.put(keys, [stack.payload(i, opts.seed) for i in range(opts.chunks)])
            # The store controller pushes to L2 on its own thread: wait for the pool to hold them.
            out["stored"] = wait_until(lambda: stack.adapter.counters["stored_chunks"] >= opts.chunks, WAIT_S)
        else:
            out["hits"], out["l2_hits"] = stack.prefetch(keys)
            got = stack.read(keys) if out["hits"] == opts.chunks else None
            expected = [stack.payload(i, opts.seed) for i in range(opts.chunks)]
            out["identical"] = (
                0
                if got is None
                else sum(torch.equal(g.view(torch.uint8), e.view(torch.uint8)) for g, e in zip(got, expected))
            )
        out["counters"] = dict(stack.adapter.counters)
    finally:
        stack.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
