"""Ratios, project targets, the printed table and the plot of a ``bench.harness.run`` run.

Every GB/s figure is given as a ratio to its ceiling (one TCP stream over loopback for
network stores, memcpy for ``fs://`` and kvpool's same-host path) and to LMCache's
``redis://`` in the same cell; latencies and lookups as a ratio to ``redis://`` (below
1 is faster). Cells hold medians over the run's rounds, ceilings their best round
(``bench.harness.rounds``), and the targets are computed from those.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.workload.plots import pyplot, save

__all__ = ["add_ratios", "targets", "render", "plot", "cell_line", "fill_line", "lookup_line"]

MIB = 1 << 20

REFERENCE = "redis"
CEILING_FIELDS = {"tcp_loopback": "tcp_loopback_gbps", "memcpy": "memcpy_gbps"}
CEILING_NAMES = {"tcp_loopback": "TCP loopback", "memcpy": "memcpy"}
KVPOOL_BACKENDS = ("kvpool", "kvpool-shm")

# The targets (issue "Hit path"): batch 8, one client, at 4 MiB and 32 MiB chunks.
TARGET_CHUNKS = ("4MiB", "32MiB")
TARGET_BATCH = 8
TARGET_CLIENTS = 1
TARGET_LOOKUP_KEYS = 1000
GET_PEERS = ("lm", "resp")  # the fastest network gets LMCache has
NETWORK_PEERS = ("redis", "resp", "lm", "mooncake")  # what a client on another host could use instead of kvpool
ALL_PEERS = (*NETWORK_PEERS, "fs")  # on the same host, fs:// in the page cache is a choice too
TCP_GET_VS_PEERS = 1.2
TCP_GET_VS_CEILING = 0.8
SHM_GET_VS_FS = 1.2
SHM_GET_VS_MEMCPY = 0.6
PUT_VS_PEERS = 1.3
PUT_P99_VS_P50 = 2.0
COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda value, goal: value >= goal,
    "<=": lambda value, goal: value <= goal,
    "==": lambda value, goal: value == goal,
}


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


def _cell_key(cell: dict[str, Any]) -> tuple[str, int, int]:
    return (cell["chunk"], cell["batch"], cell["clients"])


def _find(results: dict[str, Any], backend: str, chunk: str, batch: int, clients: int) -> dict[str, Any] | None:
    for cell in results.get(backend, {}).get("cells", []):
        if _cell_key(cell) == (chunk, batch, clients) and "get_gbps" in cell:
            return dict(cell)
    return None


def add_ratios(results: dict[str, Any], ceilings: dict[str, float]) -> None:
    """Add ``*_vs_ceiling``, ``*_vs_redis`` and ``ideal_ms`` to every measured cell and lookup, in place."""
    reference = {_cell_key(c): c for c in results.get(REFERENCE, {}).get("cells", []) if "get_gbps" in c}
    ref_lookup = results.get(REFERENCE, {}).get("lookup")
    for backend in results.values():
        ceiling = ceilings.get(CEILING_FIELDS.get(backend.get("ceiling", ""), ""), 0.0)
        for cell in backend.get("cells", []):
            if "get_gbps" not in cell:
                continue
            ref = reference.get(_cell_key(cell), {})
            op_bytes = cell["chunk_bytes"] * cell["batch"]
            cell["ideal_ms"] = op_bytes / (ceiling * 1e9) * 1000 if ceiling else None
            for op in ("put", "get"):
                cell[f"{op}_vs_ceiling"] = _ratio(cell[f"{op}_gbps"], ceiling)
                cell[f"{op}_vs_redis"] = _ratio(cell[f"{op}_gbps"], ref.get(f"{op}_gbps"))
                for q in ("p50", "p99"):
                    cell[f"{op}_{q}_vs_ideal"] = _ratio(cell[f"{op}_ms"][q], cell["ideal_ms"])
                    cell[f"{op}_{q}_vs_redis"] = _ratio(cell[f"{op}_ms"][q], ref.get(f"{op}_ms", {}).get(q))
        lookup = backend.get("lookup")
        if lookup and ref_lookup and "ms" in lookup:
            lookup["ms_vs_redis"] = _ratio(lookup["ms"]["p50"], ref_lookup["ms"]["p50"])


def _gbps(cell: dict[str, Any] | None, op: str) -> float | None:
    return cell[f"{op}_gbps"] if cell else None


def _label(what: str, gbps: float | None) -> str | None:
    return None if gbps is None else f"{what} {gbps:.2f} GB/s"


def _best(results: dict[str, Any], names: Sequence[str], chunk: str, op: str) -> tuple[float | None, str | None]:
    """The highest ``op`` GB/s among ``names`` in the target cell, and a label naming it."""
    found = [
        (cell[f"{op}_gbps"], name)
        for name in names
        if (cell := _find(results, name, chunk, TARGET_BATCH, TARGET_CLIENTS)) is not None
    ]
    if not found:
        return None, None
    gbps, name = max(found)
    return gbps, _label(f"{name}://", gbps)


def targets(results: dict[str, Any], ceilings: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's targets at each target chunk size (batch 8, one client), from the cells' medians.

    Each row: the target, its chunk size, the measured value, how it must compare with
    the goal (``>=``, ``<=`` or ``==``), what it was measured against, and ``met``
    (None when the run did not measure both sides).
    """
    out: list[dict[str, Any]] = []

    def add(
        name: str,
        chunk: str | None,
        value: float | None,
        compare: str,
        goal: float,
        against: str | None,
        unit: str = "x",
    ) -> None:
        met = None if value is None else COMPARE[compare](value, goal)
        out.append(
            {
                "target": name,
                "chunk": chunk,
                "value": value,
                "compare": compare,
                "goal": goal,
                "unit": unit,
                "against": against,
                "met": met,
            }
        )

    tcp, memcpy = ceilings.get("tcp_loopback_gbps"), ceilings.get("memcpy_gbps")
    for chunk in TARGET_CHUNKS:
        kv, shm, fs = (
            _find(results, name, chunk, TARGET_BATCH, TARGET_CLIENTS) for name in ("kvpool", "kvpool-shm", "fs")
        )
        best_get, best_get_label = _best(results, GET_PEERS, chunk, "get")
        add(
            "kvpool get vs best of lm:// and resp://",
            chunk,
            _ratio(_gbps(kv, "get"), best_get),
            ">=",
            TCP_GET_VS_PEERS,
            best_get_label,
        )
        add(
            "kvpool get vs TCP loopback ceiling",
            chunk,
            _ratio(_gbps(kv, "get"), tcp),
            ">=",
            TCP_GET_VS_CEILING,
            _label("TCP loopback", tcp),
        )
        add(
            "kvpool-shm get vs fs://",
            chunk,
            _ratio(_gbps(shm, "get"), _gbps(fs, "get")),
            ">=",
            SHM_GET_VS_FS,
            _label("fs://", _gbps(fs, "get")),
        )
        add(
            "kvpool-shm get vs memcpy ceiling",
            chunk,
            _ratio(_gbps(shm, "get"), memcpy),
            ">=",
            SHM_GET_VS_MEMCPY,
            _label("memcpy", memcpy),
        )
        for name, own, peers, which in (
            ("kvpool", kv, NETWORK_PEERS, "best network peer"),
            ("kvpool-shm", shm, ALL_PEERS, "best peer, fs:// included"),
        ):
            best_put, best_put_label = _best(results, peers, chunk, "put")
            add(
                f"{name} put (full pool) vs {which}",
                chunk,
                _ratio(_gbps(own, "put"), best_put),
                ">=",
                PUT_VS_PEERS,
                best_put_label,
            )
            p50, p99 = (own["put_ms"][q] if own else None for q in ("p50", "p99"))
            add(
                f"{name} put p99 vs its p50 (full pool)",
                chunk,
                _ratio(p99, p50),
                "<=",
                PUT_P99_VS_P50,
                None if p50 is None else f"put p50 {p50:.1f} ms",
            )
    lookup = results.get("kvpool", {}).get("lookup") or {}
    lookup_rt = lookup.get("redis_round_trips") if lookup.get("keys") == TARGET_LOOKUP_KEYS else None
    add("kvpool lookup of 1,000 keys: Redis round trips", None, lookup_rt, "==", 1, None, unit=" round trip(s)")
    return out


