"""Threads next to an event loop: blocking copies spread over workers, and a loop run on its own thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

__all__ = ["LoopThread", "map_in_threads"]

J = TypeVar("J")
R = TypeVar("R")
T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running on a daemon thread of its own, for code that is not async.

    Blocking code hands it coroutines (:meth:`call` waits, :meth:`submit` does not); the
    loop is closed by :meth:`stop` only once its thread has returned.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop and return at once."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result; on a timeout it is cancelled and TimeoutError raised.

        Never call it from the loop's own thread: it would wait on itself.
        """
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def is_alive(self) -> bool:
        return self.thread.is_alive() and not self.loop.is_closed()

    def stop(self, timeout_s: float, *, close: bool = True) -> None:
        """Stop the loop and wait up to ``timeout_s`` for its thread; then close the loop if the thread ended.

        ``close=False`` leaves it open for threads that may still schedule on it (LMCache's own).
        """
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if close and not self.thread.is_alive():
            self.loop.close()


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
