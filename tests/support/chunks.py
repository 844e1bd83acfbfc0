"""Chunks for tests: seeded random bytes under numbered or LMCache-shaped keys, and the check that they read back."""

from __future__ import annotations

import random

from kvpool import Chunk, SyncPoolClient

__all__ = ["numbered_chunks", "seeded_chunks", "all_read_back"]


def numbered_chunks(prefix: str, count: int, size: int, seed: int = 0) -> list[Chunk]:
    """``count`` chunks of ``size`` seeded random bytes, keyed ``PREFIX@i``."""
    rng = random.Random(seed)
    return [Chunk(f"{prefix}@{i}", rng.randbytes(size)) for i in range(count)]


def seeded_chunks(prefix: str, count: int, size: int, seed: int = 0) -> list[Chunk]:
    """``count`` chunks of ``size`` seeded random bytes, keyed like LMCache's (``PREFIX@1@0@i@bfloat16``)."""
    rng = random.Random(seed)
    return [Chunk(f"{prefix}@1@0@{i}@bfloat16", rng.randbytes(size)) for i in range(count)]


def all_read_back(client: SyncPoolClient, stored: list[Chunk]) -> bool:
    """Every chunk of ``stored`` reads back byte-identical through ``client``."""
    got = client.get([c.key for c in stored])
    return [None if g is None else bytes(g.data) for g in got] == [bytes(c.data) for c in stored]
