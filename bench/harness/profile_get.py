"""Where a kvpool get spends its time: a budget per read path, beside this machine's ceilings.

    python -m bench.harness.profile_get                  # 8 x 4 MiB per get, 40 timed gets per path
    python -m bench.harness.profile_get --chunk-mib 32 --rounds 10 --json budget.json

Starts its own redis-server and one node (DRAM tier in a shared-memory arena), builds
LMCache's storage with the kvpool plugin (``backend.lmcache.stack``), stores one batch,
then times ``RemoteBackend.batched_get_blocking`` of that batch through the same-host
arena (``shm=on``) and over TCP (``shm=off``). Each phase of a get is timed by wrapping
the function that does it (bench-only wrappers; nothing in kvpool is instrumented):

* LMCache: the caller's hop onto LMCache's event loop and back (total minus the connector);
* lookup: the Redis index round trip (``Locator.lookup``);
* LEASE (arena) / node answer (TCP): the node's reply to the request, before any payload;
* allocation: LMCache's allocator handing out the memory objects (``LMCacheSink.allocate``);
* copy + checksum: the bulk copies on the worker threads (arena: out of the mapping;
  TCP: the socket receive), wall time, and the threads' busy time inside it;
* other: what is left (framing, event-loop wake-ups, task scheduling).

In the same run it measures the ceilings: ``torch`` copy with all threads (the
harness's memcpy ceiling), one thread copying, xxh3-64, and one TCP stream over
loopback, both from one hot buffer (the harness's ceiling) and through a batch-sized
working set of distinct buffers (what a real batch moves).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
if __name__ == "__main__":  # run as a script only: an importer keeps its own environment
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # before LMCache is imported: its INFO lines drown the table

import numpy as np
import xxhash

from backend.client.context import ClientContext
from backend.client.registry import Locator
from backend.client.tcp import TcpReader
from backend.embedded import EmbeddedRedis
from backend.launch.nodes import NodeProcess
from backend.lmcache.chunks import LMCacheSink
from backend.lmcache.connector import KVPoolConnector
from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config
from backend.protocol import Op
from backend.shm import ArenaView
from backend.transport import FrameSocket, _Receiving, _TurnClock
from bench.harness.ceilings import memcpy_gbps, tcp_loopback_gbps

MIB = 1 << 20
TOKENS = 256


class Clock:
    """Seconds spent per phase, summed over the timed gets (phases may run on any thread)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.on = False
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        if self.on:
            with self._lock:
                self.seconds[phase] += seconds

    def wrap(self, owner: Any, name: str, phase: str | Callable[..., str | None]) -> None:
        """Time ``owner.name`` (a function or coroutine function) as ``phase`` (or ``phase(*args)``)."""
        original = getattr(owner, name)
        label = phase if callable(phase) else (lambda *a, **k: phase)
        clock = self
        if asyncio.iscoroutinefunction(original):

            @functools.wraps(original)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    if (which := label(*args, **kwargs)) is not None:
                        clock.add(which, time.perf_counter() - start)

            setattr(owner, name, timed_async)
        else:

            @functools.wraps(original)
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    if (which := label(*args, **kwargs)) is not None:
                        clock.add(which, time.perf_counter() - start)

            setattr(owner, name, timed)


CLOCK = Clock()


def _instrument() -> None:
    from backend.client.connection import NodeConnectionSet

    CLOCK.wrap(KVPoolConnector, "batched_get", "connector")
    CLOCK.wrap(Locator, "lookup", "lookup")
    CLOCK.wrap(
        NodeConnectionSet, "request", lambda self, op, meta, **k: {Op.LEASE: "lease", Op.GET_BATCH: "request"}.get(op)
    )
    CLOCK.wrap(LMCacheSink, "allocate", "allocation")
    CLOCK.wrap(ClientContext, "map_in_threads", "copy (wall)")
    CLOCK.wrap(FrameSocket, "recv_many", "receive (wall)")
    CLOCK.wrap(ArenaView, "copy_checked", "thread busy")
    CLOCK.wrap(_Receiving, "turn", "thread busy")  # a worker's turn of a bulk receive (transport.py)
    CLOCK.wrap(_TurnClock, "ready", "thread waiting for data")
    CLOCK.wrap(TcpReader, "read", "tcp read")


