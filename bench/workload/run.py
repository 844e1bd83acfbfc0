"""What a hit is worth: a serving trace replayed through real LMCache engines against each backend.

    python -m bench.workload.run --trace multi-round --engines 4 --capacity 0.5
    python -m bench.workload.run --trace long-doc-qa,multi-round --capacity 0.25,0.5,1 --backends kvpool,redis,resp,lm,fs
    python -m bench.workload.run --preset llama-3.1-8b --prefill-tokens-per-s 20000 ...

For each backend x trace x capacity the backend's server is started (``bench.harness.peers``)
and bounded to ``capacity`` x the trace's working set: kvpool through its node's
``--dram`` (no NVMe tier) with each eviction policy its node offers, redis:// and
resp:// through Redis's ``maxmemory`` (above what the empty server uses) with
``allkeys-lru``; lm:// and fs:// have no bound to set and run unbounded (the table
says so). Then ``--engines`` engine processes (``bench.workload.engine``: LMCache's
own LocalCPUBackend + RemoteBackend each, keys from LMCache's token database) are fed
the trace's requests in trace order, each request to the engine the trace routes it
to, one request in flight per engine; every loaded byte is verified.

Reported per run: the token hit rate of the pool and of the engines' local tiers,
the bytes loaded from and stored to the pool, lookup + load time per request
(p50/p99), and a **modeled** time to first token: the measured lookup + load time
plus the missed tokens recomputed at ``--prefill-tokens-per-s``, beside the same
trace with no cache (every token recomputed). The prefill side is a model, not a
measurement: no model runs here. Results go to ``docs/results/workload-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.plan import MIB
from bench.harness.provenance import machine, revision
from bench.paths import RESULTS
from bench.workload import report as workload_report
from bench.workload.engine import Served
from bench.workload.runs import ReplayRun, RunSpec, eviction_policies, make_trace, make_workload_peer
from bench.workload.sim import PREFILL_MFU, modeled_prefill_tokens_per_s
from bench.workload.traces import PRESETS, Request, Trace

INTERRUPTED_EXIT = 130  # the shell's code for a command ended by SIGINT
BACKENDS = ("kvpool", "redis", "resp", "lm", "fs", "mooncake")


# The default prefill rate is this model's, whatever KV shape is moved (the simulator's model of it).
PREFILL_MODEL = "llama-3.1-8b"


@dataclass(frozen=True)
class RunResult:
    """One backend x trace x capacity (x eviction policy): the engines' answers summed up."""

    backend: str
    trace: str
    capacity: float
    capacity_bytes: int
    bound: str  # how the backend was held to the capacity, or why it was not
    requests: int
    tokens: int
    local_hit_tokens: int
    pool_hit_tokens: int
    lost_chunks: int
    wrong_chunks: int
    bytes_loaded: int
    bytes_stored: int
    lookup_load_ms_p50: float
    lookup_load_ms_p99: float
    lookup_load_ms_max: float
    ttft_ms_mean: float  # modeled
    no_cache_ttft_ms_mean: float  # modeled: every token recomputed
    engines_with_pool_hits: int
    used_bytes: int | None  # what the store held at the end, where it says
    evictions: int | None
    seconds: float
    failure: str | None = None  # what ended the run early (its figures are then of what was served)
    served: tuple[tuple[int, Served], ...] = ()  # (engine, answer) per request, in trace order

    @property
    def pool_hit_rate(self) -> float:
        return self.pool_hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def local_hit_rate(self) -> float:
        return self.local_hit_tokens / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["served"] = [{"engine": engine, **asdict(answer)} for engine, answer in self.served]
        return record


