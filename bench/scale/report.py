"""The scale report: a node of N chunks measured against every budget of issue #34, one table at the end.

    python -m bench.scale.pool --report                      # N = 1,000,000 (the issue's figures)
    python -m bench.scale.pool --report --quick              # N = 200,000
    python -m bench.scale.pool --report --chunks 50000 --parts node,redis

It runs the scale benches one after the other, in this process, each printing its own
detailed figures as it goes, then prints one summary: every figure the issue's "Done
when" names, its target beside it, ok or MISSED.

* ``node`` (:mod:`bench.scale.node`): real nodes filled with N tiny chunks through the
  put path: fill rate, bookkeeping bytes per chunk, an NVMe record's bytes, and a put that
  evicts, EXISTS_BATCH and GET_BATCH of 1,000 keys at N beside 10^4, 10 % pinned;
* ``nvme`` (:mod:`bench.scale.nvme`): a node of N chunks after FLUSHALL (99 % of a sample
  hitting, the heartbeat, a second flush mid-republish), and a restart over N NVMe files
  (written without fsync) to first hit and to all indexed;
* ``disk`` (:mod:`bench.scale.nvme`): N chunks as one file each beside packed segments;
* ``redis`` (:mod:`bench.scale.redis_memory`): Redis ``used_memory`` per chunk beyond the key,
  LMCache in-process and layerwise keys, filled through the node's commit path;
* ``sweep`` (:mod:`bench.scale.sweep`): a dead node's N entries swept by a live node, the
  admin verbs over N keys, the live lookup of 1,000 keys at N beside 10^4; the index
  written directly (pipelined HSETs of what a commit writes), not through nodes.

The figures that need 10^7 keys (admin verbs over 10^7, a sweep in a 10^7-key pool) take
about ten minutes each and are not part of it: the commands are printed at the end.
Results go to ``docs/results/scale-report-<timestamp>.json``: the summary rows and every
bench's own figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.scale import node as scale_node
from bench.scale import nvme as scale_nvme
from bench.scale import redis_memory as scale_redis
from bench.scale import sweep as scale_sweep

__all__ = ["PARTS", "DEFAULT_CHUNKS", "QUICK_CHUNKS", "Row", "min_chunks", "summarise", "report"]

PARTS = ("node", "nvme", "disk", "redis", "sweep")
DEFAULT_CHUNKS = 1_000_000
QUICK_CHUNKS = 200_000
SMALL = f"{scale_node.SMALL_CHUNKS:,}"  # the small size every "N vs 10^4" figure compares with
NODE_BUDGET_BYTES = scale_node.TARGET_OVERHEAD_BYTES
REDIS_BUDGET_BYTES = scale_redis.TARGET_BEYOND_KEY
RATIO = scale_node.TARGET_RATIO
HEARTBEAT_TTL_S = scale_nvme.HEARTBEAT_TTL_S
HOW = {
    "node": "chunks put through the real put path into kvpool node processes; the NVMe records' cost on "
    "records made in the measuring process (no files read)",
    "nvme": "the republished node filled through the put path; the restart's chunk files written straight into "
    "its NVMe directory without fsync (to save time), page cache warm",
    "disk": "files and segments written without fsync, and with one per chunk over at most "
    f"{scale_nvme.FSYNC_SAMPLE:,} chunks",
    "redis": "the index filled through the node's commit path (KeyIndex.commit), a fresh redis-server per case",
    "sweep": "the index written directly (pipelined HSETs of what a node's commit writes), not through nodes; "
    "the sweep and the admin verbs beside a real node",
}
TEN_MILLION = (
    "python -m bench.scale.sweep --chunks 10000000 --parts admin",
    "python -m bench.scale.sweep --chunks 1000000 --pool 10000000 --parts sweep",
)


def min_chunks(part: str) -> int:
    """The fewest chunks ``part`` can measure with."""
    if part == "node":
        # The large node's oldest 10 % are leased, the puts in flight land in any order, the rounds evict,
        # and 1,000 keys must remain that no round can have evicted (scale_node._Held).
        moving = scale_node.PUTS_IN_FLIGHT * scale_node.PUT_BATCH + scale_node.ROUNDS * scale_node.EVICT_BATCH
        need = math.ceil((moving + scale_node.LOOKUP_KEYS) / (1 - scale_node.PINNED_SHARE))
        return max(scale_node.SMALL_CHUNKS + 1, -(-need // 1000) * 1000)
    if part == "sweep":
        return 2 * scale_sweep.LOOKUP_KEYS  # the lookup reads 1,000 keys stored together from a random start
    return scale_nvme.SAMPLE  # a sample of 1,000 keys; the Redis figures are per chunk


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the summary: a figure, what was measured, its target and whether it was met."""

    name: str  # stable, for the JSON
    label: str
    measured: str
    target: str  # "" where the issue sets none
    ok: bool | None  # None: no target
    value: float | bool | None  # the figure itself, in the unit of ``name``

    @property
    def verdict(self) -> str:
        return "" if self.ok is None else ("ok" if self.ok else "MISSED")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _ratio(name: str, label: str, small: float, large: float, unit: str) -> Row:
    ratio = large / small
    measured = f"{large:.2f} {unit} vs {small:.2f} ({ratio:.2f}x)"
    return Row(name, label, measured, f"<= {RATIO}x", ratio <= RATIO, round(ratio, 3))


