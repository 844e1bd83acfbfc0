"""One node process per NVMe directory: an exclusive lock held for the process's life.

The node id's claim in Redis keeps two processes from serving under one id; it does not keep
two processes with different ids (or two fresh starts that each made up an id) from sharing
one NVMe directory, where each would take the other's files for its own, remove its temp
files and evict its chunks. So before a node reads the directory (its kept id, its files),
it takes ``flock(LOCK_EX | LOCK_NB)`` on ``.kvpool-node.lock`` there and keeps it until it
exits; the kernel lets go at any death, ``kill -9`` included, so a crashed node's restart
finds the lock free. The file says which process holds it, for the refusal's message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from backend.errors import ConfigError

__all__ = ["LOCK_NAME", "DirectoryLock"]

LOCK_NAME = ".kvpool-node.lock"


class DirectoryLock:
    """The held lock of one NVMe directory; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, root: Path) -> None:
        """Take the lock; ConfigError naming the holder if another process holds it."""
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(
                "--nvme-dir",
                f"{root} is in use by another node process ({holder}): one node per NVMe directory; give this "
                "node a directory of its own",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
