"""``kvpool selftest``: a few chunks put, looked up, read back and deleted through the pool, step by step.

The first minute on a new machine: with the credentials of the URL it is given, does
the pool store, find and return bytes, unchanged? Each step is a :class:`Finding`
(``ok`` or ``FAIL`` with the reason; a step that needs a failed one is skipped). Keys
are random, under :data:`SELFTEST_PREFIX`, and deleted at the end whatever happened.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

from backend.client import Chunk, PoolClient
from backend.config import format_size
from backend.doctor.findings import Finding
from backend.doctor.pool import reach
from backend.errors import KVPoolError

__all__ = ["SELFTEST_PREFIX", "DEFAULT_CHUNKS", "DEFAULT_CHUNK_BYTES", "selftest"]

SELFTEST_PREFIX = "kvpool-selftest/"
DEFAULT_CHUNKS = 4
DEFAULT_CHUNK_BYTES = 256 * 1024
STEPS = ("Redis", "put", "lookup", "get", "delete")


def _ms(start: float) -> str:
    return f"{(time.perf_counter() - start) * 1000:.1f} ms"


async def selftest(
    client: PoolClient, *, chunks: int = DEFAULT_CHUNKS, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[Finding]:
    """Put ``chunks`` random chunks of ``chunk_bytes``, look them up, get them, delete them: one finding a step."""
    found = await reach(client)  # Redis with these credentials, and a live node in the namespace
    if not all(f.ok for f in found):
        return [*found, *(Finding.skipped(step, "the pool is not reachable") for step in STEPS[1:])]
    run = f"{SELFTEST_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}/"
    data = [Chunk(f"{run}{i}", os.urandom(chunk_bytes)) for i in range(chunks)]
    keys = [c.key for c in data]
    size = f"{chunks} chunks of {format_size(chunk_bytes)}"
    try:
        found += await _steps(client, data, size)
    finally:
        found.append(await _delete(client, keys))
    return found


async def _steps(client: PoolClient, data: list[Chunk], size: str) -> list[Finding]:
    keys = [c.key for c in data]
    start = time.perf_counter()
    try:
        await client.put(data)
    except KVPoolError as exc:
        return [
            Finding.failed("put", f"{size}: {exc}", "see `kvpool doctor --url URL` and the node logs"),
            Finding.skipped("lookup", "nothing was stored"),
            Finding.skipped("get", "nothing was stored"),
        ]
    found = [Finding.passed("put", f"{size} stored in {_ms(start)}")]
    start = time.perf_counter()
    present = await client.contains(keys)  # a Redis failure reads as misses here, as it does for engines
    if not all(present):
        missing = present.count(False)
        found.append(
            Finding.failed(
                "lookup",
                f"{missing} of {len(keys)} keys just stored are not found in the index",
                "see `kvpool doctor --url URL` (Redis, clocks) and `kvpool check`",
            )
        )
    else:
        found.append(Finding.passed("lookup", f"{len(keys)} of {len(keys)} found in {_ms(start)}"))
    start = time.perf_counter()
    try:
        got = await client.get(keys)
    except KVPoolError as exc:
        return [*found, Finding.failed("get", str(exc), "see `kvpool doctor --url URL`")]
    same = sum(1 for chunk, g in zip(data, got) if g is not None and bytes(g.data) == bytes(chunk.data))
    missed = sum(1 for g in got if g is None)
    if same != len(keys):
        found.append(
            Finding.failed(
                "get",
                f"{same} of {len(keys)} came back byte-identical ({missed} missed, {len(keys) - same - missed} differed)",
                "a node this host cannot reach reads as a miss: `kvpool doctor --url URL` names it",
            )
        )
    else:
        found.append(Finding.passed("get", f"{len(keys)} of {len(keys)} byte-identical in {_ms(start)}"))
    return found


async def _delete(client: PoolClient, keys: list[str]) -> Finding:
    """Remove the run's keys; the step fails if any is still found afterwards."""
    start = time.perf_counter()
    try:
        removed = await client.delete(keys)
        left = sum(await client.contains(keys))
    except KVPoolError as exc:
        return Finding.failed(
            "delete", f"{exc}; the keys start with {keys[0].rsplit('/', 1)[0]}/", "kvpool evict --prefix"
        )
    if left:
        return Finding.failed("delete", f"{left} of {len(keys)} keys are still found after the delete")
    return Finding.passed("delete", f"{removed} removed in {_ms(start)}")
