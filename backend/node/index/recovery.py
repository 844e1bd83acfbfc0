"""Start-up recovery of the NVMe tier: rebuild its index from file headers, in the background.

Only headers are read (a few hundred bytes per file), never payloads; payloads are
verified when they are read back. ``.tmp`` files are debris from a crash mid-write
and are deleted; files whose header is unreadable, or that sit under a name that is
not their key's, are moved to ``quarantine/`` and never served.

A node with a million chunk files must serve within seconds of its start, so recovery
does not hold the start up (``NvmeRecovery``): the node claims its id, takes its arena,
starts recovery and joins the pool; recovery then scans one of the 256 shard directories
at a time on a worker thread (the next one while the last one's chunks are adopted),
hands each shard's files to the tiers, oldest first, and writes their index entries under
the node's new epoch. A key becomes a hit once its shard is done; until then it reads
as a miss (the old epoch's entries are not live). Meanwhile the node serves and takes
puts, and what this run does is newer than any file found:

* a file whose mtime is not older than the node's start was written by this run: the
  scan leaves it (and a ``.tmp`` file of this run) alone, the tier knows it already;
* a key this run stored or deleted since recovery began is not adopted from an older
  file (``StoreUpkeep.load_nvme``); that older file is removed, unless this run wrote
  the key's file since;
* a shard's index entries are checked once written, so a key deleted, stored anew or
  moved meanwhile is not left behind wrongly (``republish.publish_held``).

LRU order after a restart follows file age within each shard directory. Progress is
STAT's ``recovery`` (files adopted, indexed, fraction of shard directories scanned,
done), the ``recovery_*`` gauges, a log line every tenth, and a bar on a terminal
(``backend/cli/serve.py``). Entries of the old epoch that pointed at DRAM read as misses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

from backend.errors import ConfigError, MetadataError
from backend.node.context import NodeContext
from backend.node.index.republish import publish_held
from backend.node.stats import NodeStats
from backend.node.store.bookkeeping import NVME
from backend.node.store.nvme_format import (
    CHUNKS_DIR,
    SUFFIX,
    TMP_SUFFIX,
    FileCodecError,
    NvmeFile,
    chunk_name,
    read_header_and_mtime,
)
from backend.node.store.nvme_tier import quarantine_file
from backend.protocol import ItemMeta
from backend.protocol.reports import RecoveryReport

__all__ = ["RecoveryReport", "NvmeRecovery", "ShardScan", "scan", "scan_shard", "shard_dirs"]
__all__ += ["stored_node_id", "keep_node_id", "NODE_ID_FILE"]

logger = logging.getLogger(__name__)

NODE_ID_FILE = "node_id"
PROGRESS_STEPS = 10  # a log line at every tenth of the shard directories


@dataclasses.dataclass
class ShardScan:
    """What one shard directory holds: its intact files older than the scan's cut-off with their mtimes, least
    recently written first, and what the scan set aside."""

    found: list[tuple[float, NvmeFile]] = dataclasses.field(default_factory=list)
    quarantined: int = 0
    temp_removed: int = 0

    @property
    def records(self) -> list[NvmeFile]:
        return [record for _, record in self.found]


def scan_shard(root: Path, shard: str, written_before: float = float("inf")) -> ShardScan:
    """Scan one shard directory (blocking: run it on a worker thread). Files and ``.tmp`` files whose mtime is
    not before ``written_before`` belong to the running node and are left alone."""
    out = ShardScan()
    found = out.found
    shard_name = os.path.basename(shard)
    with os.scandir(shard) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    if entry.stat().st_mtime < written_before:
                        os.unlink(entry.path)
                        out.temp_removed += 1
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                record, mtime = read_header_and_mtime(entry.path)
                if chunk_name(record.meta.key) != (shard_name, name):
                    raise FileCodecError(f"holds {record.meta.key!r}, which belongs elsewhere")
            except FileCodecError as exc:
                if not os.path.lexists(entry.path):
                    continue  # removed by the running node since the directory was listed
                logger.error("NVMe recovery: quarantining %s: %s", name, exc)
                quarantine_file(root, entry.path)
                out.quarantined += 1
                continue
            if mtime < written_before:
                found.append((mtime, record))
    found.sort(key=lambda pair: pair[0])
    return out


def shard_dirs(root: Path) -> list[str]:
    """The shard directories under ``root/chunks``, in name order."""
    chunks = root / CHUNKS_DIR
    return sorted(e.path for e in os.scandir(chunks) if e.is_dir()) if chunks.is_dir() else []


def scan(root: Path) -> tuple[list[NvmeFile], RecoveryReport]:
    """Every intact chunk file under ``root``, least recently written first (all at once: tests and benches)."""
    start = time.perf_counter()
    found: list[tuple[float, NvmeFile]] = []
    quarantined = temp_removed = 0
    for shard in shard_dirs(root):
        shard_scan = scan_shard(root, shard)
        found.extend(shard_scan.found)
        quarantined += shard_scan.quarantined
        temp_removed += shard_scan.temp_removed
    found.sort(key=lambda pair: pair[0])
    records = [record for _, record in found]
    report = RecoveryReport(
        files=len(records),
        bytes=sum(r.file_bytes for r in records),
        quarantined=quarantined,
        temp_removed=temp_removed,
        seconds=time.perf_counter() - start,
        indexed=0,  # nothing is published here
    )
    return records, report


class NvmeRecovery:
    """The NVMe tier's files adopted and indexed in the background while the node serves, a shard at a time."""

    def __init__(self, ctx: NodeContext, stats: NodeStats, root: Path, written_before: float) -> None:
        self.ctx = ctx
        self.stats = stats
        self.root = root
        self.written_before = written_before  # wall time the node started: later files are this run's
        self._began = time.perf_counter()
        self._report = RecoveryReport(progress=0.0, done=False)
        self._said = 0
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin: from now on the tiers remember the keys this run stores or deletes (they win over files)."""
        self.ctx.tiers.upkeep.begin_recovery()
        self.stats.recovery = self._report
        self.task = self.ctx.spawn(self.run())

    async def run(self) -> None:
        try:
            shards = await asyncio.to_thread(shard_dirs, self.root)
            scanning = self._scan(shards[0]) if shards else None
            for i in range(len(shards)):
                assert scanning is not None
                found = await scanning
                scanning = self._scan(shards[i + 1]) if i + 1 < len(shards) else None  # read ahead meanwhile
                await self._adopt(found, (i + 1) / len(shards))
            await asyncio.to_thread(self._nvme_warn_if_larger_than_disk)
        except OSError as exc:
            logger.error(
                "node %s: NVMe recovery stopped: %s; the %d chunks adopted so far are served, files not yet "
                "scanned are not (until a restart)",
                self.ctx.node_id,
                exc,
                self._report.files,
            )
            return
        finally:
            self.ctx.tiers.upkeep.end_recovery()
        self._update(dataclasses.replace(self._report, progress=1.0, done=True))
        report = self._report
        logger.info(
            "node %s: recovered %d NVMe chunks (%d bytes) in %.2f s, all indexed; %d quarantined, "
            "%d temp files removed",
            self.ctx.node_id,
            report.files,
            report.bytes,
            report.seconds,
            report.quarantined,
            report.temp_removed,
        )

    def _scan(self, shard: str) -> asyncio.Future[ShardScan]:
        return asyncio.ensure_future(asyncio.to_thread(scan_shard, self.root, shard, self.written_before))

    async def _adopt(self, found: ShardScan, progress: float) -> None:
        """Hand one shard's files to the tiers, publish them, and remove those this run made obsolete."""
        records = found.records
        adopted = self.ctx.tiers.upkeep.load_nvme(records)
        if len(adopted) < len(records):
            kept = {id(record) for record in adopted}
            older = [r.path for r in records if id(r) not in kept]
            await asyncio.to_thread(_remove_older, older, self.written_before)
        report = self._report
        self._update(
            dataclasses.replace(
                report,
                files=report.files + len(adopted),
                bytes=report.bytes + sum(r.file_bytes for r in adopted),
                quarantined=report.quarantined + found.quarantined,
                temp_removed=report.temp_removed + found.temp_removed,
                progress=progress,
            )
        )
        await self._publish([(record.meta, NVME) for record in adopted])
        self._update(dataclasses.replace(self._report, indexed=self._report.indexed + len(adopted)))
        self._say_progress(progress)

    async def _publish(self, held: list[tuple[ItemMeta, str]]) -> None:
        """Write a shard's index entries, trying again while Redis does not take them (a loss of the index
        meanwhile is the heartbeat's to notice: its republish covers what was adopted)."""
        retry_s = self.ctx.config.heartbeat_interval_s
        said = False
        while True:
            try:
                await publish_held(self.ctx, held)
                return
            except MetadataError as exc:
                if not said:
                    said = True
                    logger.warning(
                        "node %s: NVMe recovery: Redis did not take the index entries of a shard (%s); trying "
                        "again every %.1f s (those chunks read as misses meanwhile)",
                        self.ctx.node_id,
                        exc,
                        retry_s,
                    )
                await asyncio.sleep(retry_s)

    def _update(self, report: RecoveryReport) -> None:
        """What STAT says of recovery from now on (its time taken brought up to date)."""
        self._report = dataclasses.replace(report, seconds=round(time.perf_counter() - self._began, 3))
        self.stats.recovery = self._report

    def _say_progress(self, progress: float) -> None:
        tenths = int(progress * PROGRESS_STEPS)
        if PROGRESS_STEPS > tenths > self._said:
            self._said = tenths
            logger.info(
                "node %s: NVMe recovery %d %%: %d chunks adopted and indexed in %.1f s",
                self.ctx.node_id,
                100 * tenths // PROGRESS_STEPS,
                self._report.indexed,
                self._report.seconds,
            )

    def _nvme_warn_if_larger_than_disk(self) -> None:
        self.ctx.tiers.upkeep.warn_if_nvme_larger_than_disk()


def _remove_older(paths: list[str], written_before: float) -> None:
    """Remove files recovery did not adopt (this run stored or deleted their key since), unless this run has
    written the key's file since: its mtime is then not before ``written_before``."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_mtime < written_before:
                os.unlink(path)


def stored_node_id(root: Path) -> str:
    """The node id kept in ``root/node_id`` ("" if none). Reads only: the id is claimed before the
    directory is touched (``backend.node.index.claim``), since another process may be using it."""
    path = root / NODE_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--nvme-dir", f"cannot read the node id kept in {path}: {exc}") from None


def keep_node_id(root: Path, node_id: str) -> None:
    """Keep ``node_id`` in ``root/node_id`` (once it is claimed), so a restarted node owns its files again."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / NODE_ID_FILE
    stored = stored_node_id(root)
    if stored != node_id and stored:
        logger.warning("NVMe dir %s belonged to node %s; it now belongs to %s", root, stored, node_id)
    if stored != node_id:
        path.write_text(node_id + "\n")
