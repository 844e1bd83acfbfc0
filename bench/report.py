"""Ratios, project targets, the printed table and the plot of a ``bench.harness`` run.

Every GB/s figure is given as a ratio to its ceiling (one TCP stream over loopback for
network stores, memcpy for ``fs://``) and to LMCache's ``redis://`` in the same cell;
latencies and lookups as a ratio to ``redis://`` (below 1 is faster).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["add_ratios", "targets", "render", "plot", "cell_line", "lookup_line"]

REFERENCE = "redis"
CEILING_FIELDS = {"tcp_loopback": "tcp_loopback_gbps", "memcpy": "memcpy_gbps"}
TARGET_CHUNK = "4MiB"
TARGET_BATCH = 8
TARGET_LOOKUP_KEYS = 1000


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


def targets(results: dict[str, Any], ceilings: dict[str, float]) -> list[dict[str, Any]]:
    """The project's targets (4 MiB chunks, batch 8, one client), each with its measured ratio."""
    kv = _find(results, "kvpool", TARGET_CHUNK, TARGET_BATCH, 1)
    ref = _find(results, REFERENCE, TARGET_CHUNK, TARGET_BATCH, 1)
    peers = [c for c in (_find(results, n, TARGET_CHUNK, TARGET_BATCH, 1) for n in ("lm", "resp")) if c]
    single = _find(results, "kvpool", TARGET_CHUNK, 1, 1)
    single_ref = _find(results, REFERENCE, TARGET_CHUNK, 1, 1)
    lookup = results.get("kvpool", {}).get("lookup") or {}
    lookup_rt = lookup.get("redis_round_trips") if lookup.get("keys") == TARGET_LOOKUP_KEYS else None
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, higher_is_better: bool = True, unit: str = "x") -> None:
        met = None if value is None else (value >= goal if higher_is_better else value <= goal)
        out.append({"target": name, "value": value, "goal": goal, "unit": unit, "met": met})

    def best_peer(op: str) -> float | None:
        return max(c[f"{op}_gbps"] for c in peers) if peers else None

    tcp = ceilings.get("tcp_loopback_gbps")
    for op in ("get", "put"):
        add(f"kvpool {op} >= 3x redis://", _ratio(kv and kv[f"{op}_gbps"], ref and ref[f"{op}_gbps"]), 3.0)
        add(f"kvpool {op} >= best of lm:// / resp://", _ratio(kv and kv[f"{op}_gbps"], best_peer(op)), 1.0)
        if op == "get":
            add("kvpool get >= 0.7x TCP loopback", _ratio(kv and kv["get_gbps"], tcp), 0.7)
    shm = _find(results, "kvpool-shm", TARGET_CHUNK, TARGET_BATCH, 1)
    fs = _find(results, "fs", TARGET_CHUNK, TARGET_BATCH, 1)
    add("same-host get >= fs:// get", _ratio(shm and shm["get_gbps"], fs and fs["get_gbps"]), 1.0)
    add("same-host get >= 0.5x memcpy", _ratio(shm and shm["get_gbps"], ceilings.get("memcpy_gbps")), 0.5)
    add("lookup of 1,000 keys = 1 Redis round trip", lookup_rt, 1, False, " round trips")
    add("p99 of a single 4 MiB get <= 0.5x redis:// p99",
        _ratio(single and single["get_ms"]["p99"], single_ref and single_ref["get_ms"]["p99"]), 0.5, False)  # fmt: skip
    return out


# -- text -------------------------------------------------------------------------------
def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cell_line(backend: str, cell: dict[str, Any]) -> str:
    where = f"[harness] {backend} {cell['chunk']} batch {cell['batch']} x{cell['clients']} client(s), {cell['rounds']} rounds"
    if "get_gbps" not in cell:
        return f"{where}: FAILED {'; '.join(cell['errors'])}"
    good = cell["chunks_read"] - cell["misses"] - cell["mismatches"]
    return (f"{where}: put {cell['put_gbps']:.2f} GB/s (p99 {cell['put_ms']['p99']:.1f} ms), "
            f"get {cell['get_gbps']:.2f} GB/s (p99 {cell['get_ms']['p99']:.1f} ms), "
            f"{good}/{cell['chunks_read']} identical")  # fmt: skip


