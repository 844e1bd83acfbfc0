"""Bounded waits on work the CPU is not told about: a CUDA event, a non-blocking communicator.

A wait spins for ``spin_s`` (50 µs: what a small transfer takes), then polls with a
pause that starts at ``first_pause_s`` (20 µs) and grows by a quarter each time up
to ``max_pause_s`` (1 ms). So work done within the spin is seen at once, and later
work is seen at most a quarter of its duration (or 1 ms) late, where the old
0.5 ms-then-doubling sleep added ~0.6 ms to a 20 µs transfer. The poll stays in
the caller's thread: it checks the deadline and ``stop()`` (another thread's
``abort_requested``) between polls, so no wait outlives its deadline by more than
one pause, and no other thread ever calls NCCL on a communicator in use. (A
blocking ``cudaEventSynchronize`` on a helper thread would wake sooner, but then
the deadline needs a watchdog that aborts the communicator from another thread
while the first is inside CUDA: two threads on one communicator, which NCCL
forbids.)

No CUDA here: ``done`` is any callable, so the tests drive these waits with fake
events on a CPU.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from backend.errors import NcclError

__all__ = ["WaitPolicy", "DEFAULT_POLICY", "wait_until", "never"]


@dataclasses.dataclass(frozen=True)
class WaitPolicy:
    """How a wait spends its time: spin first, then pauses growing by ``growth`` up to ``max_pause_s``."""

    spin_s: float = 50e-6
    first_pause_s: float = 20e-6
    growth: float = 1.25
    max_pause_s: float = 1e-3

    def __post_init__(self) -> None:
        if self.spin_s < 0 or self.first_pause_s <= 0 or self.growth < 1 or self.max_pause_s < self.first_pause_s:
            raise ValueError(f"a wait policy needs spin >= 0, 0 < first pause <= max pause, growth >= 1: {self}")


DEFAULT_POLICY = WaitPolicy()


def never() -> bool:
    return False


def wait_until(
    done: Callable[[], bool],
    *,
    deadline: float,
    timeout_s: float,
    what: str,
    stop: Callable[[], bool] = never,
    abort: Callable[[], None] | None = None,
    policy: WaitPolicy = DEFAULT_POLICY,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once ``done()`` is true; at ``deadline`` (a ``clock`` time) or on ``stop()``, ``abort()`` and raise.

    The NcclError says "timed out after {timeout_s}" or "was cancelled". An exception
    from ``done`` (a communicator that broke) propagates as it is, without ``abort``:
    the caller decides.
    """
    if done():
        return
    spin_until = clock() + policy.spin_s
    pause = policy.first_pause_s
    while True:
        now = clock()
        if stop():
            _fail(abort, f"{what} was cancelled")
        if now >= deadline:
            _fail(abort, f"{what} timed out after {timeout_s:.1f} s")
        if now >= spin_until:
            sleep(min(pause, deadline - now))
            pause = min(pause * policy.growth, policy.max_pause_s)
        if done():
            return


def _fail(abort: Callable[[], None] | None, message: str) -> None:
    if abort is not None:
        abort()
    raise NcclError(message)