def summarize(run: RunSpec, served: Sequence[tuple[int, Served]], seconds: float) -> dict[str, Any]:
    """The figures of one run from each request's answer (engine, what it served)."""
    from backend.latency import quantile

    tokens = local = pool = 0
    ttft_s, no_cache_s, lookup_load_ms = [], [], []
    engines_hit: set[int] = set()
    for engine, answer in served:
        per_chunk = run.trace_tokens[answer.request]
        request_tokens = sum(per_chunk)
        local_tokens = sum(per_chunk[: answer.local_hits])
        pool_tokens = sum(per_chunk[answer.local_hits : answer.local_hits + answer.pool_hits])
        tokens, local, pool = tokens + request_tokens, local + local_tokens, pool + pool_tokens
        if answer.pool_hits:
            engines_hit.add(engine)
        spent_s = answer.lookup_s + answer.load_s
        lookup_load_ms.append(spent_s * 1000)
        ttft_s.append(spent_s + (request_tokens - local_tokens - pool_tokens) / run.prefill_tokens_per_s)
        no_cache_s.append(request_tokens / run.prefill_tokens_per_s)
    lookup_load_ms.sort()
    return {
        "requests": len(served),
        "tokens": tokens,
        "local_hit_tokens": local,
        "pool_hit_tokens": pool,
        "lost_chunks": sum(a.lost for _, a in served),
        "wrong_chunks": sum(a.wrong for _, a in served),
        "bytes_loaded": sum(a.bytes_loaded for _, a in served),
        "bytes_stored": sum(a.bytes_stored for _, a in served),
        "lookup_load_ms_p50": quantile(lookup_load_ms, 0.5) if served else 0.0,
        "lookup_load_ms_p99": quantile(lookup_load_ms, 0.99) if served else 0.0,
        "lookup_load_ms_max": lookup_load_ms[-1] if served else 0.0,
        "ttft_ms_mean": 1000 * sum(ttft_s) / len(ttft_s) if served else 0.0,
        "no_cache_ttft_ms_mean": 1000 * sum(no_cache_s) / len(no_cache_s) if served else 0.0,
        "engines_with_pool_hits": len(engines_hit),
        "seconds": round(seconds, 1),
    }


def replay(run: RunSpec, trace_requests: Sequence[Request]) -> RunResult:
    """Start the backend bounded to the run's capacity, replay the trace through the engines, stop it."""
    started = time.monotonic()
    peer = make_workload_peer(run)
    served: list[tuple[int, Served]] = []
    used = evictions = None
    failure = None
    try:
        with ReplayRun(run, peer) as replaying:
            replaying.serve(trace_requests, served)
            used, evictions = replaying.store_state()
    except Exception as exc:  # one backend that fails must not end the others' runs
        traceback.print_exc()
        failure = repr(exc)
    return RunResult(
        backend=run.label,
        trace=run.trace,
        capacity=run.capacity,
        capacity_bytes=run.capacity_bytes,
        bound=peer.bound,
        used_bytes=used,
        evictions=evictions,
        failure=failure,
        served=tuple(served),
        **summarize(run, served, time.monotonic() - started),
    )


# -- the table -------------------------------------------------------------------------------
HEADER = (
    "backend",
    "trace",
    "capacity",
    "bound",
    "pool hit %",
    "local hit %",
    "MB loaded",
    "MB stored",
    "lookup+load ms p50",
    "p99",
    "TTFT ms (modeled)",
    "no cache",
    "wrong",
)


