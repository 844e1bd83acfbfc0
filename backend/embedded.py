"""A private redis-server on a free loopback port, for ``kvpool up``, the demo and tests."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from backend.errors import MetadataError

__all__ = ["EmbeddedRedis", "free_port"]

START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """redis-server as a child process: no persistence, loopback only.

    ``tls=(cert, key, ca)`` serves TLS only on ``port`` (plaintext off, no client
    certificates asked); ``args`` are passed on to redis-server (``--user ...``).
    """

    def __init__(
        self, port: int = 0, *, binary: str = "redis-server", tls: tuple[Path, Path, Path] | None = None,
        args: Sequence[str] = (),
    ) -> None:  # fmt: skip
        self.port = port or free_port()
        self.binary = binary
        self.tls = tls
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kvpool-redis-")

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        cert, key, ca = self.tls
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert), "--tls-key-file",
                str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]  # fmt: skip

    def _answers(self) -> bool:
        """Whether redis-server answers PING (NOAUTH counts: an ACL server is up too)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as raw:
            if self.tls is None:
                sock: socket.socket = raw
            else:
                sock = ssl.create_default_context(cafile=str(self.tls[2])).wrap_socket(raw, server_hostname="127.0.0.1")
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))

    def start(self) -> EmbeddedRedis:
        path = shutil.which(self.binary)
        if path is None:
            raise MetadataError(
                "redis-server is not installed: `apt-get install -y redis-server` (or pass --redis URL)"
            )
        log = Path(self._dir.name) / "redis.log"
        self.process = subprocess.Popen(
            [path, *self._listen_args(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir.name, "--logfile", str(log), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
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
