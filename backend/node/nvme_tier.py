"""The NVMe tier as the tier manager sees it: which files exist (LRU), and every disk I/O on them.

The file format and its crash ordering are in ``nvme_format.py``; this module keeps the
index of files this node holds, least recently used first, with the bytes they take,
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
from collections import Counter, OrderedDict
from collections.abc import Callable, Container
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from backend.config.values import format_size
from backend.errors import CapacityError
from backend.node.bookkeeping import ON_NVME, HeldKeys
from backend.node.buffers import ChunkBuffer
from backend.node.dram import StoredChunk
from backend.node.nvme_format import NvmeFile, read_payload, write_chunk
from backend.protocol import TierReport

__all__ = ["NvmeTier", "quarantine_file", "QUARANTINE_DIR", "DISK_RECHECK_S", "DISK_RESUME_MARGIN_BYTES"]

logger = logging.getLogger(__name__)

HEADER_ALLOWANCE_BYTES = 4096  # room reserved on disk for a file's header
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
DISK_RECHECK_S = 2.0  # how often a full disk is looked at again
DISK_RESUME_MARGIN_BYTES = 1024 * 1024  # free space past one chunk before demotion resumes
QUARANTINE_DIR = "quarantine"


class NvmeTier:
    """The files of one NVMe tier, least recently used first. Use from the node's event loop only."""

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        *,
        io_threads: int,
        counters: Counter[str],
        held: HeldKeys,
        on_gone: Callable[[str], None],
        on_room: Callable[[], None],
    ) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.files: OrderedDict[str, NvmeFile] = OrderedDict()
        self.used_bytes = 0
        self.counters = counters
        self.disk_full = False
        self._held = held
        self._on_gone = on_gone
        self._on_room = on_room
        self._disk_resume_bytes = 0  # free bytes that end the current disk-full episode
        self._disk_full_since = 0.0
        self._disk_recheck: asyncio.Task[None] | None = None
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvpool-nvme")

    async def close(self) -> None:
        if self._disk_recheck is not None:
            self._disk_recheck.cancel()
            await asyncio.gather(self._disk_recheck, return_exceptions=True)
        self._io.shutdown(wait=True, cancel_futures=True)

    # -- the index --------------------------------------------------------------------
    def warn_if_larger_than_disk(self) -> None:
        """Say at start when the configured size is more than the disk can give (free space plus
        this tier's files): the tier works, but fills the disk before it reaches its size."""
        disk = shutil.disk_usage(self.root)
        room = disk.free + self.used_bytes
        if self.capacity_bytes > room:
            logger.warning(
                "nvme: --nvme %s is more than the disk holding %s can give (%s free, %s total, %s of it "
                "this tier's files); the tier will stop at a full disk, not at its size",
                format_size(self.capacity_bytes),
                self.root,
                format_size(disk.free),
                format_size(disk.total),
                format_size(self.used_bytes),
            )

    def add(self, record: NvmeFile) -> None:
        self.remove(record.meta.key)
        self.files[record.meta.key] = record
        self.used_bytes += record.file_bytes
        self._held.add(record.meta.key, ON_NVME)

    def remove(self, key: str) -> NvmeFile | None:
        record = self.files.pop(key, None)
        if record is not None:
            self.used_bytes -= record.file_bytes
            self._held.remove(key, ON_NVME)
        return record

    def touch(self, key: str) -> NvmeFile | None:
        record = self.files.get(key)
        if record is not None:
            self.files.move_to_end(key)
        return record

    def report(self) -> TierReport:
        return TierReport(
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes,
            objects=len(self.files),
            disk_full=self.disk_full,
        )

    # -- disk I/O ---------------------------------------------------------------------
    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def read(self, record: NvmeFile, into: ChunkBuffer) -> None:
        """Read and verify a file's payload (IntegrityError / OSError when it is bad)."""
        await self.run(read_payload, record, into)

    async def unlink(self, path: str) -> None:
        await self.run(_unlink, path)

    async def write(self, chunk: StoredChunk, pinned: Container[str]) -> NvmeFile:
        """Write a chunk's file, dropping unpinned LRU files for room; the caller indexes it.

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
            oldest = next((r for k, r in self.files.items() if k not in pinned), None)
            if oldest is None:
                raise CapacityError("NVMe tier is full of leased chunks")
            self.forget(oldest)
            self.counters["nvme_evictions"] += 1
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
                self.counters["nvme_write_errors"] += 1
                logger.warning(
                    "NVMe tier %s: writing a chunk failed (%s); it is evicted from DRAM instead",
                    self.root,
                    exc.strerror or exc,
                )
            raise CapacityError(f"NVMe write failed: {exc.strerror}") from None
        return record

    def forget(self, record: NvmeFile) -> None:
        """Drop a file from the index now and from the disk in the background."""
        if self.files.get(record.meta.key) is record:
            self.remove(record.meta.key)
        self._on_gone(record.meta.key)
        asyncio.get_running_loop().run_in_executor(self._io, _unlink, record.path)

    async def quarantine(self, record: NvmeFile, exc: BaseException) -> None:
        self.counters["integrity_failures"] += 1
        self.counters["quarantined"] += 1
        logger.error("NVMe tier: %s; quarantining %s", exc, os.path.basename(record.path))
        if self.files.get(record.meta.key) is record:
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
        self.counters["disk_full"] += 1
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
