"""The rule that splits the suite into tiers: a test that starts a process says so.

A test is in the ``process`` tier when its fixtures, followed to the end, include ``processes``
(``node_factory``, ``redis_factory``, ``stack_factory`` and every fixture that starts a node, a
redis-server, LMCache or a command request it); every other test is ``fast`` (``make test-fast``
runs those). The session's redis-server is the one process a fast test may use: it is started
once, inside :func:`allowed`.

The rule is checked, not trusted: while a test that does not request ``processes`` runs (its
setup, its body and its teardown), :func:`guard` makes every way Python starts a process raise
:class:`UndeclaredProcess`, in ``make test`` as in ``make test-fast``. A test that starts a node
without saying so fails at once, with the fix in the message. One exception: a module being
imported may (torch and LMCache probe the host with ``ldconfig`` and ``file`` at import, in
whichever test imports them first), so the outcome never depends on the order tests run in.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import multiprocessing.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FIXTURE", "MARK", "UndeclaredProcess", "allowed", "guard", "starts_processes"]

FIXTURE = "processes"  # the fixture a test or fixture requests to say: I start processes
MARK = "process"  # the marker conftest gives those tests; `-m "not process"` is the fast tier


class UndeclaredProcess(AssertionError):
    """A test started a process without requesting the ``processes`` fixture."""


def starts_processes(fixturenames: list[str] | tuple[str, ...]) -> bool:
    """The rule: a test is in the process tier when its fixture closure holds ``processes``."""
    return FIXTURE in fixturenames


_state = {"test": "", "allowed": True}  # the test running now; whether it may start a process


def _importing() -> bool:
    """A module is being imported: a library probing its host at import time (torch runs
    ``ldconfig -p``, LMCache's cpuinfo runs ``file``), in whichever test imports it first."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _refusing(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def check(*args: Any, **kwargs: Any) -> Any:
        if not _state["allowed"] and not _importing():
            raise UndeclaredProcess(
                f"{_state['test']} starts a process ({name}) but does not request the {FIXTURE!r} fixture: "
                f"add @pytest.mark.usefixtures({FIXTURE!r}) (or request a fixture that does), so the "
                "fast tier leaves it out"
            )
        return real(*args, **kwargs)

    check.__wrapped__ = real  # type: ignore[attr-defined]
    return check


# Every door to a new process: subprocess (and asyncio's subprocesses, built on it), a bare
# fork, posix_spawn, os.system, and multiprocessing's spawn and forkserver starts.
_DOORS: list[tuple[Any, str]] = [
    (subprocess.Popen, "_execute_child"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
    (_posixsubprocess, "fork_exec"),
    (multiprocessing.util, "spawnv_passfds"),
]


def install() -> None:
    """Put the check on every door (once per pytest process; :func:`guard` turns it on per test)."""
    for owner, name in _DOORS:
        real = getattr(owner, name, None)
        if real is not None and not hasattr(real, "__wrapped__"):
            setattr(owner, name, _refusing(f"{getattr(owner, '__name__', owner)}.{name}", real))


@contextlib.contextmanager
def guard(test: str, may_start: bool) -> Iterator[None]:
    """While ``test`` runs, a process start raises unless ``may_start``."""
    before = dict(_state)
    _state.update(test=test, allowed=may_start)
    try:
        yield
    finally:
        _state.update(before)


@contextlib.contextmanager
def allowed() -> Iterator[None]:
    """Starts here are allowed whatever the test (the session's redis-server, started once)."""
    before = _state["allowed"]
    _state["allowed"] = True
    try:
        yield
    finally:
        _state["allowed"] = before