def _node_rows(result: dict[str, Any], n: str) -> list[Row]:
    node, records = result["node"], result["nvme_records"]
    overhead, record = node["overhead_per_chunk_bytes"], records["overhead_per_record_bytes"]
    small, large = node["small_ms"], node["large_ms"]
    rows = [
        Row(
            "fill_chunks_per_s",
            f"fill: {n} chunks of {node['value_bytes']} B through the put path",
            f"{node['fill_chunks_per_s']:,.0f} chunks/s",
            "",
            None,
            round(node["fill_chunks_per_s"]),
        ),
        Row(
            "node_bookkeeping_bytes_per_chunk",
            "node bookkeeping per chunk, beyond room + key",
            f"{overhead:.0f} B (RSS +{node['rss_growth_per_chunk_bytes']:.0f} B/chunk)",
            f"<= {NODE_BUDGET_BYTES} B",
            overhead <= NODE_BUDGET_BYTES,
            round(overhead, 1),
        ),
        Row(
            "nvme_record_bytes_per_chunk",
            "an NVMe file's record, beyond the key",
            f"{record:.0f} B",
            f"<= {NODE_BUDGET_BYTES} B",
            record <= NODE_BUDGET_BYTES,
            round(record, 1),
        ),
    ]
    for name, label in (
        ("put_evicting", f"put of {scale_node.EVICT_BATCH} that evicts, p50 {n} vs {SMALL}"),
        ("exists", f"EXISTS_BATCH of 1,000, p50 {n} vs {SMALL}"),
        ("get", f"GET_BATCH of 1,000, p50 {n} vs {SMALL}"),
    ):
        rows.append(_ratio(f"{name}_p50_ratio", label, small[name]["p50"], large[name]["p50"], "ms"))
    return rows


def _beat_ok(figures: dict[str, Any]) -> bool:
    return bool(figures["heartbeat_missing_polls"] == 0 and figures["heartbeat_longest_gap_s"] < HEARTBEAT_TTL_S)


def _nvme_rows(result: dict[str, Any], n: str) -> list[Row]:
    rows: list[Row] = []
    if "republish" in result:
        first = result["republish"]["after_flush"]
        second = result["republish"]["after_second_flush_mid_republish"]
        limit = scale_nvme.TARGETS["republish_sample_99_s"]
        for name, label, figures in (
            ("republish_sample_99_s", f"FLUSHALL at {n}: 99 % of a 1,000-key sample hits", first),
            ("second_flush_sample_99_s", "second FLUSHALL mid-republish: 99 % hits", second),
        ):
            s = figures["sample_99_s"]
            rows.append(Row(name, label, f"{s:.1f} s", f"<= {limit:.0f} s", s <= limit, round(s, 2)))
        gap = max(first["heartbeat_longest_gap_s"], second["heartbeat_longest_gap_s"])
        missing = first["heartbeat_missing_polls"] + second["heartbeat_missing_polls"]
        lapsed = not (_beat_ok(first) and _beat_ok(second))
        rows.append(
            Row(
                "heartbeat_lapsed",
                "heartbeat during both republishes",
                f"longest gap {gap:.2f} s, missing {missing}",
                f"never lapsed (TTL {HEARTBEAT_TTL_S:.0f} s)",
                not lapsed,
                lapsed,
            )
        )
    if "restart" in result:
        r = result["restart"]
        first_hit, indexed = r["first_hit_s"], r["all_indexed_s"]
        hit_limit, index_limit = scale_nvme.TARGETS["restart_first_hit_s"], scale_nvme.TARGETS["restart_all_indexed_s"]
        rows.append(
            Row(
                "restart_first_hit_s",
                f"restart over {n} NVMe files: first hit",
                f"{first_hit:.1f} s",
                f"<= {hit_limit:.0f} s",
                first_hit <= hit_limit,
                round(first_hit, 2),
            )
        )
        whole = "every sample key hits" if r["sample_all_hit"] else "SAMPLE KEYS MISS"
        rows.append(
            Row(
                "restart_all_indexed_s",
                "restart: all indexed",
                f"{indexed:.1f} s, {whole}",
                f"<= {index_limit:.0f} s",
                indexed <= index_limit and r["sample_all_hit"],
                round(indexed, 2),
            )
        )
    return rows


