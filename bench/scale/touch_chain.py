"""Micro-benchmark of the eviction orders' hot path: ``ChunkTable.touch_chain`` (every get, lease, lookup's touch
and put) and each order's own ``touch_chain``, in ns per key of a batch. Prints figures, asserts nothing.

    python -m bench.scale.touch_chain [--chunks 100000] [--batch 64] [--batches 20000] [--repeat 5]

A table of ``--chunks`` chunks, a third of them on NVMe only, a third in DRAM only, a third in both (a hit
promoted from NVMe keeps its file), or all in DRAM (``--no-nvme``); each batch is a run of consecutive keys (a prefix chain) starting at a
random chunk. The best of ``--repeat`` runs is printed, so a run on another tree (``git stash``) compares.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from backend.node.store.bookkeeping import IN_DRAM, ON_NVME, ChunkTable
from backend.node.store.eviction import ORDERS
from backend.protocol import ItemMeta

_TIERS = ((IN_DRAM,), (ON_NVME,), (IN_DRAM, ON_NVME))  # chunk i is held by _TIERS[i % 3]


class _Unordered:
    """An order that does nothing: what is left of ``ChunkTable.touch_chain`` is the table's own work."""

    def add(self, slot: int) -> None:
        pass

    def touch_chain(self, slots: Sequence[int], read: bool = True) -> None:
        pass


_POLICIES: dict[str, Callable[[], Any]] = {"(none)": _Unordered, **ORDERS}


def _table(policy: str, chunks: int, nvme: bool) -> ChunkTable:
    table = ChunkTable()
    table.orders[IN_DRAM] = _POLICIES[policy]()
    if nvme:
        table.orders[ON_NVME] = _POLICIES[policy]()
    for i in range(chunks):
        meta = ItemMeta(f"model@1@0@{i:016x}@bfloat16", 4096, i, "bfloat16", (2, 1024), 1, 0)
        for tier in _TIERS[i % 3] if nvme else (IN_DRAM,):
            table.orders[tier].add(table.enter(meta, tier))
    return table


def _best_ns_per_key(run: Callable[[], None], keys: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time_ns()  # CPU time: other processes on the host count less
        run()
        best = min(best, (time.process_time_ns() - started) / keys)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-nvme", action="store_true", help="a node without an NVMe tier: one order, all in DRAM")
    args = parser.parse_args()
    rng = random.Random(1)
    starts = [rng.randrange(args.chunks - args.batch) for _ in range(args.batches)]
    keys = args.batch * args.batches
    tiers = "DRAM only" if args.no_nvme else "DRAM and NVMe"
    print(
        f"{tiers}: {args.chunks} chunks, {args.batches} batches of {args.batch} keys; best of {args.repeat}, ns per key"
    )
    for policy in _POLICIES:
        table = _table(policy, args.chunks, nvme=not args.no_nvme)
        batches = [[table.key(s) for s in range(start, start + args.batch)] for start in starts]
        slot_batches = [list(range(start, start + args.batch)) for start in starts]
        order = _POLICIES[policy]()
        for slot in range(args.chunks):
            order.add(slot)

        def table_touch(table: ChunkTable = table, batches: list[list[str]] = batches) -> None:
            for batch in batches:
                table.touch_chain(batch)

        def order_touch(order: object = order, batches: list[list[int]] = slot_batches) -> None:
            for batch in batches:
                order.touch_chain(batch)  # type: ignore[attr-defined]

        table_ns = _best_ns_per_key(table_touch, keys, args.repeat)
        order_ns = _best_ns_per_key(order_touch, keys, args.repeat)
        name = _POLICIES[policy].__name__
        print(f"  {policy:15s} ChunkTable.touch_chain {table_ns:7.1f}   {name}.touch_chain {order_ns:7.1f}")


if __name__ == "__main__":
    main()
