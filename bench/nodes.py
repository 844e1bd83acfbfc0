"""Pool nodes as child processes: the one launcher the tests and the benchmarks share.

A :class:`NodeProcess` runs ``kvpool node ARGS`` (``python -m backend.cli`` unless told
another command), keeps everything it prints, and is ready once it printed its
``kvpool node ID ready at HOST:PORT (epoch N)`` line, whose fields it then holds.
``start()`` waits for that line; ``spawn()`` and ``wait_ready()`` let a caller start
many nodes before waiting for any. It is stopped by its own pid, never by name.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NodeProcess", "READY_RE", "NODE_START_TIMEOUT_S", "STOP_TIMEOUT_S"]

REPO = Path(__file__).resolve().parent.parent
READY_RE = re.compile(r"kvpool node (\S+) ready at (\S+):(\d+) \(epoch (\d+)\)")  # backend/cli.py prints it
NODE_START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@dataclass
class NodeProcess:
    """A ``kvpool node`` child process; its output is kept (``output``, ``log``) for assertions and reports."""

    args: list[str]
    env: dict[str, str] | None = None  # None: this process's environment, with LMCache's usage tracking off
    max_open_files: int = 0
    command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "backend.cli"])  # the `kvpool` to run
    cwd: Path = REPO
    process: subprocess.Popen[str] | None = None
    node_id: str = ""
    host: str = ""
    port: int = 0
    epoch: int = 0
    output: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self, timeout_s: float = NODE_START_TIMEOUT_S) -> NodeProcess:
        """Start the node and wait until it is ready (RuntimeError with its last lines if it is not)."""
        return self.spawn().wait_ready(timeout_s)

    def spawn(self) -> NodeProcess:
        """Start the node without waiting for it."""
        env = self.env if self.env is not None else {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
        self.process = subprocess.Popen(
            [*self.command, "node", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self.cwd, env=env,
            preexec_fn=self._limit_files if self.max_open_files else None,
        )  # fmt: skip
        threading.Thread(target=self._pump, name="kvpool-node-output", daemon=True).start()
        return self

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:  # read to the end, so the node never blocks on a full pipe
            self.output.append(line)
            match = READY_RE.search(line)
            if match and not self._ready.is_set():
                self.node_id, self.host = match.group(1), match.group(2)
                self.port, self.epoch = int(match.group(3)), int(match.group(4))
                self._ready.set()

    def wait_ready(self, timeout_s: float = NODE_START_TIMEOUT_S) -> NodeProcess:
        if not self._ready.wait(timeout_s):
            self.kill()
            raise RuntimeError("node did not start:\n" + "".join(self.output[-30:]))
        return self

    def _limit_files(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (self.max_open_files, self.max_open_files))

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def memory(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak resident set) in bytes, from /proc; empty once the process is gone."""
        fields: dict[str, int] = {}
        try:
            with open(f"/proc/{self.pid}/status") as status:
                for line in status:
                    name, _, value = line.partition(":")
                    if name in ("VmRSS", "VmHWM"):
                        fields[name] = int(value.split()[0]) * 1024
        except OSError:
            pass
        return fields

    @property
    def log(self) -> str:
        return "".join(self.output)

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