# -- text -------------------------------------------------------------------------------
def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cell_line(backend: str, cell: dict[str, Any]) -> str:
    """One round of one cell, as the harness prints it when measured."""
    where = (
        f"[harness] round {cell['round']} {backend} {cell['chunk']} batch {cell['batch']} x{cell['clients']} "
        f"client(s), {cell['calls']} calls"
    )
    evicted = f", {cell['evictions']} evictions during {cell['chunks_put']} puts" if "evictions" in cell else ""
    if "get_gbps" not in cell:
        return f"{where}: FAILED {'; '.join(cell['errors'])}"
    good = cell["chunks_read"] - cell["misses"] - cell["mismatches"]
    text = (
        f"{where}: put {cell['put_gbps']:.2f} GB/s (p99 {cell['put_ms']['p99']:.1f} ms), "
        f"get {cell['get_gbps']:.2f} GB/s (p99 {cell['get_ms']['p99']:.1f} ms), "
        f"{good}/{cell['chunks_read']} identical{evicted}"
    )
    return text + "".join(f"; ERROR {e}" for e in cell["errors"])


def fill_line(backend: str, fill: dict[str, Any]) -> str:
    return (
        f"[harness] round {fill['round']} {backend} {fill['chunk']}: DRAM filled with {fill['filler_chunks']} "
        f"filler chunks, {fill['dram_used_bytes'] / MIB:.0f} of {fill['dram_capacity_bytes'] / MIB:.0f} MiB "
        f"used, {fill['evictions']} evicted"
    )


