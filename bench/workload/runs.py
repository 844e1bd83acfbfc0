"""One replay run: a backend bounded to a capacity, and the engine processes that replay a trace on it.

``bench.workload.run`` builds a ``RunSpec`` per backend x trace x capacity (x kvpool's
eviction policy), a ``WorkloadPeer`` (a ``bench.harness.peers`` peer and how it was bounded)
and runs the trace through a ``ReplayRun``: ``--engines`` processes of
``bench.workload.engine``, each fed its requests in trace order on stdin. A ``ReplayRun``
stops every process it started when it ends, however it ends: interrupted (Ctrl-C), it
gives the engines ``ENGINE_INTERRUPTED_STOP_S`` to exit before killing them, and a second
Ctrl-C does not cut that short (``backend.launch.processes.interrupts_held``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import redis

from backend.launch.processes import REPO, Interrupts, interrupts_held
from bench.harness.peers import FSPeer, KVPoolPeer, LMServerPeer, MooncakePeer, Peer, RedisPeer, SharedRedis
from bench.harness.plan import GIB, MIB, chunk_bytes
from bench.workload import traces as workload_traces
from bench.workload.engine import READY, EngineSpec, Served
from bench.workload.traces import Request, Trace

ENGINE_STOP_TIMEOUT_S = 30.0
ENGINE_INTERRUPTED_STOP_S = 3.0  # after a Ctrl-C: an engine that has not closed LMCache by then is killed
STOP_POLL_S = 0.05
LOCAL_IN_FLIGHT_REQUESTS = 3  # an engine's local buffer holds at least this many of the largest requests
LOCAL_SLACK_BYTES = 4 * MIB  # LMCache's allocator rounds and aligns: room beyond the chunks
UNBOUNDED = "none: it has no eviction"
# LMCache's wait for a remote get (its default is 10 s, the harness's 60 s for 32 MiB chunks on two cores):
# a replay's chunks are small, and a get that outlives this is a stall the table should show, not sit out.
BLOCKING_TIMEOUT_S = 10


def eviction_policies(backend: str) -> list[str | None]:
    """kvpool's policies to run (``kvpool up --eviction``'s, lru first); None for the other backends, whose
    eviction is their own."""
    from backend.config.node import EVICTIONS

    if backend != "kvpool":
        return [None]
    return sorted(EVICTIONS, key=lambda name: name != "lru")


# The reduced traces: a replay in the tests' time on two cores.
REDUCED: dict[str, dict[str, object]] = {
    "multi-round": {"users": 16, "system_chunks": 2, "rounds": 6, "round_chunks": 1},
    "long-doc-qa": {"documents": 4, "document_chunks": 8, "questions": 2},
    "agent": {"agents": 4, "tool_chunks": 4, "context_chunks": 8, "steps": 4},
    "mooncake": {"requests": 40},
}


def make_trace(name: str, engines: int, seed: int, reduced: bool) -> Trace:
    params: dict[str, object] = {"engines": engines, "seed": seed, **(REDUCED.get(name, {}) if reduced else {})}
    return workload_traces.make_trace(name, **params)


def local_chunks(working_set_chunks: int, trace_tokens: Sequence[Sequence[int]], local_fraction: float) -> float:
    """Chunks each engine's local tier holds: ``local_fraction`` of the working set, and at least
    ``LOCAL_IN_FLIGHT_REQUESTS`` of the trace's largest requests (LMCache's ``allocate()`` blocks while
    the local buffer is full, so a request must fit in it with room to spare)."""
    largest = max((len(t) for t in trace_tokens), default=1)
    return max(local_fraction * working_set_chunks, float(LOCAL_IN_FLIGHT_REQUESTS * largest))


@dataclass(frozen=True)
class RunSpec:
    """What one run replays on what: the backend, its bound, the engines' shape, the prefill model."""

    backend: str
    eviction: str | None
    trace: str
    capacity: float
    capacity_bytes: int
    shape: tuple[int, int, int]  # layers, KV heads, head size
    engines: int
    local_gib: float
    prefill_tokens_per_s: float
    trace_tokens: Sequence[Sequence[int]] = field(repr=False)  # per request, the tokens of each chunk

    @classmethod
    def make(
        cls,
        *,
        backend: str,
        eviction: str | None,
        trace: str,
        capacity: float,
        working_set_chunks: int,
        preset: tuple[int, int, int],
        engines: int,
        local_fraction: float,
        prefill_tokens_per_s: float,
        trace_tokens: Sequence[Sequence[int]],
    ) -> RunSpec:
        size = chunk_bytes(preset)
        local_bytes = local_chunks(working_set_chunks, trace_tokens, local_fraction) * size
        return cls(
            backend=backend,
            eviction=eviction,
            trace=trace,
            capacity=capacity,
            capacity_bytes=math.ceil(capacity * working_set_chunks) * size,
            shape=preset,
            engines=engines,
            local_gib=(local_bytes + LOCAL_SLACK_BYTES) / GIB,
            prefill_tokens_per_s=prefill_tokens_per_s,
            trace_tokens=trace_tokens,
        )

    @property
    def label(self) -> str:
        return f"{self.backend} {self.eviction}" if self.eviction else self.backend

    @property
    def skip_reason(self) -> str | None:
        return MooncakePeer(0).skip_reason if self.backend == "mooncake" else None