def _disk_rows(result: dict[str, Any], n: str) -> list[Row]:
    disk = result["disk"]
    files, segments = disk["files"], disk["segments"]
    return [
        Row(
            "disk_scan_s",
            f"scan of {n} chunks at start: files, segments",
            f"{files['scan_s']:.1f} s, {segments['scan_s']:.1f} s",
            "",
            None,
            round(files["scan_s"], 2),
        )
    ]


def _redis_rows(result: dict[str, Any]) -> list[Row]:
    rows = []
    for kind, label in (("inprocess", "in-process"), ("layerwise", "layerwise")):
        case = result[f"{kind}/1copy"]
        beyond = case["beyond_key"]
        rows.append(
            Row(
                f"redis_{kind}_bytes_beyond_key",
                f"Redis used_memory per chunk beyond key, {label}",
                f"{beyond:.1f} B (key {case['key_chars']:.0f} chars)",
                f"<= {REDIS_BUDGET_BYTES} B",
                beyond <= REDIS_BUDGET_BYTES,
                beyond,
            )
        )
    return rows


def _call_ms(ms: float) -> str:
    """A slowest call as SLOWLOG saw it: it keeps only calls over SLOW_US."""
    return f"{ms:.2f} ms" if ms else f"none over {scale_sweep.SLOW_US / 1000:.0f} ms"


def _sweep_rows(result: dict[str, Any], n: str, chunks: int) -> list[Row]:
    sweep, admin, lookup = result["sweep"], result["admin"], result["lookup"]
    limit_ms = scale_sweep.CALL_TARGET_MS
    walk = sweep["sweep_walk_s"]
    slowest = sweep["redis_slowest_call_ms"]
    verbs = ("ls_prefix", "evict_prefix", "stats", "status")
    admin_slowest = max(admin[verb]["redis_slowest_call_ms"] for verb in verbs)
    slowest_verb = max(verbs, key=lambda verb: admin[verb]["redis_slowest_call_ms"])
    rows = [
        Row(
            "sweep_walk_s",
            f"sweep of a dead {n}-chunk node",
            f"{walk:.1f} s, {sweep['sample_dead_fields_left']} dead left in sample",
            f"<= {scale_sweep.SWEEP_TARGET_S:.0f} s",
            walk <= scale_sweep.SWEEP_TARGET_S and sweep["sample_dead_fields_left"] == 0,
            walk,
        ),
        Row(
            "sweep_slowest_redis_call_ms",
            "sweep: slowest Redis call",
            _call_ms(slowest),
            f"< {limit_ms:.0f} ms",
            slowest < limit_ms,
            slowest,
        ),
        Row(
            "admin_slowest_redis_call_ms",
            f"ls/evict --prefix, stats, status at {n} keys: slowest call",
            f"{_call_ms(admin_slowest)} ({slowest_verb})" if admin_slowest else _call_ms(0),
            f"< {limit_ms:.0f} ms",
            admin_slowest < limit_ms,
            admin_slowest,
        ),
    ]
    for verb in ("stats", "status"):
        figures = admin[verb]
        rows.append(
            Row(
                f"{verb}_wall_s",
                f"kvpool {verb} at {n} keys: wall time",
                f"{figures['wall_s']:.2f} s, {figures['cli_peak_rss_mib']:.0f} MiB",
                "",
                None,
                figures["wall_s"],
            )
        )
    small, large = lookup[f"at_{scale_sweep.SMALL_INDEX}"], lookup[f"at_{chunks}"]
    for how, label in (("together", "keys stored together"), ("random", "keys at random")):
        rows.append(
            _ratio(
                f"lookup_{how}_p50_ratio",
                f"lookup of 1,000 ({label}), p50 {n} vs {SMALL}",
                small[f"{how}_p50_ms"],
                large[f"{how}_p50_ms"],
                "ms",
            )
        )
    return rows


