"""One cell of the harness (chunk size x batch x clients) on LMCache's own stacks, byte-checked.

What every mode that drives LMCache's storage shares: building and closing a stack
(``backend.lmcache.stack``), allocating from LMCache's allocator, the stamps that show a
chunk read under the wrong key, the cells of a round with their warm-up and eviction
check, and the lookups' command counter. ``bench.harness.run`` runs the cells in this
process, ``bench.hosts.worker`` on the client host of the bed, and
``bench.harness.lookups`` builds its stacks here; none of them is imported back.
"""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import redis
import torch

from backend.latency import quantile
from backend.lmcache.stack import LMCacheStack
from bench.harness import report
from bench.harness.peers import Peer
from bench.harness.plan import GIB, KEY_FIELDS_BITS, MIB, TOKENS, Plan, chunk_bytes

MODEL = "kvpool-bench/model"
STAMP_BYTES = 16
STAMP_MAGIC = b"kvpbench"
WARM_UP_CELL = 0  # cell number of the untimed warm-up keys (measured cells count from 1)

PUT_TIMEOUT_S = 120.0
BARRIER_TIMEOUT_S = 300.0
CLOSE_TIMEOUT_S = 3.0
ROUND_TRIP_SETTLE_S = 0.05  # lets a lookup's background work reach the proxy before counting stops


def latency_ms(samples_s: Sequence[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {"p50": quantile(ms, 0.5), "p99": quantile(ms, 0.99), "n": len(ms)}


# -- LMCache stacks ---------------------------------------------------------------------
def local_cpu_gib(chunk: int, batch: int) -> float:
    """LMCache's local buffer for one client: the batch being put plus the batch being read, and slack.

    ``allocate()`` waits for as long as this buffer is full, so it must hold all in flight.
    """
    return round((2 * batch * chunk * 1.25 + 64 * MIB) / GIB, 3)


def build_stack(peer: Peer, shape: tuple[int, int, int], gib: float, *, redis_port: int | None = None) -> LMCacheStack:
    layers, heads, head_size = shape
    return LMCacheStack(
        peer.lmcache_config(gib, redis_port=redis_port), model=MODEL, num_layers=layers, hidden=(heads, head_size)
    )


def allocate(stack: LMCacheStack) -> Any:
    """A memory object from LMCache's allocator, never waiting on a full buffer."""
    from lmcache.v1.memory_management import MemoryFormat

    obj = stack.local.allocate(stack.shape, stack.dtype, MemoryFormat.KV_2LTD, busy_loop=False)
    if obj is None:
        raise RuntimeError(f"LMCache's local buffer is full ({stack.config.max_local_cpu_size} GiB)")
    return obj


def close_stack(stack: LMCacheStack) -> None:
    """Close a stack with a bound on every step.

    LMCache's redis:// and resp:// connectors deadlock in ``close()``: it calls the
    blocking ``AsyncPQExecutor.shutdown`` on their own event loop, which then never
    runs again. For those, the same steps run here without the blocking call, and
    ``RemoteBackend.close`` is skipped.
    """
    conn = stack.connector()
    executor = getattr(conn, "pq_executor", None)
    if executor is not None:

        async def shutdown() -> None:
            await executor.shutdown_async(wait=True)
            client = getattr(conn, "client", None)  # resp://: the native client
            if client is not None:
                client.close()
            connection = getattr(conn, "connection", None)  # redis://: redis.asyncio.Redis
            if connection is not None:
                await connection.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), stack.loop).result(CLOSE_TIMEOUT_S)
        except Exception as exc:  # a slow or failing close must not stop the run
            print(f"[harness] closing {type(conn).__name__} did not finish cleanly: {exc!r}", flush=True)
        stack.remote.close = lambda: None  # already shut down above; LMCache's close would deadlock
    stack.close(CLOSE_TIMEOUT_S)


# -- byte checks ------------------------------------------------------------------------
def stamp_of(key_hash: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(struct.pack("<Q", key_hash) + STAMP_MAGIC), dtype=torch.uint8)


def byte_view(obj: Any) -> torch.Tensor:
    return obj.tensor.view(torch.uint8).reshape(-1)