def lookup_line(backend: str, lookup: dict[str, Any]) -> str:
    text = (f"[harness] {backend} lookup of {lookup['keys']} keys: {lookup['ms']['p50']:.2f} ms, "
            f"hit prefix {lookup['hit_prefix']}")  # fmt: skip
    if "redis_round_trips" in lookup:
        text += f", {lookup['redis_round_trips']} Redis round trips, {lookup['redis_commands']} commands"
    return text


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render(run: dict[str, Any]) -> str:
    """The run as Markdown tables: throughput and latency, lookups, targets."""
    c = run["ceilings"]
    parts = [f"Ceilings: memcpy {c['memcpy_gbps']:.2f} GB/s; one TCP stream over loopback "
             f"{c['tcp_loopback_gbps']:.2f} GB/s (x ceil: fs:// vs memcpy, the rest vs TCP)."]  # fmt: skip
    rows = []
    for name, backend in run["backends"].items():
        if backend["status"] == "skipped":
            continue
        for cell in backend.get("cells", []):
            if "get_gbps" not in cell:
                rows.append([name, cell["chunk"], str(cell["batch"]), str(cell["clients"])] + ["-"] * 10 + ["FAILED"])
                continue
            good = cell["chunks_read"] - cell["misses"] - cell["mismatches"]
            rows.append([
                name, cell["chunk"], str(cell["batch"]), str(cell["clients"]),
                _f(cell["put_gbps"]), _f(cell["put_vs_ceiling"]), _f(cell["put_vs_redis"]),
                _f(cell["get_gbps"]), _f(cell["get_vs_ceiling"]), _f(cell["get_vs_redis"]),
                f"{cell['put_ms']['p50']:.1f} / {cell['put_ms']['p99']:.1f}", _f(cell["put_p99_vs_redis"]),
                f"{cell['get_ms']['p50']:.1f} / {cell['get_ms']['p99']:.1f}", _f(cell["get_p99_vs_redis"]),
                f"{good}/{cell['chunks_read']}",
            ])  # fmt: skip
    parts.append(_table(["backend", "chunk", "batch", "clients", "put GB/s", "x ceil", "x redis", "get GB/s",
                         "x ceil", "x redis", "put p50/p99 ms", "p99 x redis", "get p50/p99 ms", "p99 x redis",
                         "identical"],
                        rows))  # fmt: skip
    rows = []
    for name, backend in run["backends"].items():
        lookup = backend.get("lookup")
        if not lookup:
            continue
        rt = lookup.get("redis_round_trips")
        by_name = ", ".join(f"{k} {v}" for k, v in lookup.get("redis_commands_by_name", {}).items())
        rows.append([name, f"{lookup['hit_prefix']}/{lookup['keys']}", f"{lookup['ms']['p50']:.2f}",
                     _f(lookup.get("ms_vs_redis")),
                     "-" if rt is None else f"{rt} over {lookup['redis_connections']} connection(s)",
                     "-" if rt is None else f"{lookup['redis_commands']} ({by_name or 'none'})"])  # fmt: skip
    if rows:
        parts.append(_table(["backend", "hit prefix", "lookup p50 ms", "x redis", "Redis round trips",
                             "Redis commands"], rows))  # fmt: skip
    skipped = [f"{n}: skipped ({b['reason']})" for n, b in run["backends"].items() if b["status"] == "skipped"]
    failed = [f"{n}: FAILED ({'; '.join(b['errors'])})" for n, b in run["backends"].items() if b["status"] == "failed"]
    if skipped or failed:
        parts.append("\n".join(skipped + failed))
    rows = []
    for t in run["targets"]:
        if t["value"] is None:
            value = "-"
        else:
            value = f"{t['value']:.2f}x" if t["unit"] == "x" else f"{t['value']}{t['unit']}"
        rows.append([t["target"], value, {True: "met", False: "MISSED", None: "not measured"}[t["met"]]])
    parts.append(_table(["target (4 MiB chunks, batch 8, one client)", "measured", "result"], rows))
    return "\n\n".join(parts)


# -- plot -------------------------------------------------------------------------------
def plot(run: dict[str, Any], path: Path) -> Path | None:
    """GB/s against chunk size, one line per backend; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plan = run["plan"]
    combos = [(b, c) for b in plan["batches"] for c in plan["clients"]]
    sizes = {x["chunk_bytes"]: x["chunk"] for b in run["backends"].values() for x in b.get("cells", [])}
    fig, axes = plt.subplots(2, len(combos), figsize=(4.5 * len(combos), 7), squeeze=False, sharex=True)
    for col, (batch, clients) in enumerate(combos):
        for row, op in enumerate(("put", "get")):
            ax = axes[row][col]
            for name, backend in run["backends"].items():
                cells = [x for x in backend.get("cells", []) if x["batch"] == batch and x["clients"] == clients
                         and "get_gbps" in x]  # fmt: skip
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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