class WorkloadPeer:
    """A harness peer held to the run's capacity where it can be; ``bound`` says how, or why not."""

    def __init__(self, peer: Peer, bound: str, capacity_bytes: int) -> None:
        self.peer = peer
        self.bound = bound
        self.capacity_bytes = capacity_bytes
        self._redis_baseline = 0

    def start(self) -> None:
        self.peer.start()
        if isinstance(self.peer, RedisPeer):
            with self._redis() as client:
                client.flushall()
                self._redis_baseline = int(client.info("memory")["used_memory"])
                # maxmemory counts everything the server holds: its empty footprint, then the capacity.
                client.config_set("maxmemory", self._redis_baseline + self.capacity_bytes)
                client.config_set("maxmemory-policy", "allkeys-lru")

    def _redis(self) -> redis.Redis:
        return redis.Redis(port=self.peer.redis_port, socket_timeout=30)

    def store_state(self) -> tuple[int | None, int | None]:
        """Bytes the store holds now and the evictions it counted, where it says."""
        if isinstance(self.peer, KVPoolPeer) and self.peer.full is not None:
            state = self.peer.full.state()
            return state.used_bytes, state.evictions
        if isinstance(self.peer, RedisPeer):
            with self._redis() as client:
                used = int(client.info("memory")["used_memory"]) - self._redis_baseline
                return used, int(client.info("stats")["evicted_keys"])
        if isinstance(self.peer, FSPeer) and self.peer.path is not None:
            return sum(p.stat().st_size for p in self.peer.path.rglob("*") if p.is_file()), None
        return None, None

    def stop(self) -> None:
        self.peer.stop()


def make_workload_peer(run: RunSpec) -> WorkloadPeer:
    capacity = run.capacity_bytes
    if run.backend == "kvpool":
        flags = ("--eviction", run.eviction) if run.eviction else ()
        # The engines' URLs say nothing of touches: by default (touch=auto) a client tells the lookups' found
        # prefixes to the nodes whose order uses them (the prefix orders), none to an lru node.
        bound = f"--dram {capacity / MIB:.1f}MiB"
        return WorkloadPeer(KVPoolPeer(str(capacity), up_args=flags), bound, capacity)
    if run.backend in ("redis", "resp"):
        return WorkloadPeer(RedisPeer(run.backend, SharedRedis()), "maxmemory, allkeys-lru", capacity)
    if run.backend == "lm":
        return WorkloadPeer(LMServerPeer(), UNBOUNDED, capacity)
    if run.backend == "fs":
        return WorkloadPeer(FSPeer(), UNBOUNDED, capacity)
    if run.backend == "mooncake":
        return WorkloadPeer(MooncakePeer(capacity), "global segment size", capacity)
    raise ValueError(f"no replay peer called {run.backend!r}")