def stamp(obj: Any, key_hash: int) -> None:
    """Mark both ends of a chunk with its key, so that a chunk read under the wrong key shows."""
    view = byte_view(obj)
    mark = stamp_of(key_hash)
    view[:STAMP_BYTES] = mark
    view[-STAMP_BYTES:] = mark


def identical(obj: Any, base: torch.Tensor, key_hash: int) -> bool:
    view = byte_view(obj)
    if view.numel() != base.numel():
        return False
    mark = stamp_of(key_hash)
    return bool(
        torch.equal(view[:STAMP_BYTES], mark)
        and torch.equal(view[-STAMP_BYTES:], mark)
        and torch.equal(view[STAMP_BYTES:-STAMP_BYTES], base[STAMP_BYTES:-STAMP_BYTES])
    )


def base_bytes(shape: tuple[int, int, int]) -> torch.Tensor:
    """Random bf16 KV data of a chunk, as bytes (seeded: the same in every run)."""
    layers, heads, head_size = shape
    gen = torch.Generator().manual_seed(sum(shape))
    kv = torch.randn((2, layers, TOKENS, heads * head_size), generator=gen).to(torch.bfloat16)
    return kv.view(torch.uint8).reshape(-1).clone()


# -- one cell: chunk size x batch x clients ----------------------------------------------
def key_hash(round_no: int, cell: int, client: int, call: int, slot: int) -> int:
    value = 0
    for (name, bits), field in zip(KEY_FIELDS_BITS, (round_no, cell, client, call, slot), strict=True):
        if not 0 <= field < 1 << bits:
            raise ValueError(f"key field {name}={field} does not fit in {bits} bits")
        value = (value << bits) | field
    return value


class _Calls:
    """Per-call start/end times of every client, and what the byte checks found."""

    def __init__(self, clients: int, calls: int) -> None:
        self.put = [[(0.0, 0.0)] * calls for _ in range(clients)]
        self.get = [[(0.0, 0.0)] * calls for _ in range(clients)]
        self.misses = [0] * clients
        self.mismatches = [0] * clients
        self.errors: list[str] = []

    @staticmethod
    def wall_s(times: list[list[tuple[float, float]]]) -> float:
        """Sum over calls of first start to last finish."""
        return sum(max(c[i][1] for c in times) - min(c[i][0] for c in times) for i in range(len(times[0])))

    @staticmethod
    def op_s(times: list[list[tuple[float, float]]]) -> list[float]:
        return [end - start for client in times for start, end in client]