def lookup_line(backend: str, lookup: dict[str, Any]) -> str:
    text = (
        f"[harness] {backend} lookup of {lookup['keys']} keys: {lookup['ms']['p50']:.2f} ms, "
        f"hit prefix {lookup['hit_prefix']}"
    )
    if "redis_round_trips" in lookup:
        text += f", {lookup['redis_round_trips']} Redis round trips, {lookup['redis_commands']} commands"
    return text


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render(run: dict[str, Any]) -> str:
    """The run as Markdown tables: throughput and latency, kvpool beside its ceilings, lookups, targets."""
    c = run["ceilings"]
    rounds = run["plan"]["rounds"]
    parts = [
        f"Medians of {rounds} interleaved round(s); every round's figures are in the JSON (per_round).\n"
        f"Ceilings (best round): memcpy {c['memcpy_gbps']:.2f} GB/s; one TCP stream over loopback "
        f"{c['tcp_loopback_gbps']:.2f} GB/s (x ceil: fs:// and kvpool-shm vs memcpy, the rest vs TCP)."
    ]
    rows = []
    for name, backend in run["backends"].items():
        if backend["status"] == "skipped":
            continue
        for cell in backend.get("cells", []):
            if "get_gbps" not in cell:
                rows.append([name, cell["chunk"], str(cell["batch"]), str(cell["clients"])] + ["-"] * 10 + ["FAILED"])
                continue
            good = cell["chunks_read"] - cell["misses"] - cell["mismatches"]
            rows.append(
                [
                    name,
                    cell["chunk"],
                    str(cell["batch"]),
                    str(cell["clients"]),
                    _f(cell["put_gbps"]),
                    _f(cell["put_vs_ceiling"]),
                    _f(cell["put_vs_redis"]),
                    _f(cell["get_gbps"]),
                    _f(cell["get_vs_ceiling"]),
                    _f(cell["get_vs_redis"]),
                    f"{cell['put_ms']['p50']:.1f} / {cell['put_ms']['p99']:.1f}",
                    _f(cell["put_p99_vs_redis"]),
                    f"{cell['get_ms']['p50']:.1f} / {cell['get_ms']['p99']:.1f}",
                    _f(cell["get_p99_vs_redis"]),
                    f"{good}/{cell['chunks_read']}",
                ]
            )
    parts.append(
        _table(
            [
                "backend",
                "chunk",
                "batch",
                "clients",
                "put GB/s",
                "x ceil",
                "x redis",
                "get GB/s",
                "x ceil",
                "x redis",
                "put p50/p99 ms",
                "p99 x redis",
                "get p50/p99 ms",
                "p99 x redis",
                "identical",
            ],
            rows,
        )
    )
    ceiling_rows = _ceiling_rows(run)
    if ceiling_rows:
        parts.append(
            _table(
                [
                    "kvpool cell (full pool)",
                    "chunk",
                    "batch",
                    "clients",
                    "put GB/s",
                    "get GB/s",
                    "ceiling",
                    "ceiling GB/s",
                    "put x ceil",
                    "get x ceil",
                    "evictions / puts",
                ],
                ceiling_rows,
            )
        )
    rows = []
    for name, backend in run["backends"].items():
        lookup = backend.get("lookup")
        if not lookup:
            continue
        rt = lookup.get("redis_round_trips")
        by_name = ", ".join(f"{k} {v}" for k, v in lookup.get("redis_commands_by_name", {}).items())
        rows.append(
            [
                name,
                f"{lookup['hit_prefix']}/{lookup['keys']}",
                f"{lookup['ms']['p50']:.2f}",
                _f(lookup.get("ms_vs_redis")),
                "-" if rt is None else f"{rt} over {lookup['redis_connections']} connection(s)",
                "-" if rt is None else f"{lookup['redis_commands']} ({by_name or 'none'})",
            ]
        )
    if rows:
        parts.append(
            _table(["backend", "hit prefix", "lookup p50 ms", "x redis", "Redis round trips", "Redis commands"], rows)
        )
    skipped = [f"{n}: skipped ({b['reason']})" for n, b in run["backends"].items() if b["status"] == "skipped"]
    failed = [f"{n}: FAILED ({'; '.join(b['errors'])})" for n, b in run["backends"].items() if b["status"] == "failed"]
    if skipped or failed:
        parts.append("\n".join(skipped + failed))
    rows = []
    for t in run["targets"]:
        rows.append(
            [
                t["target"],
                t["chunk"] or "-",
                _target_value(t["value"], t["unit"]),
                f"{t['compare']} {_target_value(t['goal'], t['unit'])}",
                t["against"] or "-",
                {True: "met", False: "MISSED", None: "not measured"}[t["met"]],
            ]
        )
    parts.append(
        _table(
            [
                f"target (batch {TARGET_BATCH}, {TARGET_CLIENTS} client, medians)",
                "chunk",
                "measured",
                "goal",
                "against",
                "result",
            ],
            rows,
        )
    )
    return "\n\n".join(parts)


