"""A clock a test moves by hand: for code that takes its time from an injected ``clock`` callable, so a
test lets a deadline pass by advancing it instead of sleeping through it."""

from __future__ import annotations

__all__ = ["ManualClock"]


class ManualClock:
    """Monotonic seconds that pass only when :meth:`advance` says so."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now_s += seconds
