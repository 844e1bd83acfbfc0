"""The host bed for tests: hosts as namespaces (``bench.hosts.bed``), and a pool client driven on one of them."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from bench.hosts.bed import BedUnavailable, HostBed, JsonLines, missing

FULL = bool(os.environ.get("KVPOOL_FULL"))  # `make faults`: the longer runs
DRIVER_TIMEOUT_S = 120.0


class Driver(JsonLines):
    """``tests.hosts.driver`` on a host: ``call(op, **args)`` sends one command and returns its answer."""

    def __init__(self, bed: HostBed, host: str, url: str) -> None:
        super().__init__(bed.popen(host, [sys.executable, "-m", "tests.hosts.driver", url]))
        assert self.receive(60).get("ready"), self.tail()

    def call(self, op: str, timeout_s: float = DRIVER_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        return super().call(op, timeout_s, **args)

    def receive(self, timeout_s: float = DRIVER_TIMEOUT_S) -> dict[str, Any]:
        return super().receive(timeout_s)


@pytest.fixture
def bed_factory(processes: None) -> Iterator[Any]:
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