def budget(seconds: dict[str, float], total_s: float, gets: int, shm: bool) -> list[tuple[str, float]]:
    """Milliseconds per get by phase: the phases a get runs one after the other (they sum to the
    total), then what ran inside the read, summed over its stripes and threads (those overlap)."""
    per = {k: v / gets * 1000 for k, v in seconds.items()}
    total = total_s / gets * 1000
    rows = [
        ("LMCache hop (caller -> LMCache's loop -> caller)", total - per.get("connector", 0.0)),
        ("lookup (one Redis round trip)", per.get("lookup", 0.0)),
    ]
    if shm:
        # The lookup runs while the LEASE, the allocation and the copies do: only what it
        # takes beyond them is on the get's critical path.
        leased = per.get("lease", 0.0) + per.get("allocation", 0.0) + per.get("copy (wall)", 0.0)
        rows = [
            rows[0],
            ("LEASE round trip (the node answers offsets)", per.get("lease", 0.0)),
            ("allocation (LMCache's allocator)", per.get("allocation", 0.0)),
            ("copy + checksum out of the arena, two threads (wall)", per.get("copy (wall)", 0.0)),
            (
                "lookup (one Redis round trip), beyond the three above it runs beside",
                max(per.get("lookup", 0.0) - leased, 0.0),
            ),
        ]
    else:
        rows += [("TCP read: stripes requested, allocated, received, checked (wall)", per.get("tcp read", 0.0))]
    rows.append(("other (framing, wake-ups, scheduling)", per.get("connector", 0.0) - sum(v for _, v in rows[1:])))
    rows.append(("= total per get", total))
    if shm:
        rows.append(("  lookup (one Redis round trip), all of it", per.get("lookup", 0.0)))
        rows.append(("  worker threads copying + hashing (busy, both threads)", per.get("thread busy", 0.0)))
        return rows
    receive = per.get("receive (wall)", 0.0)
    rows += [
        (
            "  per stripe, summed: node answers (request -> first frame)",
            per.get("request", 0.0) - receive - per.get("allocation", 0.0),
        ),
        ("  per stripe, summed: allocation (LMCache's allocator)", per.get("allocation", 0.0)),
        ("  per stripe, summed: receive + checksum (wall)", receive),
        ("  worker threads receiving + hashing (busy, both threads)", per.get("thread busy", 0.0)),
        ("  ... of which waiting for the node's bytes", per.get("thread waiting for data", 0.0)),
    ]
    return rows


# -- ceilings ------------------------------------------------------------------------------
def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _single_thread_copy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)  # pages touched before timing
    best = min(_timed(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)) for _ in range(repeats))
    return nbytes / best / 1e9


def _xxh3_gbps(nbytes: int, repeats: int = 5) -> float:
    data = memoryview(os.urandom(nbytes))
    best = min(_timed(lambda: xxhash.xxh3_64_intdigest(data)) for _ in range(repeats))
    return nbytes / best / 1e9


def ceilings(chunk_bytes: int, batch: int) -> dict[str, float]:
    batch_bytes = chunk_bytes * batch
    return {
        "memcpy_gbps": memcpy_gbps(batch_bytes),
        "one_thread_copy_gbps": _single_thread_copy_gbps(batch_bytes),
        "xxh3_gbps": _xxh3_gbps(chunk_bytes),
        "tcp_loopback_gbps": tcp_loopback_gbps(1 << 30),
        "tcp_loopback_batch_gbps": tcp_loopback_gbps(1 << 30, buffer_bytes=batch_bytes),
    }


