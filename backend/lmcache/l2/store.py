"""The L2 adapter's write side: store (only what the pool lacks) and delete (LMCache's L2 eviction)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2TaskId

from backend.client import PoolClient
from backend.counters import L2Counter, MissCause
from backend.errors import BusyError, KVPoolError, PutOutcome
from backend.lmcache.boundary import MissBoundary
from backend.lmcache.chunks import to_chunk
from backend.lmcache.l2.keys import SaltNames
from backend.lmcache.l2.tasks import Completed, TaskRunner
from backend.lmcache.l2.unreadable import Unreadable
from backend.lmcache.l2.usage import UsageView
from backend.lmcache.layout import object_fingerprint

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryObj

__all__ = ["Storer"]

logger = logging.getLogger(__name__)

Notify = Callable[[list[ObjectKey], list[int]], None]


class Storer:
    """Store tasks for LMCache's store controller, and ``delete``; tells LMCache's listeners what changed."""

    def __init__(
        self,
        client: PoolClient,
        names: SaltNames,
        tasks: TaskRunner,
        misses: MissBoundary,
        counters: Counter[str],
        usage: UsageView,
        notify_stored: Notify,
        notify_deleted: Notify,
        unreadable: Unreadable,
    ) -> None:
        self.client = client
        self.names = names
        self.tasks = tasks
        self.misses = misses
        self.counters = counters
        self.usage = usage
        self._notify_stored = notify_stored
        self._notify_deleted = notify_deleted
        self.unreadable = unreadable  # names this adapter's loads missed: stored even though the index lists them
        self.stores: Completed[L2StoreResult] = Completed()

    def submit_store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = self.tasks.new_task_id()
        self.tasks.submit(self._store(task_id, list(keys), list(objects)))
        return task_id

    async def _store(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        ok = True
        sent_bytes = 0
        stored: list[ObjectKey] = []
        sizes: list[int] = []
        try:
            named = [(i, name) for i, name in enumerate(self.names.names(keys)) if name is not None]  # else refused
            # Re-sending a chunk the pool has is wasted bandwidth and would count its bytes twice; unless this
            # adapter's load of it missed (another layout's copy, an older adapter's: .unreadable).
            present = await self.client.contains([name for _, name in named]) if named else []
            todo = [(i, name) for (i, name), hit in zip(named, present) if not hit or self._replaces(name)]
            # Each chunk carries its object's layout fingerprint: only a load into an object of that layout reads it.
            chunks = [to_chunk(name, objects[i], object_fingerprint(objects[i])) for i, name in todo]
            skipped: set[str] = set()
            try:
                await self.client.put(chunks)
            except BusyError as exc:
                # The pool was saturated, nothing failed: the busy chunks are a skipped store.
                skipped = {key for key, outcome in exc.outcomes.items() if outcome is not PutOutcome.STORED}
                self.counters[L2Counter.STORE_SKIPPED_BUSY] += len(skipped)
                logger.debug("kvpool: L2 store skipped %d chunks, the pool is busy: %s", len(skipped), exc)
            for (i, _), chunk in zip(todo, chunks):
                if chunk.key not in skipped:
                    stored.append(keys[i])
                    sizes.append(len(memoryview(chunk.data)))
            sent_bytes = sum(sizes)
            self.misses.recovered(MissCause.STORE)
        except Exception as exc:  # the task must complete, or LMCache waits on it forever
            ok = False
            self.misses.failed(MissCause.STORE, "L2 store failed, those chunks stay out of the pool", exc)
        if stored:
            self.counters[L2Counter.STORED_CHUNKS] += len(stored)
            self.usage.count_salt_bytes(stored, sizes, +1)
            self._notify_stored(stored, sizes)
        self.stores.finish(task_id, L2StoreResult(ok, sent_bytes))

    def _replaces(self, name: str) -> bool:
        """Whether a store of ``name``, which the index lists, goes out anyway (to replace a copy a load missed)."""
        if not self.unreadable.take(name):
            return False
        self.counters[L2Counter.STORE_REPLACED] += 1
        return True

    def delete(self, keys: list[ObjectKey], timeout_s: float) -> None:
        """Remove keys from the pool; bounded by ``timeout_s``, synchronous by LMCache's interface."""
        if not keys or self.tasks.closed:
            return
        try:
            deleted, sizes = self.tasks.call(self._delete(list(keys)), timeout_s)
        except KVPoolError as exc:
            logger.warning("kvpool: L2 delete of %d keys failed: %s", len(keys), exc)
            return
        if deleted:
            self.usage.count_salt_bytes(deleted, sizes, -1)
            self._notify_deleted(deleted, sizes)

    async def _delete(self, keys: list[ObjectKey]) -> tuple[list[ObjectKey], list[int]]:
        named = [(key, name) for key, name in zip(keys, self.names.names(keys)) if name is not None]
        keys, names = [key for key, _ in named], [name for _, name in named]
        entries = await self.client.index.lookup([self.names.stored(name) for name in names])  # as stored
        await self.client.delete(names)
        present = [(k, e[0].nbytes) for k, e in zip(keys, entries) if e]
        return [k for k, _ in present], [n for _, n in present]

    def close(self) -> None:
        self.stores.close()
