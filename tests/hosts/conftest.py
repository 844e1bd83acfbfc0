"""The host bed for tests: hosts as namespaces (``bench.hosts``), and a pool client driven on one of them."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from bench.hosts import BedUnavailable, HostBed, missing

FULL = bool(os.environ.get("KVPOOL_FULL"))  # `make faults`: the longer runs
DRIVER_TIMEOUT_S = 120.0


class Driver:
    """``tests.hosts.driver`` on a host: ``call(op, **args)`` sends one command and returns its answer."""

    def __init__(self, bed: HostBed, host: str, url: str) -> None:
        self.process = bed.popen(host, [sys.executable, "-m", "tests.hosts.driver", url])
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        assert self._answer(60).get("ready"), self.tail()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            if line.startswith("{"):
                self.lines.put(line)

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            return dict(json.loads(self.lines.get(timeout=timeout_s)))
        except queue.Empty:
            raise AssertionError(f"the driver gave no answer within {timeout_s} s:\n{self.tail()}") from None

    def tail(self, lines: int = 30) -> str:
        return "".join(self.log[-lines:])

    def send(self, op: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def call(self, op: str, timeout_s: float = DRIVER_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self._answer(timeout_s)

    def receive(self, timeout_s: float = DRIVER_TIMEOUT_S) -> dict[str, Any]:
        """The answer of a command sent with ``send``."""
        return self._answer(timeout_s)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture
def bed_factory() -> Iterator[Any]:
    """``make(names)``: a bed of those hosts, removed at teardown. No root or tools: the test FAILS with why."""
    made: list[HostBed] = []
    drivers: list[Driver] = []

    def make(names: Sequence[str]) -> HostBed:
        reason = missing()
        if reason:
            pytest.fail(f"host bed unavailable: {reason}")
        try:
            made.append(HostBed(names))
        except BedUnavailable as exc:
            pytest.fail(f"host bed unavailable: {exc}")
        return made[-1]

    def driver(bed: HostBed, host: str, url: str) -> Driver:
        drivers.append(Driver(bed, host, url))
        return drivers[-1]

    make.driver = driver  # type: ignore[attr-defined]
    yield make
    for d in drivers:
        d.close()
    for bed in made:
        bed.close()
        assert not bed.leftovers(), f"the bed left namespaces behind: {bed.leftovers()}"
