"""``kvpool up`` and its private redis-server, through the real processes.

The index behind Redis's own password: a client without it is refused by Redis (``ls``,
``evict``, ``status`` exit 1 and change nothing), one with ``redis_password_file=`` is served.
And the two lives tied together: a ``kill -9`` of ``kvpool up`` takes its redis-server
with it (its directory goes at the next start), and a dead redis-server stops ``kvpool up``
with exit status 1 and a message.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import Chunk, PoolConfig, SyncPoolClient
from tests.conftest import REPO
from tests.support.up import UpProcess
from tests.support.waits import wait_until

UP_TIMEOUT_S = 60.0
TOKEN = "tok-3b9d0c51e7a2" * 2  # 32 characters: no "weak token" warning in the CLI's one-line errors
PASSWORD = "pw-c40e9a7b1f36"
DEATH_DEADLINE_S = 5.0  # how soon a redis-server must follow its killed `kvpool up`


def _env() -> dict[str, str]:
    """This process's environment without kvpool's variables: the secrets come from where each test says."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}, "LMCACHE_TRACK_USAGE": "false"}


def _kvpool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**_env(), **(env or {})},
    )


class _Up(UpProcess):
    """``kvpool up`` (small, no NVMe, no shared memory), started and ready."""

    def __init__(self, *args: str) -> None:
        super().__init__(["--dram", "64MiB", "--nvme", "0", "--shm-dir", "off", *args])
        self.start(_env())
        self.wait_ready(UP_TIMEOUT_S)

    @property
    def proc(self) -> subprocess.Popen[str]:
        assert self.process is not None
        return self.process

    @property
    def text(self) -> str:
        return self.log

    @property
    def redis_port(self) -> int:
        return PoolConfig.from_url(self.url.split("?")[0]).redis_port

    @property
    def password_file(self) -> Path:
        match = re.search(r"redis_password_file=([^&\s]+)", self.url)
        assert match, self.url
        return Path(match.group(1))

    def redis_pid(self) -> int:
        (pid,) = [child for child in _children(self.proc.pid) if _command(child) == "redis-server"]
        return pid

    def stop(self) -> int:
        return self.interrupt()


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, ... ([] once the process is gone)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _children(pid: int) -> list[int]:
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [child for child in pids if _stat_fields(child)[1:2] == [str(pid)]]


def _command(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for init to reap it counts as exited)."""
    return _stat_fields(pid)[:1] in ([], ["Z"])


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _without_password(url: str) -> str:
    return re.sub(r"[?&]redis_password_file=[^&]*", "", url).replace("/default&", "/default?")


@pytest.mark.usefixtures("processes")
def test_a_token_pools_redis_refuses_a_client_without_the_password_and_serves_one_with_it(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)  # not readable by others: no warning either
    up = _Up("--token-file", str(token_file))
    try:
        url, password_file = up.url, up.password_file
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
        password = password_file.read_text().strip()
        assert len(password) >= 32 and password not in up.text
        with SyncPoolClient(PoolConfig.from_url(url)) as client:  # the node got the password: it registered
            client.put([Chunk("m@1", b"kept" * 100)])
        with socket.create_connection(("127.0.0.1", up.redis_port), timeout=5) as raw:  # Redis itself is the gate
            raw.sendall(b"SCAN 0\r\n")
            assert raw.recv(64).startswith(b"-NOAUTH")

        bare = _without_password(url)
        assert "redis_password_file" not in bare and "token_file" in bare  # the token alone opens nothing
        for verb in (["ls"], ["status"], ["evict", "m@1"]):
            out = _kvpool(*verb, "--url", bare)
            assert out.returncode == 1, (verb, out.stdout, out.stderr)
            assert out.stderr.strip().count("\n") == 0 and "Redis authentication refused" in out.stderr, out.stderr
            assert "redis_password_file=" in out.stderr and password not in out.stderr
            assert "m@1" not in out.stdout

        listed = _kvpool("ls", "--url", url)
        assert listed.returncode == 0 and listed.stdout.startswith("m@1 "), listed.stderr  # the index is untouched
        with SyncPoolClient(PoolConfig.from_url(url)) as client:
            assert bytes(client.get(["m@1"])[0].data) == b"kept" * 100
        assert _kvpool("status", "--url", bare, env={"KVPOOL_REDIS_PASSWORD": password}).returncode == 0
    finally:
        assert up.stop() == 0, up.text
    assert not password_file.exists()  # removed with the server's directory


@pytest.mark.usefixtures("processes")
def test_up_puts_its_redis_behind_the_password_of_redis_password_file(tmp_path):
    password_file = tmp_path / "redis-password"
    password_file.write_text(PASSWORD + "\n")
    up = _Up("--redis-password-file", str(password_file))
    try:
        assert up.password_file == password_file.resolve() and PASSWORD not in up.text
        assert _kvpool("ls", "--url", up.url).returncode == 0
        refused = _kvpool("ls", "--url", _without_password(up.url))
        assert refused.returncode == 1 and "Redis authentication refused" in refused.stderr
    finally:
        assert up.stop() == 0, up.text
    assert password_file.read_text() == PASSWORD + "\n"  # the user's file is theirs: kept


@pytest.mark.usefixtures("processes")
def test_kill_9_of_up_takes_its_redis_server_along_and_the_next_up_removes_its_directory():
    up = _Up()
    try:
        redis_pid, port = up.redis_pid(), up.redis_port
        directory = Path(os.readlink(f"/proc/{redis_pid}/cwd"))  # redis-server runs in its private directory
        assert directory.name.startswith("kvpool-redis-")
        up.proc.kill()
        up.wait_exit()
        alive = not wait_until(lambda: _gone(redis_pid), DEATH_DEADLINE_S)
        if alive:
            os.kill(redis_pid, signal.SIGKILL)  # this test's own leftover
        assert not alive, f"redis-server {redis_pid} outlived kvpool up by {DEATH_DEADLINE_S} s"
    finally:
        up.stop()
    assert not _listening(port)
    assert directory.is_dir()  # a kill -9 runs no cleanup: the next start does
    second = _Up()
    try:
        assert not directory.exists(), "the next kvpool up left the killed one's directory"
    finally:
        assert second.stop() == 0, second.text


@pytest.mark.usefixtures("processes")
def test_up_exits_1_and_stops_its_node_when_its_redis_server_dies():
    up = _Up()
    try:
        node_port = int(re.search(r", node \S+ at 127\.0\.0\.1:(\d+),", up.text).group(1))
        os.kill(up.redis_pid(), signal.SIGKILL)
        assert up.wait_exit(30) == 1, up.text
    finally:
        up.stop()
    last = up.lines[-1]
    assert last.startswith("kvpool: error: the pool's redis-server") and "killed by signal 9" in last, up.text
    assert "kvpool pool stopped." not in up.text
    assert not _listening(node_port)
