"""The ``kvpool`` command as tests run it (``python -m backend.cli`` from this checkout), and the quickstart's URL."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["QUICKSTART_PASSWORD_FILE", "QUICKSTART_URL", "events_addresses", "kvpool", "quickstart_url"]

REPO = Path(__file__).resolve().parents[2]


def kvpool(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``kvpool ARGS`` run to its end, its output kept (a process: the calling test requests ``processes``)."""
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


QUICKSTART_PASSWORD_FILE = (
    "/tmp/kvpool-redis-XXXX/redis-password"  # where `kvpool up` keeps it, as the quickstart shows
)
QUICKSTART_URL = f"kvpool://127.0.0.1:6379/default?redis_password_file={QUICKSTART_PASSWORD_FILE}"


def quickstart_url(tmp_path: Path) -> tuple[str, str]:
    """The quickstart's URL with its password file made in ``tmp_path``: (the URL to run, that file's path)."""
    password = tmp_path / "redis-password"
    password.write_text("a-password-for-the-quickstart\n")
    password.chmod(0o600)
    return QUICKSTART_URL.replace(QUICKSTART_PASSWORD_FILE, str(password)), str(password)


async def events_addresses(proc: subprocess.Popen[str], count: int) -> list[str]:
    """The addresses a running ``kvpool events`` says it bound, in the order it says them (its first ``count`` lines)."""
    lines: list[str] = []
    async with asyncio.timeout(60):
        while len(lines) < count:
            line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
            assert line, f"kvpool events ended: {proc.stderr.read() if proc.stderr else ''}"
            lines.append(line.strip())
    return [line.rsplit(" on ", 1)[1] for line in lines]
