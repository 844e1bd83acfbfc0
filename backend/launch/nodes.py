"""Pool nodes as child processes: the one launcher the tests and the benchmarks share.

A :class:`NodeProcess` runs ``kvpool node ARGS`` (``python -m backend.cli`` unless told
another command), keeps everything it prints, and is ready once it printed its
``kvpool node ID ready at HOST:PORT (epoch N)`` line, whose fields it then holds.
``start()`` waits for that line; ``spawn()`` and ``wait_ready()`` let a caller start
many nodes before waiting for any. It is a :class:`backend.launch.processes.ServerProcess`,
stopped by its own pid, never by name.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from backend.launch.processes import REPO, STOP_TIMEOUT_S, ServerProcess

__all__ = ["NodeProcess", "READY_RE", "NODE_START_TIMEOUT_S", "STOP_TIMEOUT_S"]

READY_RE = re.compile(r"kvpool node (\S+) ready at (\S+):(\d+) \(epoch (\d+)\)")  # backend/cli/serve.py prints it
NODE_START_TIMEOUT_S = 30.0


class NodeProcess(ServerProcess):
    """A ``kvpool node`` child process; its output is kept (``output``, ``log``) for assertions and reports."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        max_open_files: int = 0,
        *,
        command: Sequence[str] = (sys.executable, "-m", "backend.cli"),
        cwd: Path = REPO,
    ) -> None:
        """``env`` None: this process's environment, with LMCache's usage tracking off; ``command``: the `kvpool` to run."""
        super().__init__(
            "kvpool node",
            [*command, "node", *args],
            READY_RE,
            cwd=cwd,
            preexec_fn=self._limit_files if max_open_files else None,
        )
        self.args = args
        self.env = env
        self.max_open_files = max_open_files
        self.node_id = ""
        self.host = ""
        self.port = 0
        self.epoch = 0

    @property
    def namespace(self) -> str:
        """The namespace the node was started in (``--namespace``; else the default)."""
        return self.args[self.args.index("--namespace") + 1] if "--namespace" in self.args else "default"

    def start(self, timeout_s: float = NODE_START_TIMEOUT_S) -> NodeProcess:  # type: ignore[override]
        """Start the node and wait until it is ready (RuntimeError with its last lines if it is not)."""
        return self.spawn().wait_ready(timeout_s)

    def spawn(self) -> NodeProcess:
        """Start the node without waiting for it."""
        super().start(self.env if self.env is not None else {**os.environ, "LMCACHE_TRACK_USAGE": "false"})
        return self

    def wait_ready(self, timeout_s: float = NODE_START_TIMEOUT_S) -> NodeProcess:  # type: ignore[override]
        match = super().wait_ready(timeout_s)
        self.node_id, self.host = match.group(1), match.group(2)
        self.port, self.epoch = int(match.group(3)), int(match.group(4))
        return self

    def _limit_files(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (self.max_open_files, self.max_open_files))

    @property
    def output(self) -> list[str]:
        return self.lines

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def memory(self) -> dict[str, int]:
        """VmRSS, VmHWM (peak resident set), RssAnon (private memory) and RssShmem (shared memory
        touched: an arena in /dev/shm) in bytes, from /proc; empty once the process is gone."""
        fields: dict[str, int] = {}
        try:
            with open(f"/proc/{self.pid}/status") as status:
                for line in status:
                    name, _, value = line.partition(":")
                    if name in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                        fields[name] = int(value.split()[0]) * 1024
        except OSError:
            pass
        return fields

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (a clean shutdown) and wait for the exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)
