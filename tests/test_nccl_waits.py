"""The channel's waits on a CPU, with fake events: a finished transfer is seen within microseconds,
a deadline is kept (the communicator aborted), a cancel is honoured, nothing hangs.

No CPU can make a CUDA event or an NCCL communicator, so they are stand-ins whose state
changes at a chosen time; the waits under test are the real ones (``nccl_channel.waits`` and
the communicator's ``_wait_ready``, which creation and every transfer go through).
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from backend.errors import NcclError
from nccl_channel.communicator import _wait_event, _wait_ready
from nccl_channel.library import NCCL_IN_PROGRESS, NCCL_SUCCESS
from nccl_channel.waits import DEFAULT_POLICY, WaitPolicy, wait_until


class FakeEvent:
    """Completes ``after_s`` seconds after it is made (real time), as a CUDA event on a busy stream does."""

    def __init__(self, after_s: float) -> None:
        self.ready_at = time.monotonic() + after_s
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return time.monotonic() >= self.ready_at


class FakeLibrary:
    """A non-blocking communicator that is in progress until ``ready_at``, then ``final`` (an ncclResult)."""

    def __init__(self, after_s: float, final: int = NCCL_SUCCESS) -> None:
        self.ready_at = time.monotonic() + after_s
        self.final = final

    def comm_async_error(self, comm: object) -> int:
        return self.final if time.monotonic() >= self.ready_at else NCCL_IN_PROGRESS

    def error_string(self, result: int) -> str:
        return "fake internal error"


class FakeClock:
    """Time that passes only when slept, plus a microsecond per look."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _fastest_of(runs: int, wait) -> float:
    """The quickest of ``runs`` waits: a busy shared machine can only make a wait slower, never faster."""
    best = float("inf")
    for _ in range(runs):
        start = time.monotonic()
        wait()
        best = min(best, time.monotonic() - start)
    return best


def test_a_transfer_done_in_100_us_is_seen_well_before_half_a_millisecond():
    """The old poll slept 0.5 ms before its first look, so no wait on it ever ended before 0.5 ms."""
    event_s = _fastest_of(20, lambda: _wait_event(FakeEvent(100e-6), 5.0, "test", time.monotonic(), lambda: False))
    ready_s = _fastest_of(20, lambda: _wait_ready(FakeLibrary(100e-6), None, NCCL_IN_PROGRESS, 5.0, "create"))
    assert event_s < 400e-6, f"a 100 µs event was seen after {event_s * 1e6:.0f} µs"
    assert ready_s < 400e-6, f"a communicator ready in 100 µs was seen after {ready_s * 1e6:.0f} µs"


def test_pauses_start_under_50_us_grow_slowly_are_capped_and_never_pass_the_deadline():
    now = [0.0]
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += seconds

    def clock() -> float:
        now[0] += 1e-6  # every look at the clock costs a microsecond
        return now[0]

    with pytest.raises(NcclError, match=r"timed out after 0\.1 s"):
        wait_until(lambda: False, deadline=0.1, timeout_s=0.1, what="a transfer", clock=clock, sleep=sleep)
    assert pauses[0] <= 50e-6
    assert max(pauses) <= DEFAULT_POLICY.max_pause_s
    assert all(b <= a * DEFAULT_POLICY.growth + 1e-12 for a, b in itertools.pairwise(pauses))
    assert now[0] <= 0.1 + 1e-3  # the last pause is cut at the deadline


def test_work_finishing_late_is_seen_within_a_quarter_of_its_time():
    """With a fake clock: whenever the work finishes, the wait notices at most 25 % (or 1 ms) later."""
    for finish_s in (30e-6, 300e-6, 3e-3, 30e-3):
        clock = FakeClock()
        wait_until(
            lambda clock=clock, finish_s=finish_s: clock.now >= finish_s,
            deadline=1.0,
            timeout_s=1.0,
            what="w",
            clock=clock,
            sleep=clock.sleep,
        )
        late_s = clock.now - finish_s
        assert late_s <= max(0.25 * finish_s, DEFAULT_POLICY.first_pause_s) + 5e-6, (finish_s, late_s)
        assert late_s <= DEFAULT_POLICY.max_pause_s + 5e-6


def test_a_wait_that_never_completes_aborts_and_raises_at_its_deadline():
    aborted = []
    event = FakeEvent(3600.0)
    start = time.monotonic()
    with pytest.raises(NcclError, match=r"a group of 1 transfers timed out after 0\.2 s"):
        wait_until(
            event.query,
            deadline=start + 0.2,
            timeout_s=0.2,
            what="a group of 1 transfers",
            abort=lambda: aborted.append(time.monotonic()),
        )
    took = time.monotonic() - start
    # Not before its deadline, and not hung (the event would take an hour). How late at most (one capped
    # pause) is held with a fake clock above: on the real one, a loaded machine can hold this thread off
    # its core for longer than the 0.1 s of slack this bound used to give.
    assert 0.2 <= took < 0.2 + 2.0, took
    assert len(aborted) == 1


def test_a_communicator_that_never_gets_ready_times_out_and_one_that_breaks_names_its_error():
    start = time.monotonic()
    with pytest.raises(NcclError, match=r"creating rank 0 of 2 timed out after 0\.1 s"):
        _wait_ready(FakeLibrary(3600.0), None, NCCL_IN_PROGRESS, 0.1, "creating rank 0 of 2")
    assert time.monotonic() - start < 0.1 + 0.1
    with pytest.raises(NcclError) as caught:
        _wait_ready(FakeLibrary(0.0, final=3), None, NCCL_IN_PROGRESS, 5.0, "creating rank 1 of 2")
    assert caught.value.result == 3 and "creating rank 1 of 2 failed" in str(caught.value)


def test_abort_requested_from_another_thread_stops_the_wait_long_before_its_deadline():
    flag = threading.Event()
    aborted = []
    threading.Timer(0.05, flag.set).start()
    start = time.monotonic()
    with pytest.raises(NcclError, match="was cancelled"):
        wait_until(
            FakeEvent(3600.0).query,
            deadline=start + 30.0,
            timeout_s=30.0,
            what="a recv",
            stop=flag.is_set,
            abort=lambda: aborted.append(True),
        )
    assert time.monotonic() - start < 1.0
    assert aborted == [True]


def test_done_work_returns_at_once_even_past_the_deadline_and_a_breaking_poll_propagates():
    wait_until(lambda: True, deadline=0.0, timeout_s=0.0, what="done")  # completed work is never thrown away

    def broken() -> bool:
        raise NcclError("ncclCommGetAsyncError failed", 5)

    aborted = []
    with pytest.raises(NcclError, match="ncclCommGetAsyncError failed"):
        wait_until(broken, deadline=time.monotonic() + 5, timeout_s=5, what="w", abort=lambda: aborted.append(1))
    assert aborted == []  # the caller decides what a broken communicator means


def test_a_bad_policy_is_refused_naming_it():
    with pytest.raises(ValueError, match="wait policy"):
        WaitPolicy(first_pause_s=0.0)