def table(results: Sequence[RunResult]) -> str:
    rows = [HEADER] + [
        (
            r.backend,
            r.trace,
            f"{r.capacity:g}",
            r.bound,
            f"{100 * r.pool_hit_rate:.1f}",
            f"{100 * r.local_hit_rate:.1f}",
            f"{r.bytes_loaded / 1e6:.1f}",
            f"{r.bytes_stored / 1e6:.1f}",
            f"{r.lookup_load_ms_p50:.2f}",
            f"{r.lookup_load_ms_p99:.2f}",
            f"{r.ttft_ms_mean:.1f}",
            f"{r.no_cache_ttft_ms_mean:.1f}",
            str(r.wrong_chunks),
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------
def parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_capacities(text: str) -> list[float]:
    values = [float(part) for part in parse_list(text)]
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"capacities are fractions of the working set in (0, 1], got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=parse_list, default=["multi-round"], help="trace name(s), comma-separated")
    parser.add_argument("--engines", type=int, default=4, help="engine processes sharing the pool (default 4)")
    parser.add_argument(
        "--capacity", type=parse_capacities, default=[0.5], help="pool capacity as fractions of the working set"
    )
    parser.add_argument(
        "--backends", type=parse_list, default=["kvpool", "redis", "resp", "lm", "fs"], help="comma-separated"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="ci-tiny", help="the KV shape moved")
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        help=f"the modeled prefill rate (default: {PREFILL_MODEL}'s on one H100, "
        f"{modeled_prefill_tokens_per_s(PRESETS[PREFILL_MODEL]):.0f} tokens/s)",
    )
    parser.add_argument(
        "--local-fraction",
        type=float,
        default=0.05,
        help="each engine's local CPU tier, as a fraction of the working set (default 0.05)",
    )
    parser.add_argument("--reduced", action="store_true", help="the trace's reduced form (for tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="DIR",
        help="write the pool hit rate and modeled TTFT PNGs there (needs matplotlib)",
    )
    args = parser.parse_args(argv)
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; choose from {','.join(BACKENDS)}")
    if args.engines < 1:
        parser.error("--engines must be at least 1")
    return args


@dataclass
class Replays:
    """What a command's runs gave so far, kept as each ends: an interrupted command still has them."""

    results: list[RunResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    traces: dict[str, Trace] = field(default_factory=dict)


def replay_all(args: argparse.Namespace, prefill: float, done: Replays) -> None:
    """Every run the arguments name, in order, each kept in ``done`` as it ends."""
    preset = PRESETS[args.preset]
    results, skipped = done.results, done.skipped
    for name in args.trace:
        trace = done.traces[name] = make_trace(name, args.engines, args.seed, args.reduced)
        print(f"[workload] {trace.describe()}", flush=True)
        tokens = [r.chunk_tokens for r in trace.requests]
        for backend in args.backends:
            for capacity in args.capacity:
                for eviction in eviction_policies(backend):
                    run = RunSpec.make(
                        backend=backend,
                        eviction=eviction,
                        trace=name,
                        capacity=capacity,
                        working_set_chunks=trace.working_set_chunks,
                        preset=(preset.layers, preset.kv_heads, preset.head_dim),
                        engines=args.engines,
                        local_fraction=args.local_fraction,
                        prefill_tokens_per_s=prefill,
                        trace_tokens=tokens,
                    )
                    if run.skip_reason:
                        skipped.append(f"{backend}: {run.skip_reason}")
                        continue
                    print(f"[workload] {run.label} on {name} at {capacity:g}: replaying", flush=True)
                    results.append(replay(run, trace.requests))
                    print(table(results[-1:]).splitlines()[-1], flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    prefill = args.prefill_tokens_per_s or modeled_prefill_tokens_per_s(PRESETS[PREFILL_MODEL])
    command = "python -m bench.workload.run" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    print(
        f"[workload] preset {preset.describe()}; prefill modeled at {prefill:.0f} tokens/s "
        + ("(given)" if args.prefill_tokens_per_s else f"({PREFILL_MODEL} at {PREFILL_MFU:g} of an H100's BF16 peak)")
        + ", not measured",
        flush=True,
    )
    done = Replays()
    try:
        replay_all(args, prefill, done)
    except KeyboardInterrupt:  # each run stopped what it started on the way out (ReplayRun)
        print()
        print(table(done.results))
        print(
            f"[workload] interrupted (Ctrl-C) after {len(done.results)} run(s): the engines and servers it started are "
            "stopped; no results written",
            flush=True,
        )
        return INTERRUPTED_EXIT
    results, skipped, traces = done.results, done.skipped, done.traces
    print()
    print(table(results))
    for line in dict.fromkeys(skipped):
        print(f"[workload] skipped {line}")
    records = [r.to_json() for r in results]  # every request's answer: built once, reported and saved
    workload_report.report(
        [workload_report.Measured.from_json(r) for r in records], traces, args.local_fraction, args.plot
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"workload-{stamp}.json"
    record = {
        "bench": "bench.workload.run",
        "command": command,
        "started": stamp,
        "preset": args.preset,
        "prefill_tokens_per_s": prefill,
        "prefill": "modeled",
        "engines": args.engines,
        "seed": args.seed,
        "reduced": args.reduced,
        "local_fraction": args.local_fraction,
        "machine": machine(),
        "revision": revision(),
        "results": records,
        "skipped": skipped,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"[workload] results: {path}")
    problems = [f"{r.backend} at {r.capacity:g}: {r.failure}" for r in results if r.failure]
    problems += [f"{r.backend} at {r.capacity:g}: {r.wrong_chunks} chunks differ" for r in results if r.wrong_chunks]
    if problems:
        print("[workload] FAILED:\n  " + "\n  ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["RunResult", "main", "make_trace", "replay", "summarize", "table", "MIB"]
