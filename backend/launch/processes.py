"""Servers as child processes: started, their output kept, ready on a line they print or a port.

:class:`ServerProcess` is what the harness's peers (``bench.harness.peers``) and the pool
nodes of the tests and the bench (``backend.launch.nodes``) are run with. A process is
stopped by its own pid, never by name: SIGTERM, then SIGKILL if it lingers.
:func:`interrupts_held` keeps a Ctrl-C from cutting that cleanup short.
Nothing here imports LMCache or redis-py, so the tests' fixtures stay light.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

__all__ = ["Interrupts", "ServerProcess", "START_TIMEOUT_S", "STOP_TIMEOUT_S", "interrupts_held"]

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class ServerProcess:
    """A child process whose output is kept and scanned for a readiness line (``ready``, searched per line)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        ready: re.Pattern[str] | None = None,
        *,
        cwd: Path = REPO,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.ready_re = ready
        self.cwd = cwd
        self.preexec_fn = preexec_fn
        self.lines: list[str] = []
        self.match: re.Match[str] | None = None
        self.process: subprocess.Popen[str] | None = None
        self._ready = threading.Event()

    def start(self, env: dict[str, str] | None = None) -> ServerProcess:
        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=self.cwd,
            env=env,
            preexec_fn=self.preexec_fn,
        )
        self._pump_thread = threading.Thread(target=self._pump, name=f"{self.name}-output", daemon=True)
        self._pump_thread.start()
        return self

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:  # read to the end, so the child never blocks on a full pipe
            self.lines.append(line)
            if self.ready_re is not None and self.match is None:
                self.match = self.ready_re.search(line)
                if self.match:
                    self._ready.set()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> re.Match[str]:
        if not self._ready.wait(timeout_s) or self.match is None:
            self.stop()
            raise RuntimeError(f"{self.name} did not start within {timeout_s:.0f} s:\n{self.tail(30)}")
        return self.match

    def wait_port(self, port: int, timeout_s: float = START_TIMEOUT_S, *, required: bool = True) -> bool:
        """Wait until ``port`` accepts; False (or an error if ``required``) when it never does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if _listening(port):
                return True
            time.sleep(0.1)
        if not required:
            return False
        self.stop()
        raise RuntimeError(f"{self.name} did not listen on port {port} within {timeout_s:.0f} s:\n{self.tail()}")

    @property
    def log(self) -> str:
        """Everything it printed so far (stdout and stderr)."""
        return "".join(self.lines)

    def wait_exit(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Its exit code, once it exited and everything it printed is in ``lines``."""
        assert self.process is not None
        code = self.process.wait(timeout_s)
        self._pump_thread.join(10)
        return code

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        return "".join(self.lines[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Send ``sig`` if it still runs; SIGKILL if it has not exited within ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)


class Interrupts:
    """The Ctrl-Cs (SIGINT) received while :func:`interrupts_held` held them; true once there was one."""

    def __init__(self) -> None:
        self.count = 0

    def __bool__(self) -> bool:
        return self.count > 0

    def received(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1


@contextlib.contextmanager
def interrupts_held() -> Iterator[Interrupts]:
    """Hold Ctrl-C (SIGINT) while the block stops child processes, so a second one cannot cut it short and leave
    them running; the block may look at what it holds to hurry. Once it ends, a held Ctrl-C is raised as
    KeyboardInterrupt (where SIGINT was handled so). Outside the main thread, where no handler can be set, the
    block runs as is."""
    interrupts = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield interrupts
        return
    previous = signal.signal(signal.SIGINT, interrupts.received)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupts and callable(previous):
        previous(signal.SIGINT, None)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
