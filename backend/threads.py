"""Spreading blocking copies over worker threads, safely for the caller's buffers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

__all__ = ["map_in_threads"]

J = TypeVar("J")
R = TypeVar("R")


async def map_in_threads(executor: Executor, threads: int, fn: Callable[[J], R], jobs: Sequence[J]) -> list[R]:
    """``[fn(job) for job in jobs]`` spread over ``threads`` threads of ``executor``; results in order.

    Returns (or raises the first job's error) only once every thread is done, also when
    the caller is cancelled: the jobs may be writing into the caller's buffers, which it
    must not hand back before then.
    """
    loop = asyncio.get_running_loop()
    groups = [jobs[i::threads] for i in range(min(threads, len(jobs)))]
    futures = [loop.run_in_executor(executor, _map, fn, group) for group in groups]
    finished = asyncio.ensure_future(asyncio.wait(futures))
    try:
        await asyncio.shield(finished)
    except asyncio.CancelledError:
        await finished
        raise
    out: list[Any] = [None] * len(jobs)
    for start, future in enumerate(futures):
        out[start::threads] = future.result()
    return out


def _map(fn: Callable[[J], R], jobs: Sequence[J]) -> list[R]:
    return [fn(job) for job in jobs]