class EngineProcess:
    """One ``bench.workload.engine`` child: a request a line on stdin, its ``Served`` a line on stdout."""

    def __init__(self, spec: EngineSpec, workdir: Path, number: int) -> None:
        spec_path = workdir / f"engine-{number}.json"
        spec_path.write_text(spec.to_json())
        self.log_path = workdir / f"engine-{number}.log"
        self._log: IO[str] = self.log_path.open("w")
        # LMCache's per-stack warnings would drown the engine's log; set here, for the child only.
        env = {
            "LMCACHE_LOG_LEVEL": "ERROR",
            **os.environ,
            "PYTHONHASHSEED": "0",
            "LMCACHE_TRACK_USAGE": "false",
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.workload.engine", str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO,
            env=env,
        )
        self.number = number

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {self.number} exited ({self.process.poll()}): {self.tail()}")
        return line

    def wait_ready(self) -> None:
        while (line := self._line().strip()) != READY:
            print(f"[engine {self.number}] {line}", flush=True)

    def send(self, number: int, request: Request) -> None:
        assert self.process.stdin is not None
        line = {
            "request": number,
            "contents": request.contents,
            "chunk_tokens": request.chunk_tokens,
            "keys": request.keys,
        }
        self.process.stdin.write(json.dumps(line) + "\n")
        self.process.stdin.flush()

    def answer(self) -> Served:
        return Served.from_json(self._line())

    def tail(self, lines: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close_input(self) -> None:
        """Close its stdin: it closes LMCache and exits."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass

    def kill(self) -> None:
        """Kill it by its pid if it still runs, and close its log."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()


def stop_engines(engines: Sequence[EngineProcess], patience_s: float, interrupts: Interrupts) -> None:
    """Close every engine's stdin and wait for them together, ``patience_s`` at most (cut to
    ENGINE_INTERRUPTED_STOP_S once a Ctrl-C is held in ``interrupts``); then kill the rest by their pids."""
    for engine in engines:
        engine.close_input()
    deadline = time.monotonic() + patience_s
    hurried = False
    while any(engine.process.poll() is None for engine in engines) and time.monotonic() < deadline:
        if interrupts and not hurried:
            deadline, hurried = min(deadline, time.monotonic() + ENGINE_INTERRUPTED_STOP_S), True
        time.sleep(STOP_POLL_S)
    for engine in engines:
        engine.kill()


class ReplayRun:
    """The backend started and bounded, ``run.engines`` engine processes on it; stopped on exit."""

    def __init__(self, run: RunSpec, peer: WorkloadPeer) -> None:
        self.run = run
        self.peer = peer
        self.engines: list[EngineProcess] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-workload-")

    def __enter__(self) -> ReplayRun:
        try:
            self.peer.start()
            config = self.peer.peer.lmcache_config(self.run.local_gib)
            config["blocking_timeout_secs"] = BLOCKING_TIMEOUT_S
            layers, heads, head_size = self.run.shape
            spec = EngineSpec(config, layers, heads, head_size)
            for number in range(self.run.engines):  # one by one: each is stopped by close() once it runs
                self.engines.append(EngineProcess(spec, Path(self._tmp.name), number))
            for engine in self.engines:
                engine.wait_ready()
        except BaseException as exc:
            self.close(interrupted=isinstance(exc, KeyboardInterrupt))
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(interrupted=isinstance(exc, KeyboardInterrupt))

    def serve(self, requests: Sequence[Request], served: list[tuple[int, Served]]) -> None:
        """Each request to its engine in trace order, one in flight per engine; (engine, answer) into ``served``.

        ``served`` keeps what was answered should an engine fail midway; it ends in request order.
        """
        in_flight: set[int] = set()
        for number, request in enumerate(requests):
            engine = request.engine % len(self.engines)
            if engine in in_flight:
                served.append((engine, self.engines[engine].answer()))
                in_flight.discard(engine)
            self.engines[engine].send(number, request)
            in_flight.add(engine)
        for engine in sorted(in_flight):
            served.append((engine, self.engines[engine].answer()))
        served.sort(key=lambda pair: pair[1].request)

    def store_state(self) -> tuple[int | None, int | None]:
        return self.peer.store_state()

    def close(self, interrupted: bool = False) -> None:
        """Stop the engines (promptly when ``interrupted``), then the backend; a Ctrl-C meanwhile is held until
        both are stopped, and hurries the engines."""
        with interrupts_held() as interrupts:
            try:
                patience_s = ENGINE_INTERRUPTED_STOP_S if interrupted else ENGINE_STOP_TIMEOUT_S
                stop_engines(self.engines, patience_s, interrupts)
            finally:
                self.engines = []
                try:
                    self.peer.stop()
                finally:
                    self._tmp.cleanup()
