"""How the L2 adapter runs LMCache's tasks: on its own loop thread, results parked, event fds signalled.

LMCache's store and prefetch controller threads call ``submit_*`` and get a task id
back at once; the work runs on the adapter's loop; its result waits in a
:class:`Completed` table until LMCache polls it, and the table's event fd tells
LMCache when to poll, as LMCache's own adapters do.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

from lmcache.v1.distributed.l2_adapters.base import L2TaskId
from lmcache.v1.platform import create_event_notifier

from backend.errors import KVPoolError
from backend.threads import LoopThread

__all__ = ["Completed", "TaskRunner"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Completed(Generic[R]):
    """Finished tasks of one kind: their results until LMCache takes them, and the event fd it polls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[L2TaskId, R] = {}
        self._efd = create_event_notifier()

    def fileno(self) -> int:
        return int(self._efd.fileno())

    def finish(self, task_id: L2TaskId, result: R) -> None:
        with self._lock:
            self._done[task_id] = result
        self._efd.notify()

    def pop(self, task_id: L2TaskId) -> R | None:
        with self._lock:
            return self._done.pop(task_id, None)

    def pop_all(self) -> dict[L2TaskId, R]:
        with self._lock:
            done, self._done = self._done, {}
        return done

    def close(self) -> None:
        self._efd.close()


class TaskRunner:
    """The adapter's event-loop thread: task ids, coroutines started from LMCache's threads, bounded waits."""

    def __init__(self, name: str) -> None:
        self._loop = LoopThread(name)
        self._lock = threading.Lock()
        self._next_task_id: L2TaskId = 0
        self._running: set[concurrent.futures.Future[None]] = set()
        self.closed = False

    def new_task_id(self) -> L2TaskId:
        with self._lock:
            task_id = self._next_task_id
            self._next_task_id += 1
        return task_id

    def submit(self, coro: Coroutine[Any, Any, None]) -> None:
        """Start ``coro`` on the loop and return at once."""
        if self.closed:
            coro.close()
            raise KVPoolError("the kvpool L2 adapter is closed")
        future = self._loop.submit(coro)
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._running.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.error("kvpool: L2 task failed: %r", future.exception())

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop and wait, bounded (never from the loop itself)."""
        try:
            return self._loop.call(coro, timeout_s)
        except TimeoutError:
            raise KVPoolError(f"kvpool L2 adapter call timed out after {timeout_s:.1f} s") from None

    def start(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a background coroutine that is not a task of LMCache's (the usage refresher)."""
        return self._loop.submit(coro)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._running)

    def is_alive(self) -> bool:
        return self._loop.thread.is_alive() and not self.closed

    def stop(self, timeout_s: float) -> None:
        self._loop.stop(timeout_s)
