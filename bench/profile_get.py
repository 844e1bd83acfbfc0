"""Where a kvpool get spends its time: the client's profile over TCP and over the same-host path.

    python -m bench.profile_get                 # 8 x 4 MiB per get, 40 timed gets per path
    python -m bench.profile_get --chunk-mib 32 --batch 8 --rounds 10

Starts its own redis-server and one node (DRAM tier in a shared-memory arena), stores
one batch, then times ``PoolClient.get`` of that batch into preallocated buffers, first
through the arena (``shm=on``) and then over TCP (``shm=off``), each under cProfile.
No LMCache here: this is kvpool's own share of a get. In the same run it measures what
the copy alone can do on this machine: ``torch`` copy with all its threads (the
harness's memcpy ceiling), one thread copying (``ctypes.memmove``, what the client
does), and xxh3-64 over the chunk (the checksum every get verifies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import ctypes
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from backend.client import Chunk, PoolClient
from backend.config import PoolConfig
from backend.embedded import EmbeddedRedis
from backend.protocol import ItemMeta
from bench.ceilings import memcpy_gbps

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
TOP_FUNCTIONS = 8


class _ReuseSink:
    """Hands out the same preallocated buffers every get, as LMCache's allocator does once warm."""

    def __init__(self, buffers: list[bytearray]) -> None:
        self.buffers = buffers
        self.next = 0

    async def allocate(self, meta: ItemMeta) -> tuple[int, bytearray]:
        index = self.next % len(self.buffers)
        self.next += 1
        return index, self.buffers[index]

    def release(self, handle: int) -> None:
        pass


def _single_thread_copy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)  # pages touched before timing
    best = min(_timed(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)) for _ in range(repeats))
    return nbytes / best / 1e9


def _xxh3_gbps(nbytes: int, repeats: int = 5) -> float:
    data = memoryview(os.urandom(nbytes))
    best = min(_timed(lambda: xxhash.xxh3_64_intdigest(data)) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextlib.contextmanager
def _pool() -> Iterator[str]:
    """A redis-server and one node with an arena in /dev/shm; yields the pool URL."""
    with EmbeddedRedis() as redis:
        args = [sys.executable, "-m", "backend.cli", "node", "--redis", redis.url, "--namespace", "profile",
                "--dram", "1GiB", "--port", "0"]  # fmt: skip
        node = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert node.stdout is not None
            for line in node.stdout:
                if "ready at" in line:
                    break
            else:
                raise RuntimeError("the node exited before it was ready")
            yield f"kvpool://127.0.0.1:{redis.port}/profile"
        finally:
            node.terminate()
            node.wait(timeout=30)


async def _profile(url: str, shm: bool, chunk_bytes: int, batch: int, rounds: int) -> tuple[float, pstats.Stats]:
    config = PoolConfig.from_url(url + ("" if shm else "?shm=off"))
    async with PoolClient(config) as client:
        chunks = [Chunk(f"profile@{i}", os.urandom(chunk_bytes)) for i in range(batch)]
        await client.put(chunks)
        keys = [chunk.key for chunk in chunks]
        sink = _ReuseSink([bytearray(chunk_bytes) for _ in range(batch)])
        for _ in range(3):  # warm: connections, the arena mapping, page tables
            await client.get(keys, sink)
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(rounds):
            got = await client.get(keys, sink)
            if any(handle is None for handle in got):
                raise RuntimeError("a stored chunk missed")
        profiler.disable()
        elapsed = time.perf_counter() - start
        if shm and client.counters["shm_get_bytes"] == 0:
            raise RuntimeError("shm=on but nothing was read through the arena")
    return rounds * batch * chunk_bytes / elapsed / 1e9, pstats.Stats(profiler)


def _top(stats: pstats.Stats) -> list[tuple[float, str]]:
    """The functions with the most own time, as (share of all own time, name)."""
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(row[2] for row in table.values()) or 1.0
    rows = sorted(table.items(), key=lambda item: item[1][2], reverse=True)[:TOP_FUNCTIONS]
    return [(row[2] / total, pstats.func_std_string(func)) for func, row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    chunk_bytes = args.chunk_mib * MIB
    print(f"ceilings, this run: torch copy (all threads) {memcpy_gbps(batch_bytes := chunk_bytes * args.batch):.2f} "
          f"GB/s, one-thread memmove {_single_thread_copy_gbps(batch_bytes):.2f} GB/s, "
          f"xxh3-64 {_xxh3_gbps(chunk_bytes):.2f} GB/s")  # fmt: skip
    with _pool() as url:
        for shm in (True, False):
            gbps, stats = asyncio.run(_profile(url, shm, chunk_bytes, args.batch, args.rounds))
            path = "same-host arena" if shm else "TCP"
            print(f"\n{path}: {gbps:.2f} GB/s ({args.rounds} gets of {args.batch} x {args.chunk_mib} MiB); "
                  f"client's own time by function:")  # fmt: skip
            for share, name in _top(stats):
                print(f"  {share:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