def summarise(chunks: int, results: dict[str, Any]) -> list[Row]:
    """The summary's rows for the parts in ``results``, in the issue's order."""
    n = f"{chunks:,}"
    node_rows = _node_rows(results["node"], n) if "node" in results else []
    rows = node_rows[:3]  # fill rate and memory first, the node's ratios last
    if "redis" in results:
        rows += _redis_rows(results["redis"])
    if "nvme" in results:
        rows += _nvme_rows(results["nvme"], n)
    if "disk" in results:
        rows += _disk_rows(results["disk"], n)
    if "sweep" in results:
        rows += _sweep_rows(results["sweep"], n, chunks)
    return rows + node_rows[3:]


def print_summary(chunks: int, parts: Sequence[str], rows: Sequence[Row], seconds: dict[str, float]) -> None:
    """The summary table, how its figures were made, and the commands of the figures it leaves out."""
    width = max(len(row.label) for row in rows) if rows else 0
    measured = max(len(row.measured) for row in rows) if rows else 0
    target = max(len(row.target) for row in rows) if rows else 0
    print(f"\nscale report at {chunks:,} chunks ({', '.join(parts)}; {os.cpu_count()} CPUs)")
    print(f"  {'figure':<{width}}  {'measured':<{measured}}  target")
    for row in rows:
        print(f"  {row.label:<{width}}  {row.measured:<{measured}}  {row.target:<{target}}  {row.verdict}".rstrip())
    missed = [row.label for row in rows if row.ok is False]
    print(f"  {len(missed)} of {sum(row.ok is not None for row in rows)} targets missed" + (":" if missed else ""))
    for label in missed:
        print(f"    {label}")
    print("how the figures were made:")
    for part in parts:
        print(f"  {part}: {HOW[part]}")
    print("  seconds per part: " + ", ".join(f"{part} {s:.0f}" for part, s in seconds.items()))
    print("not in this report (about 10 minutes each): admin verbs at 10^7 keys and a sweep in a 10^7-key pool:")
    for command in TEN_MILLION:
        print(f"  {command}")


def _run_sweep(chunks: int) -> dict[str, Any]:
    results: dict[str, Any] = scale_sweep.main(["--chunks", str(chunks)])
    return results


def _run_nvme(chunks: int, only: str) -> dict[str, Any]:
    result = scale_nvme.run(chunks, only=only)
    scale_nvme._print(result)
    return result


def _run_redis(chunks: int) -> dict[str, Any]:
    result = scale_redis.measure(chunks, legacy=False)
    scale_redis.print_table(result)
    return result


def report(chunks: int, parts: Sequence[str], results_dir: Path) -> int:
    """Run ``parts`` at ``chunks``, print the summary, write the JSON; 0 (the figures say what was missed)."""
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "node": lambda: scale_node.run(chunks),
        "redis": lambda: _run_redis(chunks),
        "nvme": lambda: _run_nvme(chunks, "republish") | _run_nvme(chunks, "restart"),
        "disk": lambda: _run_nvme(chunks, "disk"),
        "sweep": lambda: _run_sweep(chunks),
    }
    print(f"scale report: {chunks:,} chunks, parts {','.join(parts)}; load average {os.getloadavg()[0]:.2f}")
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for part in PARTS:
        if part not in parts:
            continue
        print(f"\n== {part} ==", flush=True)
        started = time.monotonic()
        results[part] = runners[part]()
        seconds[part] = round(time.monotonic() - started, 1)
    rows = summarise(chunks, results)
    print_summary(chunks, [p for p in PARTS if p in parts], rows, seconds)
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H%M%S")
    record = {
        "date": stamp,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_after": os.getloadavg()},
        "chunks": chunks,
        "parts": list(parts),
        "seconds": seconds,
        "index_written": {"sweep": "directly", "redis": "through KeyIndex.commit"},
        "nvme_files_fsync": False,
        "not_run": list(TEN_MILLION),
        "summary": [row.to_json() for row in rows],
        "results": results,
    }
    path = results_dir / f"scale-report-{stamp}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"results: {path}")
    return 0
