"""A private redis-server on a free loopback port, for ``kvpool up``, the demo and tests.

Its lifetime, for ``kvpool up`` (``die_with_parent=True``):

* the server gets SIGKILL from the kernel when the process that started it dies, even by
  ``kill -9`` (Linux ``prctl(PR_SET_PDEATHSIG)``, set in the child between fork and exec;
  redis-server cannot watch its parent itself). The signal follows the *thread* that
  started it, so start it from a thread that lives as long as the process (the main one);
* it runs in a session of its own, so a Ctrl-C in the terminal reaches ``kvpool up``
  only, which stops its node first and the server last;
* its private directory (log, config, password file) holds ``owner.pid``; a ``kill -9``
  cannot run cleanup, so :func:`remove_orphaned_dirs`, called by the next ``kvpool up``,
  removes the directories whose owner is gone;
* :meth:`EmbeddedRedis.wait_exit` tells the owner when the server dies.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from backend.errors import MetadataError

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedRedis", "free_port", "remove_orphaned_dirs"]

START_TIMEOUT_S = 10.0
EXIT_POLL_INTERVAL_S = 0.2  # how soon wait_exit notices a dead server
DIR_PREFIX = "kvpool-redis-"
OWNER_FILE = "owner.pid"  # the pid of the process that started the server, for remove_orphaned_dirs
CONFIG_FILE = "redis.conf"  # mode 0600: holds the password, which stays off the command line (ps shows argv)
PRIVATE_FILE_MODE = 0o600
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _death_signal_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when the thread that forks it dies; None off Linux.

    libc is looked up here, in the parent: between fork and exec the child only calls it.
    A parent that died before the call is caught by comparing the parent pid afterwards.
    Without Linux's prctl the server outlives a ``kill -9`` of its owner (a clean stop still stops it).
    """
    if not sys.platform.startswith("linux"):
        logger.warning("redis-server will not die with this process on %s (no prctl PR_SET_PDEATHSIG)", sys.platform)
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def set_death_signal() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent is already gone: the signal will never come
            os.kill(os.getpid(), signal.SIGKILL)

    return set_death_signal


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 from the start (never readable by others, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w") as file:
        file.write(text)


def _config_string(text: str) -> str:
    """``text`` as one quoted redis.conf argument: every byte as ``\\xHH``, so no character can end it."""
    return '"' + "".join(f"\\x{byte:02x}" for byte in text.encode()) + '"'


def remove_orphaned_dirs(root: str | Path | None = None) -> list[Path]:
    """Remove the private directories of servers whose owner died without cleanup (``kill -9``); returns them.

    Only this user's directories with an ``owner.pid`` naming a process that no longer
    exists are touched: their server died with its owner. A reused pid keeps a directory
    until a later start; a directory without ``owner.pid`` is left alone.
    """
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(DIR_PREFIX + "*"):
        try:
            if path.lstat().st_uid != os.getuid() or not path.is_dir() or path.is_symlink():
                continue
            owner = int((path / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if owner <= 0 or _alive(owner):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process holds the pid
    return True


class EmbeddedRedis:
    """redis-server as a child process: no persistence, loopback only.

    ``tls=(cert, key, ca)`` serves TLS only on ``port`` (plaintext off, no client
    certificates asked); ``args`` are passed on to redis-server (``--user ...``);
    ``die_with_parent`` ties the server's life to this process's (module docstring).
    """

    def __init__(
        self,
        port: int = 0,
        *,
        binary: str = "redis-server",
        tls: tuple[Path, Path, Path] | None = None,
        args: Sequence[str] = (),
        die_with_parent: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.binary = binary
        self.tls = tls
        self.args = list(args)
        self.die_with_parent = die_with_parent
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix=DIR_PREFIX)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def directory(self) -> Path:
        """The server's private directory (mode 0700): its log, config and any :meth:`write_secret` file."""
        return Path(self._dir.name)

    def write_secret(self, name: str, secret: str) -> Path:
        """Write ``secret`` to a mode-0600 file ``name`` in :attr:`directory` (removed with it); its path."""
        path = self.directory / name
        _write_private(path, secret + "\n")
        return path

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        cert, key, ca = self.tls
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(ca),
            "--tls-auth-clients",
            "no",
        ]

    def _answers(self) -> bool:
        """Whether redis-server answers PING (NOAUTH counts: an ACL server is up too)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as raw:
            if self.tls is None:
                sock: socket.socket = raw
            else:
                sock = ssl.create_default_context(cafile=str(self.tls[2])).wrap_socket(raw, server_hostname="127.0.0.1")
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))

    def start(self, *, password: str = "") -> EmbeddedRedis:
        """Start the server and wait until it answers; ``password``: the one clients must give (``requirepass``)."""
        path = shutil.which(self.binary)
        if path is None:
            raise MetadataError(
                "redis-server is not installed: `apt-get install -y redis-server` (or pass --redis URL)"
            )
        log = self.directory / "redis.log"
        config = self.directory / CONFIG_FILE
        config.unlink(missing_ok=True)  # a restart writes it afresh, mode 0600
        _write_private(config, f"requirepass {_config_string(password)}\n" if password else "")
        (self.directory / OWNER_FILE).write_text(f"{os.getpid()}\n")
        try:
            self.process = subprocess.Popen(
                [
                    path,
                    str(config),
                    *self._listen_args(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.directory),
                    "--logfile",
                    str(log),
                    *self.args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=self.die_with_parent,
                preexec_fn=_death_signal_setter() if self.die_with_parent else None,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise MetadataError(f"cannot start redis-server: {exc}") from None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                detail = log.read_text()[-500:] if log.exists() else ""
                raise MetadataError(f"redis-server exited at start on port {self.port}: {detail}")
            try:
                if self._answers():
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise MetadataError(f"redis-server did not answer on port {self.port} within {START_TIMEOUT_S} s")

    async def wait_exit(self, poll_interval_s: float = EXIT_POLL_INTERVAL_S) -> int:
        """Wait, without blocking the event loop, until the started server exits; its exit status."""
        process = self.process
        if process is None:
            raise MetadataError("redis-server was not started")
        while (code := process.poll()) is None:
            await asyncio.sleep(poll_interval_s)
        return code

    def log_tail(self, max_chars: int = 300) -> str:
        """The end of the server's log, for an error message ("" if there is none)."""
        try:
            return (self.directory / "redis.log").read_text(errors="replace")[-max_chars:].strip()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
