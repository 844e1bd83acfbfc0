"""What every part of one client shares: its config and deadlines, counters, warnings, background tasks and worker threads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from backend.config import PoolConfig
from backend.config.deadlines import Deadlines
from backend.counters import ClientCounter
from backend.errors import KVPoolError
from backend.threads import map_in_threads

__all__ = ["ClientContext", "BULK_THREADS"]

J = TypeVar("J")
R = TypeVar("R")

logger = logging.getLogger("backend.client")

# Worker threads for bulk copies (socket receives and sends, arena copies, checksums).
# Two keep both cores of a small host busy with one batch; more only queue.
BULK_THREADS = 2


class ClientContext:
    """Shared by the registry view, the readers, the put planner and the facade of one client."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.deadlines = Deadlines.from_config(config)  # every bound the parts wait under
        self.counters: defaultdict[ClientCounter, int] = defaultdict(int)
        self._warned: set[str] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._bulk: ThreadPoolExecutor | None = None
        self.pid = os.getpid()
        self.closed = False

    @property
    def bulk(self) -> ThreadPoolExecutor:
        """The worker threads for bulk copies, started on first use."""
        if self._bulk is None:
            self._bulk = ThreadPoolExecutor(BULK_THREADS, thread_name_prefix="kvpool-bulk")
        return self._bulk

    def check_open(self) -> bool:
        """Raise if closed; True when this process forked since the last call (its sockets are the parent's)."""
        if self.closed:
            raise KVPoolError("PoolClient is closed")
        if os.getpid() == self.pid:
            return False
        self.pid = os.getpid()
        self._bulk = None  # threads do not survive a fork
        return True

    def warn_once(self, cause: str, message: str, *args: Any) -> None:
        """Log ``message`` once until :meth:`recovered` clears ``cause``."""
        if cause not in self._warned:
            self._warned.add(cause)
            logger.warning(message, *args)

    def recovered(self, cause: str) -> None:
        self._warned.discard(cause)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; :meth:`close` cancels what is still running."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def map_in_threads(self, fn: Callable[[J], R], jobs: Sequence[J]) -> list[R]:
        """``[fn(job) for job in jobs]`` on the bulk threads (``backend.threads.map_in_threads``)."""
        return await map_in_threads(self.bulk, BULK_THREADS, fn, jobs)

    async def close(self) -> None:
        """Cancel background work (bounded) and let the worker threads go."""
        self.closed = True
        for task in list(self._background):
            task.cancel()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await asyncio.gather(*self._background, return_exceptions=True)
        if self._bulk is not None:
            self._bulk.shutdown(wait=False)