# -- the pool and the measurement ----------------------------------------------------------
@contextlib.contextmanager
def _pool() -> Iterator[str]:
    """A redis-server and one node with an arena in /dev/shm; yields the pool URL."""
    with EmbeddedRedis() as redis:
        node = NodeProcess(["--redis", redis.url, "--namespace", "profile", "--dram", "2GiB", "--port", "0"]).start()
        try:
            yield f"kvpool://127.0.0.1:{redis.port}/profile"
        finally:
            node.stop(timeout_s=30)


def measure(url: str, shm: bool, chunk_mib: int, batch: int, rounds: int, fresh: bool = False) -> dict[str, Any]:
    """Time ``rounds`` gets of one stored batch through LMCache; every byte is compared.

    ``fresh``: each get reads a batch put just before it (untimed), as the harness does,
    so the chunks sit in memory this client has not read before.
    """
    import torch

    layers = chunk_mib * MIB // (2 * TOKENS * 1024 * 2)  # [2, layers, 256, 1024] bf16
    config = kvpool_lmcache_config(
        url + ("" if shm else "?shm=off"), local_cpu_gib=(3 * batch * chunk_mib) / 1024 + 0.1
    )
    stack = LMCacheStack(config, model="kvpool-profile/model", num_layers=layers, hidden=(8, 128))
    try:
        objs = [stack.make_object(i) for i in range(batch)]
        expected = [o.tensor.clone() for o in objs]

        def store(round_no: int) -> list[Any]:
            keys = [stack.key(7000 + 100 * round_no + i) for i in range(batch)]
            stack.put(keys, objs)
            return keys

        keys = store(0)
        for _ in range(3):  # warm: connections, the arena mapping, LMCache's buffer
            stack.release(stack.get(keys))
        CLOCK.seconds.clear()
        total_s = 0.0
        for round_no in range(1, rounds + 1):
            if fresh:
                keys = store(round_no)
            CLOCK.on = True
            start = time.perf_counter()
            got = stack.get(keys)
            total_s += time.perf_counter() - start
            CLOCK.on = False
            try:
                if any(g is None for g in got):
                    raise RuntimeError("a stored chunk missed")
            finally:
                stack.release(got)
        stack.release(objs)
        got = stack.get(keys)  # untimed: the bytes are what was put
        same = all(torch.equal(g.tensor, e) for g, e in zip(got, expected))
        stack.release(got)
        if not same:
            raise RuntimeError("a chunk came back different")
        connector = stack.connector()
        if shm and connector.counters["shm_get_bytes"] == 0:
            raise RuntimeError("shm=on but nothing was read through the arena")
        gbps = rounds * batch * stack.chunk_bytes / total_s / 1e9
        return {"gbps": gbps, "budget_ms": budget(dict(CLOCK.seconds), total_s, rounds, shm)}
    finally:
        stack.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--fresh", action="store_true", help="each get reads a batch put just before (as the harness)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    _instrument()
    limits = ceilings(args.chunk_mib * MIB, args.batch)
    print(
        "ceilings, this run: "
        + ", ".join(f"{k.removesuffix('_gbps').replace('_', ' ')} {v:.2f} GB/s" for k, v in limits.items())
    )
    report: dict[str, Any] = {"ceilings": limits, "chunk_mib": args.chunk_mib, "batch": args.batch, "paths": {}}
    with _pool() as url:
        for shm in (True, False):
            path = "same-host arena" if shm else "TCP"
            result = measure(url, shm, args.chunk_mib, args.batch, args.rounds, args.fresh)
            report["paths"][path] = result
            print(
                f"\n{path}: {result['gbps']:.2f} GB/s ({args.rounds} gets of {args.batch} x {args.chunk_mib} MiB "
                f"through LMCache{', each of a batch just put' if args.fresh else ''}); milliseconds per get:"
            )
            for phase, ms in result["budget_ms"]:
                print(f"  {ms:8.3f}  {phase}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