def run_cell(
    stacks: Sequence[LMCacheStack],
    base: torch.Tensor,
    round_no: int,
    cell: int,
    batch: int,
    clients: int,
    calls: int,
) -> tuple[dict[str, Any], list[Any]]:
    """Every client puts ``calls`` batches, then reads them back; returns the figures and the keys used."""
    record = _Calls(clients, calls)
    barrier = threading.Barrier(clients, timeout=BARRIER_TIMEOUT_S)
    hashes = [[[key_hash(round_no, cell, c, i, s) for s in range(batch)] for i in range(calls)] for c in range(clients)]
    keys = [[[stacks[c].key(h) for h in per_call] for per_call in hashes[c]] for c in range(clients)]

    def client(c: int) -> None:
        stack = stacks[c]
        objs: list[Any] = []
        try:
            for _ in range(batch):
                objs.append(allocate(stack))
                byte_view(objs[-1]).copy_(base)
            for i in range(calls):
                for obj, h in zip(objs, hashes[c][i], strict=True):
                    stamp(obj, h)
                barrier.wait()
                start = time.perf_counter()
                stack.put(keys[c][i], objs, timeout_s=PUT_TIMEOUT_S)
                record.put[c][i] = (start, time.perf_counter())
            for i in range(calls):
                barrier.wait()
                start = time.perf_counter()
                got = stack.get(keys[c][i])
                record.get[c][i] = (start, time.perf_counter())
                try:
                    for obj, h in zip(got, hashes[c][i], strict=True):
                        if obj is None:
                            record.misses[c] += 1
                        elif not identical(obj, base, h):
                            record.mismatches[c] += 1
                finally:
                    stack.release(got)
        except Exception as exc:
            record.errors.append(f"client {c}: {exc!r}")
            barrier.abort()
        finally:
            stack.release(objs)

    threads = [
        threading.Thread(target=client, args=(c,), name=f"bench-client-{c}", daemon=True) for c in range(clients)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S * (2 * calls + 1)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            record.errors.append(f"{thread.name} did not finish")
    moved = stacks[0].chunk_bytes * batch * clients * calls
    result: dict[str, Any] = {
        "batch": batch,
        "clients": clients,
        "calls": calls,
        "chunks_read": batch * clients * calls,
        "misses": sum(record.misses),
        "mismatches": sum(record.mismatches),
        "errors": record.errors,
    }
    if not record.errors:
        result["put_gbps"] = moved / record.wall_s(record.put) / 1e9
        result["get_gbps"] = moved / record.wall_s(record.get) / 1e9
        result["put_ms"] = latency_ms(record.op_s(record.put))
        result["get_ms"] = latency_ms(record.op_s(record.get))
    return result, [k for per_client in keys for per_round in per_client for k in per_round]


# -- the cells of a round ----------------------------------------------------------------
def run_cells(peer: Peer, plan: Plan, bases: dict[str, torch.Tensor], round_no: int, out: dict[str, Any]) -> None:
    """One round of a backend's cells, chunk size by chunk size: fill, stacks, warm-up, cells; into ``out``."""
    cell_no = 0
    for size, shape in plan.shapes.items():
        peer.new_chunk_size(plan.stored_bytes(shape))
        fill = peer.fill(chunk_bytes(shape))
        if fill is not None:
            out["fills"].append({"round": round_no, "chunk": size, **fill})
            print(report.fill_line(peer.name, out["fills"][-1]), flush=True)
        gib = local_cpu_gib(chunk_bytes(shape), max(plan.batches))
        stacks: list[LMCacheStack] = []
        try:
            for _ in range(max(plan.clients)):
                stacks.append(build_stack(peer, shape, gib))
            peer.clear(stacks[0], warm_up(stacks, round_no, max(plan.batches)))
            for batch in plan.batches:
                for clients in plan.clients:
                    cell_no += 1
                    calls = plan.calls(chunk_bytes(shape), batch, clients)
                    evicted_before = peer.evictions()
                    cell, keys = run_cell(stacks[:clients], bases[size], round_no, cell_no, batch, clients, calls)
                    cell = {
                        "round": round_no,
                        "chunk": size,
                        "chunk_bytes": chunk_bytes(shape),
                        "shape": [2, shape[0], TOKENS, shape[1] * shape[2]],
                        **cell,
                    }
                    record_evictions(cell, evicted_before, peer.evictions())
                    out["round_cells"].append(cell)
                    print(report.cell_line(peer.name, cell), flush=True)
                    peer.clear(stacks[0], keys)
        finally:
            for stack in stacks:
                close_stack(stack)


def warm_up(stacks: Sequence[LMCacheStack], round_no: int, batch: int) -> list[Any]:
    """One untimed put and get of a full batch per stack; returns the keys it stored.

    A fresh stack's first call opens connections and maps or touches buffers, which a
    serving engine pays once, not per batch; the measured calls come after it.
    """
    keys: list[Any] = []
    for c, stack in enumerate(stacks):
        batch_keys = [stack.key(key_hash(round_no, WARM_UP_CELL, c, 0, s)) for s in range(batch)]
        objs: list[Any] = []
        try:
            for _ in batch_keys:
                objs.append(allocate(stack))
            stack.put(batch_keys, objs, timeout_s=PUT_TIMEOUT_S)
        finally:
            stack.release(objs)
        stack.release(stack.get(batch_keys))
        keys += batch_keys
    return keys


def record_evictions(cell: dict[str, Any], before: int | None, after: int | None) -> None:
    """Note the evictions during a cell's puts (its gets evict nothing); fewer than its puts fail the run.

    ``None``: the store does not count evictions (every peer but kvpool), nothing to note.
    """
    if before is None or after is None:
        return
    evictions = after - before
    cell["evictions"] = evictions
    cell["chunks_put"] = cell["batch"] * cell["clients"] * cell["calls"]
    if evictions < cell["chunks_put"]:
        cell["errors"].append(
            f"the pool evicted {evictions} chunks during {cell['chunks_put']} measured puts: "
            "it was not full, so some puts did not pay for an eviction"
        )


# -- lookups: what Redis executed -------------------------------------------------------
def command_calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
