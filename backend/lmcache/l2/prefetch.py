"""The L2 adapter's read side: lookup-and-lock (real leases), unlock, and load into LMCache's objects."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.base import L2TaskId

from backend.client import Lock, PoolClient
from backend.config.values import ms_to_s
from backend.counters import L2Counter, MissCause
from backend.errors import KVPoolError
from backend.lmcache.boundary import MissBoundary
from backend.lmcache.l2.keys import SaltNames
from backend.lmcache.l2.tasks import Completed, TaskRunner
from backend.lmcache.l2.unreadable import Unreadable
from backend.lmcache.layout import object_fingerprint
from backend.protocol import ItemMeta
from backend.transport import Buffer

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryObj

__all__ = ["Prefetcher"]

RELEASE_ATTEMPTS = 3  # then the lease's TTL frees the chunk
RELEASE_RETRY_S = 0.2


class BufferSink:
    """Receives each key straight into the caller's memory object, or declines it; only chunks stored with
    ``fingerprint``, the layout fingerprint of those objects (``backend.client.chunks.sink_fingerprint``)."""

    def __init__(self, buffers: Mapping[str, memoryview], misses: MissBoundary, fingerprint: int) -> None:
        self.buffers = buffers
        self.misses = misses
        self.fingerprint = fingerprint

    async def allocate(self, meta: ItemMeta) -> tuple[str, Buffer] | None:
        view = self.buffers.get(meta.key)
        if view is None:
            return None
        if len(view) != meta.nbytes:
            # Another layout under the same key (a different L1 chunk shape): a miss, never a partial copy.
            self.misses.miss(
                MissCause.SIZE,
                "%s holds %d bytes but LMCache's buffer has %d; reading as a miss",
                meta.key,
                meta.nbytes,
                len(view),
            )
            return None
        return meta.key, view

    def release(self, handle: str) -> None:
        pass  # the buffer belongs to LMCache


class Prefetcher:
    """Lookup-and-lock, unlock and load for LMCache's prefetch controller; holds the leases it took."""

    def __init__(
        self,
        client: PoolClient,
        names: SaltNames,
        tasks: TaskRunner,
        misses: MissBoundary,
        counters: Counter[str],
        lease_ttl_ms: int,
        notify_accessed: Callable[[list[ObjectKey]], None],
        unreadable: Unreadable,
    ) -> None:
        self.client = client
        self.names = names
        self.tasks = tasks
        self.misses = misses
        self.counters = counters
        self.lease_ttl_ms = lease_ttl_ms
        self._notify_accessed = notify_accessed
        self.unreadable = unreadable  # names a load missed: the store sends them again
        self._lock = threading.Lock()
        # One lease per successful lookup, with the monotonic time its ttl ends; oldest first.
        self._held: defaultdict[ObjectKey, list[tuple[float, Lock]]] = defaultdict(list)
        self._next_prune = 0.0
        self.lookups: Completed[Bitmap] = Completed()
        self.loads: Completed[Bitmap] = Completed()

    # -- lookup and lease -------------------------------------------------------------
    def submit_lookup_and_lease(self, keys: list[ObjectKey]) -> L2TaskId:
        task_id = self.tasks.new_task_id()
        self.tasks.submit(self._lookup_and_lease(task_id, list(keys)))
        return task_id

    async def _lookup_and_lease(self, task_id: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            # One Redis round trip, then one LEASE per node: a hit is also a lease. A refused key is a miss.
            names = self.names.names(keys)
            asked = [name for name in names if name is not None]
            got = iter(await self.client.lock(asked, self.lease_ttl_ms) if asked else [])
            leases = [None if name is None else next(got) for name in names]
            now = time.monotonic()
            ends = now + ms_to_s(self.lease_ttl_ms)
            with self._lock:
                for i, (key, lease) in enumerate(zip(keys, leases)):
                    if lease is not None:
                        bitmap.set(i)
                        self._held[key].append((ends, lease))
                if now >= self._next_prune:
                    self._prune(now)
            self.misses.recovered(MissCause.LOOKUP)
        except Exception as exc:  # the task must complete, or LMCache waits on it forever
            self.misses.failed(MissCause.LOOKUP, "L2 lookup failed, reading as misses", exc)
        self.lookups.finish(task_id, bitmap)

    def _prune(self, now: float) -> None:
        """Forget leases whose ttl has ended (LMCache never unlocked them; their nodes ended them): what is
        held stays bounded by the lookups of the last ttl and a half, however many chunks LMCache looks up.
        Caller holds the lock; runs at most twice per ttl."""
        for key in list(self._held):
            live = [(ends, lease) for ends, lease in self._held[key] if ends > now]
            if live:
                self._held[key] = live
            else:
                del self._held[key]
        self._next_prune = now + ms_to_s(self.lease_ttl_ms) / 2

    @property
    def held_count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._held.values())

    def take_all_held(self) -> list[Lock]:
        """Every lease still held, now no longer tracked (for close)."""
        with self._lock:
            held = [lease for leases in self._held.values() for _, lease in leases]
            self._held.clear()
        return held

    def submit_release(self, keys: list[ObjectKey]) -> None:
        """End the oldest lease held of each key (LMCache's unlock); keys holding none are ignored."""
        with self._lock:
            popped = [self._held_pop(k) for k in keys]
        leases = [lease for lease in popped if lease is not None]
        if leases and not self.tasks.closed:
            self.tasks.submit(self._release(leases))

    def _held_pop(self, key: ObjectKey) -> Lock | None:
        held = self._held.get(key)
        if not held:
            return None
        _, lease = held.pop(0)
        if not held:
            del self._held[key]
        return lease

    async def _release(self, leases: list[Lock]) -> None:
        # LMCache never retries an unlock: try a few times; after that the lease's TTL frees the chunk.
        for attempt in range(RELEASE_ATTEMPTS):
            try:
                await self.client.unlock(leases)
                return
            except KVPoolError as exc:
                if attempt == RELEASE_ATTEMPTS - 1:
                    self.misses.miss(
                        MissCause.UNLOCK,
                        "unlock of %d chunks failed (%s); their leases end after %d ms",
                        len(leases),
                        exc,
                        self.lease_ttl_ms,
                    )
                    return
                await asyncio.sleep(RELEASE_RETRY_S)

    # -- load -------------------------------------------------------------------------
    def submit_load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = self.tasks.new_task_id()
        self.tasks.submit(self._load(task_id, list(keys), list(objects)))
        return task_id

    async def _load(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            names = self.names.names(keys)
            views = [memoryview(obj.byte_array).cast("B") for obj in objects]
            # One read per layout: a chunk stored with another layout fingerprint than its object's is a miss
            # (the node sends no bytes), however many bytes it holds.
            by_layout: defaultdict[int, list[tuple[int, str]]] = defaultdict(list)
            for i, (name, obj) in enumerate(zip(names, objects)):
                if name is not None:  # else refused: a miss
                    by_layout[object_fingerprint(obj)].append((i, name))
            reads = [self._read(fingerprint, named, views) for fingerprint, named in by_layout.items()]
            done = await asyncio.gather(*reads, return_exceptions=True)  # none still writes once this returns
            failed = next((outcome for outcome in done if isinstance(outcome, BaseException)), None)
            if failed is not None:
                raise failed
            loaded = sorted(i for outcome in done if not isinstance(outcome, BaseException) for i in outcome)
            for i in loaded:
                bitmap.set(i)
            self.counters[L2Counter.LOADED_CHUNKS] += len(loaded)
            self.counters[L2Counter.LOAD_MISSES] += len(keys) - len(loaded)
            hit = set(loaded)
            missed = [names[i] for i in range(len(keys)) if i not in hit]
            self.unreadable.add(name for name in missed if name is not None)
            if loaded:
                self._notify_accessed([keys[i] for i in loaded])
            self.misses.recovered(MissCause.LOAD)
        except Exception as exc:
            self.misses.failed(MissCause.LOAD, "L2 load failed, reading as misses", exc)
        self.loads.finish(task_id, bitmap)

    async def _read(self, fingerprint: int, named: list[tuple[int, str]], views: list[memoryview]) -> list[int]:
        """Read the objects ``named`` (index, pool name), all of layout ``fingerprint``, in one get; the indexes
        loaded."""
        first: dict[str, int] = {}  # a key named twice is fetched once, then copied to its other objects
        for i, name in named:
            first.setdefault(name, i)
        unique = list(first)
        sink = BufferSink({name: views[first[name]] for name in unique}, self.misses, fingerprint)
        handles = await self.client.get(unique, sink)
        got = dict(zip(unique, handles))
        loaded = []
        for i, name in named:
            if got[name] is None:
                continue
            if i != first[name]:
                if len(views[i]) != len(views[first[name]]):
                    continue  # another size under the same key and layout: a miss for this object
                views[i][:] = views[first[name]]
            loaded.append(i)
        return loaded

    def close(self) -> None:
        self.lookups.close()
        self.loads.close()
