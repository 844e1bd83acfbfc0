"""Tier manager: DRAM (LRU) in front of an optional NVMe tier, and what moves between them.

* A put reserves DRAM space. If DRAM is full, its least recently used chunks are
  demoted to NVMe (or, with no NVMe tier, evicted) until the chunk fits. A chunk the
  disk will not take is evicted instead, so DRAM stays writable whatever the disk
  does; only a DRAM tier that is all reserved or leased gives the put CapacityError.
* A background task keeps DRAM between its watermarks (demote above ``high``
  down to ``low``) so puts rarely wait for the disk.
* A full disk (ENOSPC/EDQUOT) starts an *episode*: one error line, the ``disk_full``
  counter +1, demotion paused (puts evict instead). The disk is checked every
  ``DISK_RECHECK_S``; the episode ends (one line) only once it has room for the
  largest chunk that did not fit plus a margin of as much again (at least
  ``DISK_RESUME_MARGIN_BYTES``), so a disk that frees one chunk's worth does not
  flap between full and not.
* NVMe evicts its least recently used files when a demotion needs room.
* A hit on NVMe is read back in a worker thread, verified, and promoted to DRAM;
  the file stays, so a later demotion of the same chunk costs nothing.
* A file whose checksum fails is moved to ``quarantine/`` and reads as a miss.
* A chunk under a lease (``leases.py``) is pinned: neither demoted nor evicted until
  the lease ends. Explicit deletes still remove it from the index at once.
* With a shared-memory arena (``arena.py``), DRAM chunks live in it, so clients on
  this host can copy them without a socket; when the arena has no room, a chunk
  lives in private memory and is served over TCP.

The manager never talks to Redis. It records which keys this node stopped holding
(``index_removed``) and which moved tier (``index_moved``); the server publishes them
in batches. All disk I/O runs on worker threads; the event loop never waits on a disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from backend.errors import CapacityError, IntegrityError
from backend.node.arena import ShmArena, remove_stale_arenas
from backend.node.buffers import BufferFactory, ChunkBuffer
from backend.node.dram import DramTier, StoredChunk
from backend.node.leases import LeaseTable
from backend.node.nvme import NvmeFile, read_payload, write_chunk
from backend.protocol import ItemMeta, checksum

__all__ = ["TierConfig", "TierManager", "DRAM", "NVME"]

logger = logging.getLogger(__name__)

DRAM = "dram"
NVME = "nvme"
HEADER_ALLOWANCE_BYTES = 4096  # room reserved on disk for a file's header
PREFAULT_BUDGET_BYTES = 256 * 1024 * 1024  # ready, pre-faulted buffers (see buffers.py)
DEMOTER_IDLE_S = 0.5
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
DISK_RECHECK_S = 2.0  # how often a full disk is looked at again
DISK_RESUME_MARGIN_BYTES = 1024 * 1024  # free space past one chunk before demotion resumes
PUT_RESERVE_WAIT_S = 5.0  # a put waits this long at most for other puts in flight to land in a full DRAM
ARENA_SLACK = 0.25  # arena room beyond DRAM for regions still held by leases or replies in flight
ARENA_MIN_SLACK_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TierConfig:
    dram_bytes: int
    nvme_dir: Path | None = None
    nvme_bytes: int = 0
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    io_threads: int = 4
    shm_dir: Path | None = None  # where the shared-memory arena lives; None: private memory only

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")


class NvmeIndex:
    """Which chunks are on disk, least recently used first, and the bytes they take."""

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.files: OrderedDict[str, NvmeFile] = OrderedDict()
        self.used_bytes = 0

    def add(self, record: NvmeFile) -> None:
        self.remove(record.meta.key)
        self.files[record.meta.key] = record
        self.used_bytes += record.file_bytes

    def remove(self, key: str) -> NvmeFile | None:
        record = self.files.pop(key, None)
        if record is not None:
            self.used_bytes -= record.file_bytes
        return record

    def touch(self, key: str) -> NvmeFile | None:
        record = self.files.get(key)
        if record is not None:
            self.files.move_to_end(key)
        return record


class TierManager:
    """DRAM + NVMe for one node. Use from the node's event loop only."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.dram = DramTier(config.dram_bytes)
        self.nvme = NvmeIndex(config.nvme_dir, config.nvme_bytes) if config.nvme_dir and config.nvme_bytes else None
        self.counters: Counter[str] = Counter()
        self.index_removed: set[str] = set()
        self.index_moved: dict[str, str] = {}
        self.disk_full = False
        self._disk_resume_bytes = 0  # free bytes that end the current disk-full episode
        self._disk_full_since = 0.0
        self._disk_recheck: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one demotion/eviction decision at a time
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvpool-nvme")
        self.leases = LeaseTable(on_unpinned=self._maybe_wake)
        self.arena = _open_arena(config)
        # Pre-faulted private buffers: for every chunk when there is no arena, else for the overflow.
        prefault = 0 if self.arena is not None else min(PREFAULT_BUDGET_BYTES, config.dram_bytes // 4)
        self.buffers = BufferFactory(prefault)
        self._wake = asyncio.Event()
        self._landed = asyncio.Event()  # set when reserved DRAM became a chunk, or was given back
        self._demoter: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self.nvme is not None and self._demoter is None:
            self._demoter = asyncio.get_running_loop().create_task(self._demote_loop())

    async def close(self) -> None:
        for task in (self._demoter, self._disk_recheck):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._io.shutdown(wait=True, cancel_futures=True)
        self.buffers.close()
        if self.arena is not None:
            self.arena.close()

    def load_nvme(self, records: list[NvmeFile]) -> None:
        """Adopt files found by recovery, oldest first (so LRU order follows file age)."""
        assert self.nvme is not None
        for record in records:
            self.nvme.add(record)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # -- accounting -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.dram.capacity_bytes + (self.nvme.capacity_bytes if self.nvme else 0)

    @property
    def used_bytes(self) -> int:
        return self.dram.used_bytes + (self.nvme.used_bytes if self.nvme else 0)

    def __len__(self) -> int:
        return len(self.keys())

    def contains(self, key: str) -> bool:
        return key in self.dram or (self.nvme is not None and key in self.nvme.files)

    def tier_of(self, key: str) -> str | None:
        if key in self.dram:
            return DRAM
        if self.nvme is not None and key in self.nvme.files:
            return NVME
        return None

    def meta_of(self, key: str) -> ItemMeta | None:
        chunk = self.dram.peek(key)
        if chunk is not None:
            return chunk.meta
        record = self.nvme.files.get(key) if self.nvme is not None else None
        return record.meta if record is not None else None

    def keys(self) -> set[str]:
        return set(self.dram.keys()) | (set(self.nvme.files) if self.nvme else set())

    def inventory(self) -> list[tuple[ItemMeta, str]]:
        """Every chunk held and the tier serving it (for republishing the index)."""
        held = [(chunk.meta, DRAM) for _, chunk in self.dram.items()]
        if self.nvme is not None:
            held += [(r.meta, NVME) for k, r in self.nvme.files.items() if k not in self.dram]
        return held

    def stats(self) -> dict[str, dict[str, Any]]:
        tiers: dict[str, dict[str, Any]] = {
            DRAM: {"capacity_bytes": self.dram.capacity_bytes, "used_bytes": self.dram.used_bytes,
                   "objects": len(self.dram)},
        }  # fmt: skip
        if self.nvme is not None:
            tiers[NVME] = {"capacity_bytes": self.nvme.capacity_bytes, "used_bytes": self.nvme.used_bytes,
                           "objects": len(self.nvme.files), "disk_full": self.disk_full}  # fmt: skip
        return tiers

    # -- put path ---------------------------------------------------------------------
    def take_buffer(self, nbytes: int) -> ChunkBuffer:
        """A buffer for a chunk entering DRAM: in the arena when it has room."""
        if self.arena is not None:
            buffer = self.arena.alloc(nbytes)
            if buffer is not None:
                return buffer
        return self.buffers.take(nbytes)

    async def reserve(self, nbytes: int, *, wait_s: float = 0.0) -> None:
        """Reserve DRAM for an incoming chunk, demoting or evicting older ones as needed.

        When nothing can move because other puts' reservations fill DRAM (a put striped
        over several connections receives on each at once), wait up to ``wait_s`` for them
        to land, since landed chunks can be demoted. Only a caller that holds no
        reservation of its own may wait (else two could wait for each other); the wait
        is outside the lock, so the others can demote meanwhile.
        """
        if nbytes > self.dram.capacity_bytes:
            raise CapacityError(
                f"chunk of {nbytes} bytes is larger than the DRAM tier ({self.dram.capacity_bytes} bytes)"
            )
        deadline = asyncio.get_running_loop().time() + wait_s
        while not self.dram.fits(nbytes):
            async with self._lock:
                while not self.dram.fits(nbytes):
                    victim = self.dram.oldest(skip=self.leases.pinned)
                    if victim is None:
                        break
                    await self._demote(victim, evict_on_failure=True)
            if self.dram.fits(nbytes):
                break
            in_flight = self.dram.used_bytes - self.dram.stored_bytes
            if in_flight <= 0 or not await self._wait_landed(deadline):
                raise CapacityError("DRAM tier is full of puts in flight and leased chunks")
        self.dram.reserve(nbytes)
        self._maybe_wake()

    def release(self, nbytes: int) -> None:
        self.dram.release(nbytes)
        self._landed.set()

    async def _wait_landed(self, deadline: float) -> bool:
        """Wait until some reservation lands or is given back; False once ``deadline`` passed."""
        self._landed.clear()
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(self._landed.wait(), remaining)
        except TimeoutError:
            return False
        return True

    def insert(self, chunk: StoredChunk) -> None:
        """Store a verified chunk in reserved DRAM; an NVMe copy with other bytes is dropped."""
        self.dram.insert(chunk)
        self._landed.set()
        if self.nvme is not None:
            old = self.nvme.files.get(chunk.meta.key)
            if old is not None and old.meta.checksum != chunk.meta.checksum:
                self._forget_file(old)

    def holds(self, key: str, item_checksum: int) -> bool:
        """Whether this node holds ``key`` with exactly these bytes (DRAM or NVMe)."""
        chunk = self.dram.peek(key)
        if chunk is not None:
            return chunk.meta.checksum == item_checksum
        record = self.nvme.files.get(key) if self.nvme is not None else None
        return record is not None and record.meta.checksum == item_checksum

    async def discard(self, chunk: StoredChunk) -> None:
        """Undo ``insert`` (the put was not committed), unless the key was replaced since."""
        key = chunk.meta.key
        if self.dram.peek(key) is chunk:
            self.dram.delete(key)
        elif self.dram.peek(key) is not None:
            return  # a newer put of the key owns it now
        record = self.nvme.files.get(key) if self.nvme is not None else None
        if record is not None and record.meta.checksum == chunk.meta.checksum:
            assert self.nvme is not None
            self.nvme.remove(key)
            await self._run(_unlink, record.path)
        if not self.contains(key):
            self.index_removed.add(key)  # an older committed copy may have been displaced

    # -- get path ---------------------------------------------------------------------
    async def get(self, key: str) -> StoredChunk | None:
        """The chunk from DRAM, or read back (verified) from NVMe and promoted; None if not held."""
        chunk = self.dram.get(key)
        if chunk is not None or self.nvme is None:
            return chunk
        record = self.nvme.touch(key)
        if record is None:
            return None
        nbytes = record.meta.nbytes
        try:
            await self.reserve(nbytes)
            promote = True
        except CapacityError:
            promote = False  # serve from disk without keeping a DRAM copy
        buffer = self.take_buffer(nbytes) if promote else self.buffers.take(nbytes)
        try:
            await self._run(read_payload, record, buffer)
        except (IntegrityError, OSError) as exc:
            if promote:
                self.release(nbytes)
            if self.nvme.files.get(key) is record:  # not if a newer file replaced it meanwhile
                await self._quarantine(record, exc)
            return None
        if self.nvme.files.get(key) is not record:
            # Deleted, or replaced by other bytes, while we read: what we hold is history.
            if promote:
                self.release(nbytes)
            return None
        chunk = StoredChunk(record.meta, buffer)
        if promote:
            current = self.dram.peek(key)
            if current is None:
                self.dram.insert(chunk)
                self.index_moved[key] = DRAM
                self.counters["promotions"] += 1
            else:  # a put of the same key landed while we read
                self.release(nbytes)
                chunk = current
        self.counters["nvme_reads"] += 1
        return chunk

    async def verify(self, key: str) -> str:
        """Re-check this node's copy of ``key``: "ok", "missing" or "corrupt" (then dropped)."""
        chunk = self.dram.peek(key)
        if chunk is not None:
            if checksum(chunk.buffer) == chunk.meta.checksum:
                return "ok"
            self.dram.delete(key)  # memory went bad: never serve it
            self.counters["integrity_failures"] += 1
            if self.nvme is None or key not in self.nvme.files:
                self.index_removed.add(key)
        record = self.nvme.touch(key) if self.nvme is not None else None
        if record is None:
            return "corrupt" if chunk is not None else "missing"
        try:
            await self._run(read_payload, record, self.buffers.take(record.meta.nbytes))
        except (IntegrityError, OSError) as exc:
            await self._quarantine(record, exc)
            return "corrupt"
        return "ok"

    async def delete(self, key: str) -> bool:
        found = self.dram.delete(key) is not None
        if self.nvme is not None:
            record = self.nvme.remove(key)
            if record is not None:
                found = True
                await self._run(_unlink, record.path)
        return found

    # -- movement ---------------------------------------------------------------------
    async def _demote(self, chunk: StoredChunk, *, evict_on_failure: bool = False) -> None:
        """Move a DRAM chunk to NVMe (or evict it with no NVMe tier). Caller holds the lock.

        With ``evict_on_failure`` (a put needs the room) a chunk the disk does not take
        is evicted instead; otherwise the CapacityError is raised.
        """
        key = chunk.meta.key
        if self.nvme is None:
            self._evict(chunk)
            return
        record = self.nvme.files.get(key)
        if record is None or record.meta.checksum != chunk.meta.checksum:
            try:
                written = await self._write(chunk)
            except CapacityError:
                if not evict_on_failure:
                    raise
                self._evict(chunk)
                return
            if written is None:
                return  # deleted or replaced while we wrote: nothing to move
            record = written
        if self.dram.peek(key) is chunk:
            self.dram.delete(key)
            self.index_moved[key] = NVME
            self.counters["demotions"] += 1
        elif (current := self.dram.peek(key)) is not None and current.meta.checksum != chunk.meta.checksum:
            self._forget_file(record)  # replaced by other bytes while we wrote

    def _evict(self, chunk: StoredChunk) -> None:
        """Drop a DRAM chunk that has no other place (no NVMe tier, or the disk will not take it)."""
        if self.dram.peek(chunk.meta.key) is chunk:
            self.dram.delete(chunk.meta.key)
            self.index_removed.add(chunk.meta.key)
            self.counters["evictions"] += 1

    async def _write(self, chunk: StoredChunk) -> NvmeFile | None:
        """Write a DRAM chunk's file; None if the chunk was deleted or replaced meanwhile."""
        assert self.nvme is not None
        need = chunk.meta.nbytes + HEADER_ALLOWANCE_BYTES
        if need > self.nvme.capacity_bytes:
            raise CapacityError(f"chunk of {chunk.meta.nbytes} bytes is larger than the NVMe tier")
        if self.disk_full:
            self._disk_resume_bytes = max(self._disk_resume_bytes, _resume_bytes(need))
            raise CapacityError("NVMe tier: the disk is full; demotion is paused")
        while self.nvme.used_bytes + need > self.nvme.capacity_bytes:
            pinned = self.leases.pinned
            oldest = next((r for k, r in self.nvme.files.items() if k not in pinned), None)
            if oldest is None:
                raise CapacityError("NVMe tier is full of leased chunks")
            self._forget_file(oldest)
            self.counters["nvme_evictions"] += 1
        job = asyncio.get_running_loop().run_in_executor(
            self._io, write_chunk, self.nvme.root, chunk.meta, chunk.buffer
        )
        try:
            record: NvmeFile = await asyncio.shield(job)
        except asyncio.CancelledError:
            # The put that needed this demotion gave up; the thread still finishes the
            # file, which nothing would index: remove it when it lands.
            job.add_done_callback(_unlink_written)
            raise
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                self._disk_full_begins(need, exc)
            else:
                self.counters["nvme_write_errors"] += 1
                logger.warning("NVMe tier %s: writing a chunk failed (%s); it is evicted from DRAM instead",
                               self.nvme.root, exc.strerror or exc)  # fmt: skip
            raise CapacityError(f"NVMe write failed: {exc.strerror}") from None
        current = self.dram.peek(chunk.meta.key)
        if current is None or current.meta.checksum != chunk.meta.checksum:
            await self._run(_unlink, record.path)  # the bytes we wrote are no longer wanted
            return None
        self.nvme.add(record)
        self.counters["nvme_writes"] += 1
        return record

    def _forget_file(self, record: NvmeFile) -> None:
        """Drop a file from the index now and from the disk in the background."""
        assert self.nvme is not None
        if self.nvme.files.get(record.meta.key) is record:
            self.nvme.remove(record.meta.key)
        if record.meta.key not in self.dram:
            self.index_removed.add(record.meta.key)
        asyncio.get_running_loop().run_in_executor(self._io, _unlink, record.path)

    async def _quarantine(self, record: NvmeFile, exc: BaseException) -> None:
        assert self.nvme is not None
        self.counters["integrity_failures"] += 1
        self.counters["quarantined"] += 1
        logger.error("NVMe tier: %s; quarantining %s", exc, os.path.basename(record.path))
        if self.nvme.files.get(record.meta.key) is record:
            self.nvme.remove(record.meta.key)
        if record.meta.key not in self.dram:
            self.index_removed.add(record.meta.key)
        await self._run(quarantine_file, self.nvme.root, record.path)

    def _maybe_wake(self) -> None:
        if self.nvme is not None and self.dram.used_bytes > self.config.high_watermark * self.dram.capacity_bytes:
            self._wake.set()

    async def _demote_loop(self) -> None:
        """Keep DRAM below the high watermark, demoting down to the low one."""
        low = self.config.low_watermark * self.dram.capacity_bytes
        high = self.config.high_watermark * self.dram.capacity_bytes
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), DEMOTER_IDLE_S)
            except TimeoutError:
                pass
            self._wake.clear()
            if self.dram.used_bytes <= high or self.disk_full:
                continue  # nothing to do, or paused until the disk has room
            async with self._lock:
                while self.dram.used_bytes > low and (victim := self.dram.oldest(self.leases.pinned)) is not None:
                    try:
                        await self._demote(victim)
                    except CapacityError:
                        break  # the disk refuses: puts will see CapacityError instead

    def _disk_full_begins(self, need: int, exc: OSError) -> None:
        """Start a disk-full episode (once: writes already in flight may fail after it began)."""
        assert self.nvme is not None
        self._disk_resume_bytes = max(self._disk_resume_bytes, _resume_bytes(need))
        if self.disk_full:
            return
        self.disk_full = True
        self._disk_full_since = time.monotonic()
        self.counters["disk_full"] += 1
        logger.error("NVMe tier %s: disk full (%s); demotion paused, DRAM evicts its least recently used chunks "
                     "instead until %d bytes are free", self.nvme.root, exc.strerror, self._disk_resume_bytes)  # fmt: skip
        self._disk_recheck = asyncio.get_running_loop().create_task(self._wait_for_disk_room())

    async def _wait_for_disk_room(self) -> None:
        """End the episode once the disk has ``_disk_resume_bytes`` free (checked every DISK_RECHECK_S)."""
        assert self.nvme is not None
        root = self.nvme.root
        while True:
            await asyncio.sleep(DISK_RECHECK_S)
            try:
                free = int(await self._run(lambda: shutil.disk_usage(root).free))
            except OSError as exc:
                logger.warning("NVMe tier %s: cannot read the free space (%s)", root, exc.strerror or exc)
                continue
            if free >= self._disk_resume_bytes:
                break
        self.disk_full = False
        self._disk_resume_bytes = 0
        self._disk_recheck = None
        logger.warning("NVMe tier %s: %d bytes free again after %.0f s; demotion resumes", root, free,
                       time.monotonic() - self._disk_full_since)  # fmt: skip
        self._maybe_wake()


