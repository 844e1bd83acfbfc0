"""A node of many chunks: republish after a FLUSHALL, restart over many NVMe files, files beside segments.

    python -m bench.scale.nvme                        # a small run: 20,000 chunks
    python -m bench.scale.nvme --chunks 1000000       # the scale of issue #34
    python -m bench.scale.nvme --only restart --chunks 1000000

Each figure is printed beside its target. Three measurements, each a function returning a dict
(``python -m bench.scale.pool`` composes them):

* :func:`republish`: a ``kvpool node`` process (DRAM only, the default 5 s heartbeat TTL) filled
  with N tiny chunks through the real put path (8-byte values, 2,000 per put), then FLUSHALL:
  seconds until 99 % of a 1,000-key sample hits byte-identical again, until the republish is over
  (STAT), the longest the node's heartbeat key went without a beat (its PTTL read every 10 ms)
  and whether it was ever missing; then a flush, another once a third of the sample hits again
  (mid-republish), and the same figures after that second one.
* :func:`restart`: N chunk files written straight into an NVMe directory as an earlier run of the
  node leaves them (16-byte payloads, without fsync, to save time; Redis holds nothing of them),
  then ``kvpool node`` on it: seconds from the spawn to ready, to the first hit of a 1,000-key
  sample, and to every file indexed (STAT's recovery done). The page cache is warm (the files
  were just written) unless ``--cold`` (drops it: root only, and the whole machine's).
* :func:`files_vs_segments`: N chunks as one file each (the node's format, ``nvme_format``)
  beside packed segment files (a prototype here, not in the node: each record the very bytes of a
  chunk file, appended to 64 MiB segments): put rate without fsync over N and with one per chunk
  over min(N, 2,000), seconds to scan them all at start (headers only), disk used per chunk
  beyond its payload, and files made.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from backend.embedded import EmbeddedRedis
from backend.launch.nodes import NodeProcess
from backend.node.index.recovery import scan
from backend.node.store.nvme_format import CHUNKS_DIR, chunk_name, header_bytes, write_chunk
from backend.protocol import ItemMeta, checksum
from bench.paths import REPO, RESULTS
from kvpool import Chunk, KVPoolError, PoolConfig, SyncPoolClient

__all__ = ["republish", "restart", "files_vs_segments", "run", "TARGETS", "chunk_key", "payload_of", "write_files"]

NAMESPACE = "scale"
SAMPLE = 1000
PUT_BATCH = 2000
FILL_TIMEOUT_S = 10.0  # the fill's puts may wait for a busy Redis: the put commits as in a pool under load
HEARTBEAT_TTL_S = 5.0  # the node's default heartbeat_ttl_s
NODE_START_TIMEOUT_S = 120.0
SEGMENT_BYTES = 64 * 1024 * 1024
FSYNC_SAMPLE = 2000
TARGETS = {
    "republish_sample_99_s": 60.0,  # >= 99 % of a 1,000-key sample hits within 60 s of the flush
    "heartbeat_longest_gap_s": HEARTBEAT_TTL_S,  # the node never shows dead
    "restart_first_hit_s": 10.0,
    "restart_all_indexed_s": 120.0,
}


def _node_env() -> dict[str, str]:
    return {**os.environ, "LMCACHE_TRACK_USAGE": "false", "KVPOOL_PREFAULT": "off"}


def chunk_key(i: int) -> str:
    """An LMCache-style key (model, world size, worker, chunk hash, dtype)."""
    return f"vllm@/models/Llama-3.1-8B@1@0@{i:016x}{i * 2654435761 % (1 << 64):016x}@bfloat16"


class BeatMonitor(threading.Thread):
    """Reads a node's heartbeat key's PTTL every 10 ms: the longest it went without a beat, and how often it
    was missing, while armed (from the first beat after a flush)."""

    def __init__(self, port: int, key: str) -> None:
        super().__init__(daemon=True)
        self.redis = redis.Redis(port=port)
        self.key = key
        self.armed = False
        self.longest_gap_s = 0.0
        self.missing = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            left_ms = int(self.redis.pttl(self.key))
            if self.armed:
                if left_ms < 0:
                    self.missing += 1
                else:
                    self.longest_gap_s = max(self.longest_gap_s, HEARTBEAT_TTL_S - left_ms / 1000)
            self._halt.wait(0.01)

    def flush(self) -> float:
        """FLUSHALL now; armed again (its figures reset) once the node's next beat landed. The flush's time."""
        self.armed = False
        self.redis.flushall()
        flushed_at = time.monotonic()
        while self.redis.pttl(self.key) < 0:
            time.sleep(0.005)
        self.longest_gap_s, self.missing, self.armed = 0.0, 0, True
        return flushed_at

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(5)
        self.redis.close()


def _sample_hits(client: SyncPoolClient, sample: dict[str, bytes]) -> int:
    """How many of ``sample`` read back byte-identical (a wrong byte or an error is a failure of the run)."""
    got = client.get(list(sample))
    for key, fetched in zip(sample, got, strict=True):
        if fetched is not None and bytes(fetched.data) != sample[key]:
            raise AssertionError(f"{key} read back other bytes")
    return sum(fetched is not None for fetched in got)


def _wait(what: str, predicate: Any, timeout_s: float, interval_s: float = 0.1) -> float:
    """Poll ``predicate`` until true; the monotonic time it first was (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def _republish_running(client: SyncPoolClient) -> bool:
    report = client.node_stats(client.nodes()[0]).get("republish") or {}
    return bool(report.get("running"))


def republish(chunks: int, sample_size: int = SAMPLE) -> dict[str, Any]:
    """Fill a node with ``chunks`` tiny chunks, FLUSHALL, and time its way back (see the module docstring)."""
    with EmbeddedRedis() as server:
        args = ["--redis", server.url, "--namespace", NAMESPACE, "--dram", "1GiB", "--shm-dir", "off"]
        node = NodeProcess(args, _node_env()).start(NODE_START_TIMEOUT_S)
        monitor = BeatMonitor(server.port, f"kvp:{{{NAMESPACE}}}:hb:{node.node_id}")
        try:
            url = f"kvpool://127.0.0.1:{server.port}/{NAMESPACE}?connect_timeout_s={FILL_TIMEOUT_S}&progress_timeout_s={FILL_TIMEOUT_S}"
            with SyncPoolClient(PoolConfig.from_url(url)) as client:
                began = time.monotonic()
                for start in range(0, chunks, PUT_BATCH):
                    client.put(
                        [
                            Chunk(chunk_key(i), i.to_bytes(8, "little"))
                            for i in range(start, min(chunks, start + PUT_BATCH))
                        ]
                    )
                fill_s = time.monotonic() - began
                rss = node.memory().get("VmRSS", 0)
                picked = random.Random(0).sample(range(chunks), min(sample_size, chunks))
                sample = {chunk_key(i): i.to_bytes(8, "little") for i in picked}
                monitor.start()
                first = _after_flush(client, monitor, sample)
                monitor.flush()  # a flush, then another mid-republish: the walk resumes
                _wait(
                    "a third of the sample hits again",
                    lambda: _sample_hits(client, sample) >= len(sample) // 3,
                    120.0,
                    0.05,
                )
                second = _after_flush(client, monitor, sample)
        finally:
            monitor.stop()
            node.kill()
    return {
        "chunks": chunks,
        "fill_per_s": chunks / fill_s,
        "node_rss_bytes": rss,
        "after_flush": first,
        "after_second_flush_mid_republish": second,
        "log": [line for line in node.output if "republish" in line][-8:],
    }


def _after_flush(client: SyncPoolClient, monitor: BeatMonitor, sample: dict[str, bytes]) -> dict[str, Any]:
    flushed_at = monitor.flush()
    hit_99 = _wait("99 % of the sample hits", lambda: _sample_hits(client, sample) >= 0.99 * len(sample), 600.0)
    done = _wait("the republish ends", lambda: not _republish_running(client), 600.0)
    all_hit = _sample_hits(client, sample) == len(sample)
    return {
        "sample_99_s": hit_99 - flushed_at,
        "republish_s": done - flushed_at,
        "sample_all_hit": all_hit,
        "heartbeat_longest_gap_s": monitor.longest_gap_s,
        "heartbeat_missing_polls": monitor.missing,
    }


def payload_of(i: int, payload_bytes: int) -> bytes:
    """The payload :func:`write_files` gives chunk ``i``."""
    return (i.to_bytes(8, "little") * (payload_bytes // 8 + 1))[:payload_bytes]


def write_chunk_files(root: Path, start: int, stop: int, payload_bytes: int) -> None:
    """Chunk files for keys ``start..stop`` as the node writes them, but without fsync (fixtures)."""
    made: set[str] = set()
    for i in range(start, stop):
        key = chunk_key(i)
        payload = payload_of(i, payload_bytes)
        meta = ItemMeta(key, len(payload), checksum(payload), "uint8", (len(payload),), 0)
        shard, name = chunk_name(key)
        folder = root / CHUNKS_DIR / shard
        if shard not in made:
            folder.mkdir(parents=True, exist_ok=True)
            made.add(shard)
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, header_bytes(meta) + payload)
        finally:
            os.close(fd)


def write_files(root: Path, chunks: int, payload_bytes: int) -> float:
    """Write the files of chunks ``0..chunks`` (keys :func:`chunk_key`, payloads :func:`payload_of`) as the node
    writes them, without fsync, one process per core; seconds taken."""
    began = time.monotonic()
    workers = max(1, os.cpu_count() or 1)
    step = -(-chunks // workers)
    script = (
        "import sys; from pathlib import Path; from bench.scale.nvme import write_chunk_files as w; "
        "w(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(root), str(s), str(min(chunks, s + step)), str(payload_bytes)],
            cwd=REPO,
        )
        for s in range(0, chunks, step)
    ]
    if any(p.wait() != 0 for p in procs):
        raise RuntimeError("writing the chunk files failed")
    return time.monotonic() - began


def _drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def restart(chunks: int, base: Path, sample_size: int = SAMPLE, cold: bool = False) -> dict[str, Any]:
    """Start a node over ``chunks`` NVMe files and time it to ready, first hit and all indexed."""
    root = base / "restart-nvme"
    payload_bytes = 16
    write_s = write_files(root, chunks, payload_bytes)
    (root / "node_id").write_text("scale-restart\n")
    dropped = _drop_page_cache() if cold else False
    picked = random.Random(0).sample(range(chunks), min(sample_size, chunks))
    sample = {chunk_key(i): payload_of(i, payload_bytes) for i in picked}
    with EmbeddedRedis() as server:
        args = ["--redis", server.url, "--namespace", NAMESPACE, "--dram", "256MiB", "--shm-dir", "off"]
        args += ["--nvme-dir", str(root), "--nvme", "64GiB"]
        spawned = time.monotonic()
        node = NodeProcess(args, _node_env()).spawn()
        try:
            node.wait_ready(NODE_START_TIMEOUT_S)
            ready = time.monotonic()
            with SyncPoolClient(PoolConfig.from_url(f"kvpool://127.0.0.1:{server.port}/{NAMESPACE}")) as client:
                first_hit = _wait("a first hit", lambda: _sample_hits(client, sample) > 0, 600.0, 0.02)
                indexed = _wait("every file indexed", lambda: _recovery_done(client), 900.0, 0.1)
                all_hit = _sample_hits(client, sample) == len(sample)
                report = client.node_stats(client.nodes()[0])["recovery"]
            rss = node.memory().get("VmRSS", 0)
        finally:
            node.kill()
    return {
        "chunks": chunks,
        "write_files_s": write_s,
        "page_cache": "dropped" if dropped else "warm",
        "ready_s": ready - spawned,
        "first_hit_s": first_hit - spawned,
        "all_indexed_s": indexed - spawned,
        "sample_all_hit": all_hit,
        "recovered_files": report["files"],
        "node_rss_bytes": rss,
    }


def _recovery_done(client: SyncPoolClient) -> bool:
    try:
        report = client.node_stats(client.nodes()[0]).get("recovery") or {}
    except (KVPoolError, IndexError):
        return False
    return bool(report.get("done"))


class SegmentLog:
    """A prototype of packed segment files: records appended to ``SEGMENT_BYTES`` segments, each record the very
    bytes of a chunk file (safetensors header and payload); a newer segment's record of a key wins."""

    def __init__(self, root: Path, *, durable: bool, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.root = root
        self.durable = durable
        self.segment_bytes = segment_bytes
        root.mkdir(parents=True, exist_ok=True)
        self._number = 0
        self._fd = -1
        self._size = 0
        self._open_next()

    def _open_next(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._number += 1
        self._fd = os.open(self.root / f"{self._number:08d}.seg", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = 0
        if self.durable:
            _fsync_dir(self.root)

    def append(self, meta: ItemMeta, payload: bytes) -> tuple[int, int]:
        """Append one chunk; (segment number, offset of its record)."""
        record = header_bytes(meta) + payload
        if self._size + len(record) > self.segment_bytes:
            self._open_next()
        at = self._size
        os.write(self._fd, record)
        if self.durable:
            os.fdatasync(self._fd)
        self._size += len(record)
        return self._number, at

    def close(self) -> None:
        os.close(self._fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scan_segments(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every key's (segment, offset, nbytes), reading headers only (a seek over each payload)."""
    index: dict[str, tuple[int, int, int]] = {}
    for path in sorted(root.glob("*.seg")):
        number = int(path.stem)
        with open(path, "rb") as f:
            at = 0
            while head := f.read(8):
                n = int.from_bytes(head, "little")
                header = json.loads(f.read(n))
                info = header["__metadata__"]
                nbytes = int(info["nbytes"])
                index[str(info["key"])] = (number, at, nbytes)
                f.seek(nbytes, os.SEEK_CUR)
                at += 8 + n + nbytes
    return index


def _disk_bytes(root: Path) -> tuple[int, int]:
    """(bytes of disk blocks, files and directories) under ``root``."""
    used = made = 0
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            st = os.lstat(os.path.join(folder, name))
            used += st.st_blocks * 512
            made += 1
    return used, made


def files_vs_segments(
    chunks: int, base: Path, payload_bytes: int = 16, fsync_chunks: int = FSYNC_SAMPLE
) -> dict[str, Any]:
    """Put rate (without fsync over ``chunks``, with one per chunk over ``fsync_chunks``), start (scan) time and
    disk overhead of one file per chunk beside packed segments."""
    metas = [
        (ItemMeta(chunk_key(i), payload_bytes, 0, "uint8", (payload_bytes,), 0), payload_of(i, payload_bytes))
        for i in range(chunks)
    ]
    out: dict[str, Any] = {"chunks": chunks, "payload_bytes": payload_bytes}
    for kind in ("files", "segments"):
        root = base / kind
        began = time.monotonic()
        if kind == "files":
            for meta, payload in metas:
                write_chunk(root, meta, payload, durable=False)
        else:
            log = SegmentLog(root, durable=False)
            for meta, payload in metas:
                log.append(meta, payload)
            log.close()
        put_s = time.monotonic() - began
        began = time.monotonic()
        found = len(scan(root)[0]) if kind == "files" else len(scan_segments(root))
        scan_s = time.monotonic() - began
        assert found == chunks, (kind, found)
        used, made = _disk_bytes(root)
        durable_root = base / f"{kind}-fsync"
        durable_n = min(chunks, fsync_chunks)
        began = time.monotonic()
        if kind == "files":
            for meta, payload in metas[:durable_n]:
                write_chunk(durable_root, meta, payload, durable=True)
        else:
            log = SegmentLog(durable_root, durable=True)
            for meta, payload in metas[:durable_n]:
                log.append(meta, payload)
            log.close()
        durable_s = time.monotonic() - began
        out[kind] = {
            "put_per_s": chunks / put_s,
            "put_fsync_per_s": durable_n / durable_s,
            "scan_s": scan_s,
            "scan_per_s": chunks / scan_s,
            "disk_bytes_per_chunk": used / chunks,
            "disk_overhead_bytes_per_chunk": used / chunks - payload_bytes,
            "files_made": made,
        }
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(durable_root, ignore_errors=True)
    return out


@contextlib.contextmanager
def _workdir(where: Path | None) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="kvpool-scale-nvme-", dir=where))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(
    chunks: int,
    only: str = "",
    where: Path | None = None,
    cold: bool = False,
    payload_bytes: int = 16,
    fsync_chunks: int = FSYNC_SAMPLE,
) -> dict[str, Any]:
    """Every measurement (or ``only`` one) at ``chunks``; the figures with the targets. ``payload_bytes`` and
    ``fsync_chunks``: the disk measurement's chunk size and how many chunks it writes with fsync."""
    result: dict[str, Any] = {"chunks": chunks, "targets": TARGETS, "load": os.getloadavg()}
    with _workdir(where) as base:
        if only in ("", "republish"):
            result["republish"] = republish(chunks)
        if only in ("", "restart"):
            result["restart"] = restart(chunks, base, cold=cold)
        if only in ("", "disk"):
            result["disk"] = files_vs_segments(chunks, base, payload_bytes, fsync_chunks)
    return result


def _print(result: dict[str, Any]) -> None:
    mark = lambda ok: "ok" if ok else "MISSED"  # noqa: E731
    print(f"load average at the start: {', '.join(f'{x:.2f}' for x in result['load'])}")
    if "republish" in result:
        r = result["republish"]
        print(
            f"\nrepublish after FLUSHALL: a node process holding {r['chunks']:,} chunks (8-byte values put through "
            f"the client, {r['fill_per_s']:,.0f} chunks/s; node RSS {r['node_rss_bytes'] / 2**20:,.0f} MiB)"
        )
        for label, figures in (
            ("flush", r["after_flush"]),
            ("second flush, mid-republish", r["after_second_flush_mid_republish"]),
        ):
            ok_99 = figures["sample_99_s"] <= TARGETS["republish_sample_99_s"]
            ok_beat = figures["heartbeat_missing_polls"] == 0 and figures["heartbeat_longest_gap_s"] < HEARTBEAT_TTL_S
            print(
                f"  after the {label}: 99 % of a {SAMPLE}-key sample hit byte-identical in "
                f"{figures['sample_99_s']:.1f} s (target <= 60 s: {mark(ok_99)}); republish over in "
                f"{figures['republish_s']:.1f} s; whole sample hits: {figures['sample_all_hit']}"
            )
            print(
                f"    heartbeat: longest without a beat {figures['heartbeat_longest_gap_s']:.2f} s, key missing in "
                f"{figures['heartbeat_missing_polls']} polls (target: never lapsed, TTL 5 s: {mark(ok_beat)})"
            )
    if "restart" in result:
        r = result["restart"]
        print(
            f"\nrestart over {r['chunks']:,} NVMe chunk files (16-byte payloads, written without fsync in "
            f"{r['write_files_s']:.0f} s; page cache {r['page_cache']}):"
        )
        print(f"  ready {r['ready_s']:.1f} s after the spawn")
        print(f"  first hit {r['first_hit_s']:.1f} s (target <= 10 s: {mark(r['first_hit_s'] <= 10)})")
        print(
            f"  all {r['recovered_files']:,} indexed {r['all_indexed_s']:.1f} s (target <= 120 s: "
            f"{mark(r['all_indexed_s'] <= 120)}); whole sample hits: {r['sample_all_hit']}; "
            f"node RSS {r['node_rss_bytes'] / 2**20:,.0f} MiB"
        )
    if "disk" in result:
        d = result["disk"]
        print(f"\n{d['chunks']:,} chunks of {d['payload_bytes']:,} bytes on disk: one file each beside packed segments")
        print(f"{'':12}{'put/s':>12}{'put/s fsync':>13}{'scan s':>9}{'scan/s':>11}{'disk B/chunk':>14}{'files':>10}")
        for kind in ("files", "segments"):
            k = d[kind]
            print(
                f"{kind:<12}{k['put_per_s']:>12,.0f}{k['put_fsync_per_s']:>13,.0f}{k['scan_s']:>9.1f}"
                f"{k['scan_per_s']:>11,.0f}{k['disk_overhead_bytes_per_chunk']:>14,.0f}{k['files_made']:>10,}"
            )
        print("(disk B/chunk: disk blocks used per chunk beyond its payload; fsync: one chunk at a time)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=20_000)
    parser.add_argument("--only", choices=("republish", "restart", "disk"), default="")
    parser.add_argument("--dir", type=Path, default=None, help="where the NVMe files go (default: a temp dir)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before the restart (root)")
    parser.add_argument("--payload", type=int, default=16, help="bytes per chunk of the disk measurement")
    parser.add_argument("--fsync-chunks", type=int, default=FSYNC_SAMPLE, help="chunks it writes with fsync")
    args = parser.parse_args()
    result = run(args.chunks, args.only, args.dir, args.cold, args.payload, args.fsync_chunks)
    _print(result)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H%M%S")
    (RESULTS / f"scale-nvme-{stamp}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
