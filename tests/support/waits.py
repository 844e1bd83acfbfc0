"""Waiting for a condition instead of sleeping for a guess: poll until it holds, fail when it never does.

``wait_until`` polls a plain predicate from a thread that may block (the test's own); ``until``
polls from a coroutine, and its probe may be a plain function or one returning an awaitable;
``run_with_timeout`` bounds a call that must return (a hang fails the test instead of stalling it).
A test that must show that something does *not* happen still sleeps (there is nothing to await),
and says so where it does.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["run_with_timeout", "until", "wait_until"]

T = TypeVar("T")

POLL_S = 0.02  # often enough that a wait costs a test no more than this beyond the condition


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes; whether it came true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


async def until(
    probe: Callable[[], T | Awaitable[T]],
    done: Callable[[T], object] = bool,
    timeout_s: float = 10.0,
    interval_s: float = POLL_S,
) -> T:
    """Await ``probe()`` until ``done`` holds of its answer; that answer. AssertionError (with the
    last answer) when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = probe()
        if inspect.isawaitable(answer):
            answer = await answer
        if done(answer):  # type: ignore[arg-type]
            return answer  # type: ignore[return-value]
        assert time.monotonic() < deadline, f"the condition never came within {timeout_s} s: last {answer!r}"
        await asyncio.sleep(interval_s)


def run_with_timeout(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()``, run on a daemon thread; TimeoutError if it has not returned within ``timeout_s``."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{fn} did not return within {timeout_s} s")
    return result[0]  # type: ignore[no-any-return]