def _resume_bytes(need: int) -> int:
    """Free space that ends a disk-full episode: room for a chunk of ``need`` bytes, plus a margin."""
    return need + max(need, DISK_RESUME_MARGIN_BYTES)


def _open_arena(config: TierConfig) -> ShmArena | None:
    """The shared-memory arena for DRAM, or None (logged) when the directory cannot hold one."""
    if config.shm_dir is None:
        return None
    stale = remove_stale_arenas(config.shm_dir)
    if stale:
        logger.info("removed %d shared-memory arena(s) of nodes that no longer run", stale)
    size = config.dram_bytes + max(int(config.dram_bytes * ARENA_SLACK), ARENA_MIN_SLACK_BYTES)
    try:
        return ShmArena(config.shm_dir, size)
    except OSError as exc:
        logger.warning("no shared-memory arena in %s (%s): same-host clients read over TCP",
                       config.shm_dir, exc.strerror or exc)  # fmt: skip
        return None


def _unlink_written(job: Any) -> None:
    if not job.cancelled() and job.exception() is None:
        _unlink(job.result().path)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


QUARANTINE_DIR = "quarantine"


def quarantine_file(root: Path, path: str) -> Path:
    """Move a bad file out of the chunk tree (kept for inspection, never served)."""
    target_dir = root / QUARANTINE_DIR
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / os.path.basename(path)
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, target)
    return target
