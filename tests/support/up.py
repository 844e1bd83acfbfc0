"""``kvpool up`` as a child process, for the tests of the one-command pool (``backend.launch.processes`` runs it)."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from backend.launch.processes import REPO, STOP_TIMEOUT_S, ServerProcess

__all__ = ["UpProcess"]

UP_READY_RE = re.compile(r"^Ctrl-C stops the pool\.")  # backend/cli/serve.py prints it after the URL and config
POOL_URL_RE = re.compile(r"Pool URL:\n  (\S+)")


class UpProcess(ServerProcess):
    """``kvpool up ARGS`` as a child process, ready once it printed its pool URL and LMCache config."""

    def __init__(
        self, args: Sequence[str], *, command: Sequence[str] = (sys.executable, "-m", "backend.cli"), cwd: Path = REPO
    ) -> None:
        super().__init__("kvpool up", [*command, "up", *args], UP_READY_RE, cwd=cwd)

    @property
    def url(self) -> str:
        """The pool URL it printed."""
        match = POOL_URL_RE.search(self.log)
        assert match, self.log
        return match.group(1)

    def interrupt(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Ctrl-C, as a user stops it; returns its exit code (it is killed if it has not stopped in time)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.wait_exit(timeout_s)
        finally:
            self.kill()
