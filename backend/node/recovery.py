"""Start-up recovery of the NVMe tier: rebuild its index from file headers.

Only headers are read (a few hundred bytes per file), never payloads, so recovery
of 100,000 chunks takes seconds (``python -m bench.nvme_bench`` measures it). Payloads are
verified when they are read back. ``.tmp`` files are debris from a crash mid-write
and are deleted; files whose header is unreadable, or that sit under a name that
is not their key's, are moved to ``quarantine/`` and never served.

The node then takes a new epoch and republishes what it found (the server does
that); entries of the old epoch that pointed at DRAM read as misses.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from backend.errors import ConfigError
from backend.node.nvme_format import (
    CHUNKS_DIR,
    SUFFIX,
    TMP_SUFFIX,
    FileCodecError,
    NvmeFile,
    chunk_name,
    read_header_and_mtime,
)
from backend.node.nvme_tier import quarantine_file
from backend.protocol import RecoveryReport  # what STAT carries of a scan

__all__ = ["RecoveryReport", "scan", "stored_node_id", "keep_node_id", "NODE_ID_FILE"]

logger = logging.getLogger(__name__)

NODE_ID_FILE = "node_id"


def _scan_shard(root: Path, shard: str) -> tuple[list[tuple[float, NvmeFile]], int, int]:
    found: list[tuple[float, NvmeFile]] = []
    quarantined = removed = 0
    shard_name = os.path.basename(shard)
    with os.scandir(shard) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                os.unlink(entry.path)
                removed += 1
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                record, mtime = read_header_and_mtime(entry.path)
                if chunk_name(record.meta.key) != (shard_name, name):
                    raise FileCodecError(f"holds {record.meta.key!r}, which belongs elsewhere")
            except FileCodecError as exc:
                logger.error("NVMe recovery: quarantining %s: %s", name, exc)
                quarantine_file(root, entry.path)
                quarantined += 1
                continue
            found.append((mtime, record))
    return found, quarantined, removed


def scan(root: Path) -> tuple[list[NvmeFile], RecoveryReport]:
    """Every intact chunk file under ``root``, least recently written first."""
    start = time.perf_counter()
    quarantined = temp_removed = 0
    chunks = root / CHUNKS_DIR
    shards = sorted(e.path for e in os.scandir(chunks) if e.is_dir()) if chunks.is_dir() else []
    found: list[tuple[float, NvmeFile]] = []
    # One thread (the caller's): header parsing holds the GIL, and on a warm cache more
    # scan threads measured slower (bench.nvme_bench).
    for shard in shards:
        shard_found, shard_quarantined, removed = _scan_shard(root, shard)
        found.extend(shard_found)
        quarantined += shard_quarantined
        temp_removed += removed
    found.sort(key=lambda pair: pair[0])
    records = [record for _, record in found]
    report = RecoveryReport(
        files=len(records),
        bytes=sum(r.file_bytes for r in records),
        quarantined=quarantined,
        temp_removed=temp_removed,
        seconds=time.perf_counter() - start,
    )
    return records, report


def stored_node_id(root: Path) -> str:
    """The node id kept in ``root/node_id`` ("" if none). Reads only: the id is claimed before the
    directory is touched (``backend.node.claim``), since another process may be using it."""
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
    if stored and stored != node_id:
        logger.warning("NVMe dir %s belonged to node %s; it now belongs to %s", root, stored, node_id)
    if stored != node_id:
        path.write_text(node_id + "\n")
