"""What one harness run measures: the chunk shapes, batches, clients and rounds, and how big each cell is.

The plan is shared by every mode of the harness (``bench.harness.run``, ``--hosts``'s parent and
its worker, ``--lookups``) and by the flags that shape it; it imports nothing of theirs.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.harness import report

TOKENS = 256
MIB, GIB = 1 << 20, 1 << 30
BF16_BYTES = 2  # torch.bfloat16.itemsize: the KV data is bf16

# Chunk = [2, layers, 256 tokens, heads * head_size] bf16 = 1024 * layers * heads * head_size bytes.
CHUNK_SHAPES: dict[str, tuple[int, int, int]] = {
    "256KiB": (2, 1, 128),
    "4MiB": (4, 8, 128),
    "32MiB": (32, 8, 128),  # one 256-token chunk of an 8B model (32 layers, 8 KV heads of 128)
}
SMOKE_SHAPES: dict[str, tuple[int, int, int]] = {"16KiB": (1, 1, 16), "64KiB": (1, 2, 32)}
LOOKUP_SHAPE = (1, 1, 16)  # 16 KiB chunks: a lookup only sees keys
LOOKUP_PUT_BATCH = 50
REAL_ROUNDS = 3  # medians of three interleaved rounds, as the targets are defined
SMOKE_ROUNDS = 1
DRAM_PER_CELL = 2  # kvpool's DRAM, in multiples of the largest cell: the cell fits, the fill still evicts

# A chunk's key hash holds (round, cell, client, call, slot): every key of a run is new,
# so no store can answer a put with "already there". The widths bound the plan (--rounds, ...).
KEY_FIELDS_BITS = (("round", 8), ("cell", 16), ("client", 8), ("call", 12), ("slot", 12))


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    mode: str
    shapes: dict[str, tuple[int, int, int]]
    batches: tuple[int, ...]
    clients: tuple[int, ...]
    rounds: int  # interleaved rounds; a cell's reported figures are medians over them
    cell_bytes: int  # bytes each cell moves per direction and round; its calls are sized from it
    min_calls: int
    max_calls: int
    lookup_keys: int
    lookup_repeats: int
    memcpy_bytes: int
    tcp_bytes: int

    def calls(self, chunk_bytes: int, batch: int, clients: int) -> int:
        """Batched calls per client in one round of a cell."""
        wanted = math.ceil(self.cell_bytes / (chunk_bytes * batch * clients))
        return max(self.min_calls, min(self.max_calls, wanted))

    def largest_cell_bytes(self) -> int:
        return max(
            chunk_bytes(shape) * batch * clients * self.calls(chunk_bytes(shape), batch, clients)
            for shape in self.shapes.values()
            for batch in self.batches
            for clients in self.clients
        )

    def stored_bytes(self, shape: tuple[int, int, int]) -> int:
        """What one round of a chunk size's cells stores, its warm-up included."""
        size = chunk_bytes(shape)
        cells = sum(size * b * c * self.calls(size, b, c) for b in self.batches for c in self.clients)
        return cells + size * max(self.batches) * max(self.clients)

    def kvpool_dram_bytes(self) -> int:
        """kvpool's DRAM: twice what one cell (or the lookup) stores, so its chunks fit in a full pool."""
        lookup_bytes = chunk_bytes(LOOKUP_SHAPE) * self.lookup_keys
        return DRAM_PER_CELL * math.ceil(max(self.largest_cell_bytes(), lookup_bytes) / MIB) * MIB


def make_plan(
    *,
    quick: bool = False,
    smoke: bool = False,
    targets: bool = False,
    chunks: Sequence[str] | None = None,
    batches: Sequence[int] | None = None,
    clients: Sequence[int] | None = None,
    rounds: int | None = None,
) -> Plan:
    """The mode's plan, with any of its chunk sizes, batches, clients and rounds replaced."""
    if smoke:
        shapes = {"16KiB": SMOKE_SHAPES["16KiB"]} if quick else SMOKE_SHAPES
        plan = Plan(
            "quick" if quick else "full",
            shapes,
            (1, 8),
            (1,) if quick else (1, 4),
            SMOKE_ROUNDS,
            cell_bytes=MIB,
            min_calls=2,
            max_calls=4,
            lookup_keys=100,
            lookup_repeats=2,
            memcpy_bytes=16 * MIB,
            tcp_bytes=64 * MIB,
        )
    elif targets:  # the cells the targets are defined on (bench.harness.report); 32 MiB still has 6 calls behind a p99
        plan = Plan(
            "targets",
            {n: CHUNK_SHAPES[n] for n in report.TARGET_CHUNKS},
            (report.TARGET_BATCH,),
            (report.TARGET_CLIENTS,),
            REAL_ROUNDS,
            cell_bytes=GIB,
            min_calls=6,
            max_calls=100,
            lookup_keys=1000,
            lookup_repeats=5,
            memcpy_bytes=256 * MIB,
            tcp_bytes=GIB,
        )
    elif quick:
        plan = Plan(
            "quick",
            {"4MiB": CHUNK_SHAPES["4MiB"]},
            (1, 8),
            (1,),
            REAL_ROUNDS,
            cell_bytes=512 * MIB,
            min_calls=5,
            max_calls=100,
            lookup_keys=1000,
            lookup_repeats=5,
            memcpy_bytes=256 * MIB,
            tcp_bytes=GIB,
        )
    else:
        plan = Plan(
            "full",
            dict(CHUNK_SHAPES),
            (1, 8),
            (1, 4),
            REAL_ROUNDS,
            cell_bytes=512 * MIB,
            min_calls=2,
            max_calls=100,
            lookup_keys=1000,
            lookup_repeats=5,
            memcpy_bytes=256 * MIB,
            tcp_bytes=GIB,
        )
    known = SMOKE_SHAPES if smoke else CHUNK_SHAPES
    if chunks is not None:
        unknown = [c for c in chunks if c not in known]
        if unknown or not chunks:
            raise ValueError(f"--chunks: unknown size(s) {unknown}; choose from {','.join(known)}")
        plan = replace(plan, shapes={c: known[c] for c in chunks})
    if batches is not None:
        plan = replace(plan, batches=tuple(batches))
    if clients is not None:
        plan = replace(plan, clients=tuple(clients))
    if rounds is not None:
        plan = replace(plan, rounds=rounds)
    return plan


def chunk_bytes(shape: tuple[int, int, int]) -> int:
    layers, heads, head_size = shape
    return 2 * layers * TOKENS * heads * head_size * BF16_BYTES


# -- the flags that shape a plan ---------------------------------------------------------
def parse_names(text: str) -> list[str]:
    """Comma-separated names, in order, without repeats (chunk sizes are checked against the mode's)."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list, e.g. 4MiB,32MiB")
    return names


def parse_counts(text: str) -> list[int]:
    """Comma-separated positive integers, in order, without repeats."""
    try:
        counts = list(dict.fromkeys(int(n) for n in text.split(",") if n.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,8") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,8")
    return counts


def parse_rounds(text: str) -> int:
    rounds = parse_counts(text)
    most = (1 << dict(KEY_FIELDS_BITS)["round"]) - 1
    if len(rounds) != 1 or rounds[0] > most:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one number of rounds, at most {most}")
    return rounds[0]