def _target_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if unit == "x" else f"{value:g}{unit}"


def _ceiling_rows(run: dict[str, Any]) -> list[list[str]]:
    """kvpool's cells beside the ceiling of their path: TCP loopback (kvpool), memcpy (kvpool-shm)."""
    rows = []
    for name in KVPOOL_BACKENDS:
        backend = run["backends"].get(name, {})
        ceiling = backend.get("ceiling", "")
        ceiling_gbps = run["ceilings"].get(CEILING_FIELDS.get(ceiling, ""))
        for cell in backend.get("cells", []):
            if "get_gbps" not in cell:
                continue
            evicted = f"{cell['evictions']} / {cell['chunks_put']}" if "evictions" in cell else "-"
            rows.append(
                [
                    name,
                    cell["chunk"],
                    str(cell["batch"]),
                    str(cell["clients"]),
                    _f(cell["put_gbps"]),
                    _f(cell["get_gbps"]),
                    CEILING_NAMES.get(ceiling, ceiling),
                    _f(ceiling_gbps),
                    _f(cell["put_vs_ceiling"]),
                    _f(cell["get_vs_ceiling"]),
                    evicted,
                ]
            )
    return rows


# -- plot -------------------------------------------------------------------------------
def plot(run: dict[str, Any], path: Path) -> Path | None:
    """GB/s against chunk size, one line per backend; None when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    plan = run["plan"]
    combos = [(b, c) for b in plan["batches"] for c in plan["clients"]]
    sizes = {x["chunk_bytes"]: x["chunk"] for b in run["backends"].values() for x in b.get("cells", [])}
    fig, axes = plt.subplots(2, len(combos), figsize=(4.5 * len(combos), 7), squeeze=False, sharex=True)
    for col, (batch, clients) in enumerate(combos):
        for row, op in enumerate(("put", "get")):
            ax = axes[row][col]
            for name, backend in run["backends"].items():
                cells = [
                    x
                    for x in backend.get("cells", [])
                    if x["batch"] == batch and x["clients"] == clients and "get_gbps" in x
                ]
                if cells:
                    cells.sort(key=lambda x: x["chunk_bytes"])
                    ax.plot([x["chunk_bytes"] for x in cells], [x[f"{op}_gbps"] for x in cells], marker="o", label=name)
            ax.axhline(run["ceilings"]["tcp_loopback_gbps"], linestyle="--", color="grey", label="TCP loopback")
            ax.axhline(run["ceilings"]["memcpy_gbps"], linestyle=":", color="grey", label="memcpy")
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(sizes), list(sizes.values()))
            ax.minorticks_off()
            ax.set_title(f"{op}, batch {batch}, {clients} client{'s' if clients > 1 else ''}")
            ax.set_ylabel("GB/s")
            if row == 1:
                ax.set_xlabel("chunk size")
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"LMCache backends side by side ({run['started']}, {run['command']})", fontsize="medium")
    return save(plt, fig, path)
