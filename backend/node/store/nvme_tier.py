"""The NVMe tier as the tier manager sees it: which files exist (in eviction order), and every disk I/O on them.

The file format and its crash ordering are in ``nvme_format.py``; this module keeps the
index of files this node holds (packed: no object per file), in eviction order, with the bytes they take,
and runs every read, write, unlink and quarantine on its own worker threads, so the
event loop never waits on a disk.

* A write makes room first by dropping the least recently used files that no lease pins.
* A full disk (ENOSPC/EDQUOT) starts an *episode*: one error line, the ``disk_full``
  counter +1, demotion paused (puts evict instead). The disk is checked every
  ``DISK_RECHECK_S``; the episode ends (one line) only once it has room for the
  largest chunk that did not fit plus a margin of as much again (at least
  ``DISK_RESUME_MARGIN_BYTES``), so a disk that frees one chunk's worth does not
  flap between full and not.
* A file whose checksum fails is moved to ``quarantine/`` and reads as a miss.
* The capacity it advertises is never more than the disk can hold for it
  (:attr:`NvmeTier.advertised_bytes`): a size larger than the disk is said at start and
  capped, so placement does not send such a node every put.

A file leaving the index is reported through ``on_gone(key)``: the tier manager
decides whether the key left the node (nothing in DRAM) and the index must hear of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from backend.config.values import format_size
from backend.counters import NodeCounter
from backend.errors import CapacityError
from backend.node.memory.buffers import ChunkBuffer
from backend.node.memory.columns import column, grown
from backend.node.store.bookkeeping import NO_SLOT, ON_NVME, PINNED, ChunkTable
from backend.node.store.dram import StoredChunk
from backend.node.store.eviction import EvictionOrder, LruOrder
from backend.node.store.nvme_format import CHUNKS_DIR, NvmeFile, chunk_name, read_payload, write_chunk
from backend.protocol.reports import TierReport

__all__ = ["NvmeTier", "quarantine_file", "QUARANTINE_DIR", "DISK_RECHECK_S", "DISK_RESUME_MARGIN_BYTES"]

logger = logging.getLogger(__name__)

HEADER_ALLOWANCE_BYTES = 4096  # room reserved on disk for a file's header
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
DISK_RECHECK_S = 2.0  # how often a full disk is looked at again
DISK_RESUME_MARGIN_BYTES = 1024 * 1024  # free space past one chunk before demotion resumes
DISK_ROOM_TTL_S = 1.0  # how long the disk's free space, read for the advertised capacity, is reused
QUARANTINE_DIR = "quarantine"


class NvmeTier:
    """The files of one NVMe tier, in eviction order (LRU unless another is given). Use from the node's event
    loop only.

    A file's record is its key's slot in the node's ``ChunkTable`` (size, checksum, layout),
    where its payload starts (4 bytes here) and its place in the order (8): its path is its
    key's (``nvme_format.chunk_path``), so no record object is kept per file; one is made
    (:class:`NvmeFile`) when a file is read, written or removed.
    """

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        *,
        io_threads: int,
        counters: Counter[NodeCounter],
        table: ChunkTable,
        on_gone: Callable[[str], None],
        on_room: Callable[[], None],
        order: EvictionOrder | None = None,
    ) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.table = table
        self.order: EvictionOrder = order if order is not None else LruOrder()
        table.orders[ON_NVME] = self.order
        self._data_offset = column("I")  # slot -> where the payload starts in its file
        self._count = 0
        self.used_bytes = 0
        self.counters = counters
        self.disk_full = False
        self._on_gone = on_gone
        self._on_room = on_room
        self._disk_resume_bytes = 0  # free bytes that end the current disk-full episode
        self._disk_full_since = 0.0
        self._disk_recheck: asyncio.Task[None] | None = None
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvpool-nvme")
        self._disk_free_bytes = 0
        self._disk_free_at = -DISK_ROOM_TTL_S

    async def close(self) -> None:
        if self._disk_recheck is not None:
            self._disk_recheck.cancel()
            await asyncio.gather(self._disk_recheck, return_exceptions=True)
        self._io.shutdown(wait=True, cancel_futures=True)

    # -- the index --------------------------------------------------------------------
    @property
    def advertised_bytes(self) -> int:
        """The capacity this tier reports, and placement weighs: its size (``--nvme``), but never more than the
        disk can hold for it, its files plus the disk's free space (read at most every DISK_ROOM_TTL_S).

        A size larger than the disk would otherwise make placement, which weighs nodes by
        free capacity, send this node nearly every put. Nodes whose tiers share a disk each
        count its whole free space: together they advertise more than it holds, and the
        first to fill it stops at a full disk (a disk-full episode) as one node alone would.
        """
        now = time.monotonic()
        if now - self._disk_free_at >= DISK_ROOM_TTL_S:
            with contextlib.suppress(OSError):  # unreadable: the last value read stands
                self._disk_free_bytes = _disk_usage(self.root).free
            self._disk_free_at = now
        return min(self.capacity_bytes, self._disk_free_bytes + self.used_bytes)

    def warn_if_larger_than_disk(self) -> None:
        """Say when the configured size is more than the disk can give (free space plus this tier's files): the
        tier advertises only what the disk can give (:attr:`advertised_bytes`). At start, before recovery has
        found the tier's files, and again once it has."""
        disk = _disk_usage(self.root)
        room = disk.free + self.used_bytes
        if self.capacity_bytes > room:
            logger.warning(
                "nvme: --nvme %s is more than the disk holding %s can give (%s free, %s total, %s of it "
                "this tier's files); the node advertises %s, the free space plus its files, so placement "
                "does not send it puts the disk cannot hold (nodes sharing a disk each count its free space)",
                format_size(self.capacity_bytes),
                self.root,
                format_size(disk.free),
                format_size(disk.total),
                format_size(self.used_bytes),
                format_size(room),
            )

    @property
    def files(self) -> int:
        """How many files this tier holds (no ``__len__``: an empty tier is still a tier)."""
        return self._count

    def __contains__(self, key: str) -> bool:
        return self._slot(key) != NO_SLOT

    def add(self, record: NvmeFile) -> bool:
        """Index a file (replacing the key's older one); False, and nothing indexed, when DRAM holds the key
        with other bytes (the file is then out of date: the caller removes it)."""
        key = record.meta.key
        self.remove(key)
        table = self.table
        slot = table.slot(key)
        if slot != NO_SLOT and not table.same_bytes(slot, record.meta):
            return False
        self._index(record)
        return True

    def _index(self, record: NvmeFile) -> None:
        """Index a file whose key this tier does not hold (and DRAM holds, if at all, with the same bytes)."""
        table = self.table
        slot = table.enter(record.meta, ON_NVME)
        if slot >= len(self._data_offset):
            self._data_offset = grown(self._data_offset, slot + 1)
        self._data_offset[slot] = record.data_offset
        if not table.where[slot] & PINNED:
            self.order.add(slot)
        self._count += 1
        self.used_bytes += record.file_bytes

    def load(self, records: Iterable[NvmeFile]) -> list[NvmeFile]:
        """Adopt files found by recovery, oldest first (so eviction order follows file age); returns those adopted.

        Cheap per record and callable many times while the node serves (recovery may hand its
        files over in batches): a key the node holds already is skipped, since what a put
        brought meanwhile is newer than any file found on disk.
        """
        adopted = []
        for record in records:
            if record.meta.key not in self.table:
                self._index(record)
                adopted.append(record)
        return adopted

    def record(self, key: str) -> NvmeFile | None:
        """The file of ``key``, if this tier holds one (without touching its recency)."""
        slot = self._slot(key)
        return self._record(slot) if slot != NO_SLOT else None

    def remove(self, key: str) -> NvmeFile | None:
        """Drop ``key``'s file from the index (the caller removes it from the disk)."""
        slot = self._slot(key)
        if slot == NO_SLOT:
            return None
        record = self._record(slot)
        self.order.remove(slot)  # pinned or not: it leaves the tier (and the chains it is in)
        self._count -= 1
        self.used_bytes -= record.file_bytes
        self.table.leave(slot, ON_NVME)
        return record

    def touch(self, key: str) -> NvmeFile | None:
        """The file of ``key``, marked as read."""
        slot = self._slot(key)
        if slot == NO_SLOT:
            return None
        if not self.table.where[slot] & PINNED:
            self.order.touch(slot)
        return self._record(slot)

    def is_current(self, record: NvmeFile) -> bool:
        """Whether ``record`` is still the file this tier holds for its key."""
        slot = self._slot(record.meta.key)
        return (
            slot != NO_SLOT
            and self.table.same_bytes(slot, record.meta)
            and self._data_offset[slot] == record.data_offset
        )

    def coldest(self) -> NvmeFile | None:
        """The first file to leave (pinned ones are in no order)."""
        return next((self._record(slot) for slot in self.order.coldest()), None)

    def report(self) -> TierReport:
        return TierReport(
            capacity_bytes=self.advertised_bytes,
            used_bytes=self.used_bytes,
            objects=self._count,
            disk_full=self.disk_full,
        )

    def _slot(self, key: str) -> int:
        slot = self.table.slot(key)
        return slot if slot != NO_SLOT and self.table.where[slot] & ON_NVME else NO_SLOT

    def _record(self, slot: int) -> NvmeFile:
        meta = self.table.meta(slot)
        shard, name = chunk_name(meta.key)
        return NvmeFile(os.path.join(self.root, CHUNKS_DIR, shard, name), meta, self._data_offset[slot])

    # -- disk I/O ---------------------------------------------------------------------
    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def read(self, record: NvmeFile, into: ChunkBuffer) -> None:
        """Read and verify a file's payload (IntegrityError / OSError when it is bad)."""
        await self.run(read_payload, record, into)

    async def unlink(self, path: str) -> None:
        await self.run(_unlink, path)

    async def write(self, chunk: StoredChunk) -> NvmeFile:
        """Write a chunk's file, dropping the coldest unpinned files for room; the caller indexes it.

        CapacityError when the chunk cannot go to disk (too large, full of leased files,
        disk full, write failed).
        """
        need = chunk.meta.nbytes + HEADER_ALLOWANCE_BYTES
        if need > self.capacity_bytes:
            raise CapacityError(f"chunk of {chunk.meta.nbytes} bytes is larger than the NVMe tier")
        if self.disk_full:
            self._disk_resume_bytes = max(self._disk_resume_bytes, _resume_bytes(need))
            raise CapacityError("NVMe tier: the disk is full; demotion is paused")
        while self.used_bytes + need > self.capacity_bytes:
            oldest = self.coldest()
            if oldest is None:
                raise CapacityError("NVMe tier is full of leased chunks")
            self.forget(oldest)
            self.counters[NodeCounter.NVME_EVICTIONS] += 1
        job = asyncio.get_running_loop().run_in_executor(self._io, write_chunk, self.root, chunk.meta, chunk.buffer)
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
                self.counters[NodeCounter.NVME_WRITE_ERRORS] += 1
                logger.warning(
                    "NVMe tier %s: writing a chunk failed (%s); it is evicted from DRAM instead",
                    self.root,
                    exc.strerror or exc,
                )
            raise CapacityError(f"NVMe write failed: {exc.strerror}") from None
        return record

    def forget(self, record: NvmeFile) -> None:
        """Drop a file from the index now and from the disk in the background."""
        if self.is_current(record):
            self.remove(record.meta.key)
        self._on_gone(record.meta.key)
        asyncio.get_running_loop().run_in_executor(self._io, _unlink, record.path)

    async def quarantine(self, record: NvmeFile, exc: BaseException) -> None:
        self.counters[NodeCounter.INTEGRITY_FAILURES] += 1
        self.counters[NodeCounter.QUARANTINED] += 1
        logger.error("NVMe tier: %s; quarantining %s", exc, os.path.basename(record.path))
        if self.is_current(record):
            self.remove(record.meta.key)
        self._on_gone(record.meta.key)
        await self.run(quarantine_file, self.root, record.path)

    # -- disk-full episodes -----------------------------------------------------------
    def _disk_full_begins(self, need: int, exc: OSError) -> None:
        """Start a disk-full episode (once: writes already in flight may fail after it began)."""
        self._disk_resume_bytes = max(self._disk_resume_bytes, _resume_bytes(need))
        if self.disk_full:
            return
        self.disk_full = True
        self._disk_full_since = time.monotonic()
        self.counters[NodeCounter.DISK_FULL] += 1
        logger.error(
            "NVMe tier %s: disk full (%s); demotion paused, DRAM evicts its least recently used chunks "
            "instead until %d bytes are free",
            self.root,
            exc.strerror,
            self._disk_resume_bytes,
        )
        self._disk_recheck = asyncio.get_running_loop().create_task(self._wait_for_disk_room())

    async def _wait_for_disk_room(self) -> None:
        """End the episode once the disk has ``_disk_resume_bytes`` free (checked every DISK_RECHECK_S)."""
        root = self.root
        while True:
            await asyncio.sleep(DISK_RECHECK_S)
            try:
                free = int(await self.run(lambda: shutil.disk_usage(root).free))
            except OSError as exc:
                logger.warning("NVMe tier %s: cannot read the free space (%s)", root, exc.strerror or exc)
                continue
            finally:
                self.counters[NodeCounter.DISK_RECHECKS] += 1
            if free >= self._disk_resume_bytes:
                break
        self.disk_full = False
        self._disk_resume_bytes = 0
        self._disk_recheck = None
        logger.warning(
            "NVMe tier %s: %d bytes free again after %.0f s; demotion resumes",
            root,
            free,
            time.monotonic() - self._disk_full_since,
        )
        self._on_room()


def _disk_usage(root: Path) -> Any:
    """``shutil.disk_usage`` of the disk that holds (or will hold, before recovery made it) ``root``."""
    existing = next((p for p in (root, *root.parents) if p.exists()), root)
    return shutil.disk_usage(existing)


def _resume_bytes(need: int) -> int:
    """Free space that ends a disk-full episode: room for a chunk of ``need`` bytes, plus a margin."""
    return need + max(need, DISK_RESUME_MARGIN_BYTES)


def _unlink_written(job: Any) -> None:
    if not job.cancelled() and job.exception() is None:
        _unlink(job.result().path)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def quarantine_file(root: Path, path: str) -> Path:
    """Move a bad file out of the chunk tree (kept for inspection, never served)."""
    target_dir = root / QUARANTINE_DIR
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / os.path.basename(path)
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, target)
    return target
