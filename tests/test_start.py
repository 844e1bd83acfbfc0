"""A wrong setup stops a node before it costs anything, and a start that fails leaves nothing behind.

Real redis-servers (one behind ``requirepass``) and real ``kvpool node`` processes
(``backend.launch.nodes.NodeProcess``), each given a 2 GiB DRAM tier to prefault. Every node gets a
shared-memory directory of its own under /dev/shm (its arena's place) and an NVMe directory
that does not exist yet: after a failed start the first must be empty again and the second
absent, and no file named for the node's pid (``kvpool-PID-*``, ``backend/shm.py``) may be
left in /dev/shm. The start order these rely on is ``backend/node/startup.py``'s.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from backend.embedded import EmbeddedRedis, free_port
from backend.launch.nodes import NodeProcess
from tests.support.waits import wait_until

PASSWORD = "start-order-password-0123456789"
TOKEN = "start-order-token-0123456789abcdef"
WRONG = "guess-0123456789"
# What a wrong setup may cost beyond the command's own start (the interpreter and kvpool's imports,
# measured in the same test, since a loaded machine stretches it): Redis's answer and the exit. A
# node that prefaulted its 2 GiB before checking would take seconds more (fresh pages ~0.4 GB/s).
LIMIT_S = 1.5
SHM_ROOT = Path("/dev/shm")


@dataclasses.dataclass(frozen=True)
class Places:
    shm_dir: Path  # the node's --shm-dir: empty, under /dev/shm
    nvme_dir: Path  # the node's --nvme-dir: not made yet, nor its parent

    def left_by(self, node: NodeProcess) -> list[str]:
        """What the node left of its start: files in its shm directory, its NVMe directory, its pid's
        files in /dev/shm."""
        left = [str(p) for p in self.shm_dir.iterdir()]
        left += [str(self.nvme_dir.parent)] if self.nvme_dir.parent.exists() else []
        return left + [n for n in os.listdir(SHM_ROOT) if n.startswith(f"kvpool-{node.pid}-")]


@pytest.fixture(scope="module")
def locked_redis(processes: None) -> Iterator[EmbeddedRedis]:
    """A redis-server that requires PASSWORD of the default user."""
    server = EmbeddedRedis().start(password=PASSWORD)
    yield server
    server.cleanup()


@pytest.fixture
def places(tmp_path: Path) -> Iterator[Places]:
    with tempfile.TemporaryDirectory(dir=SHM_ROOT, prefix="start-test-") as shm_dir:
        yield Places(Path(shm_dir), tmp_path / "new" / "nvme")


def _secret(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def _node(redis_url: str, namespace: str, places: Places, *extra: str, dram: str = "2GiB") -> NodeProcess:
    """A node with a DRAM tier to prefault and a new NVMe directory, not started yet."""
    args = ["--redis", redis_url, "--namespace", namespace, "--dram", dram, "--prefault", "on"]
    args += ["--shm-dir", str(places.shm_dir), "--nvme-dir", str(places.nvme_dir), "--nvme", "1GiB", *extra]
    return NodeProcess(args)


def _command_start_s() -> float:
    """Seconds ``kvpool node --help`` takes: the command's own start, with every import a node's start makes."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "backend.cli", "node", "--help"], capture_output=True, check=True)
    return time.monotonic() - started


def _failed_start(node: NodeProcess, timeout_s: float = 30.0) -> tuple[int, float, str]:
    """Start ``node`` and wait for it to exit: its exit code, the seconds from spawn to exit beyond the
    command's own start (``_command_start_s``, measured just before), its last line."""
    own_start_s = _command_start_s()
    started = time.monotonic()
    node.spawn()
    code = node.wait_exit(timeout_s)
    return code, time.monotonic() - started - own_start_s, node.lines[-1].strip() if node.lines else ""


def _password_file(tmp_path: Path, given: str) -> list[str]:
    return ["--redis-password-file", str(_secret(tmp_path, "redis-password", WRONG))] if given == "wrong" else []


# -- Redis ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("given", ["wrong", "none"])
def test_a_node_refused_by_redis_exits_at_once_naming_the_password_and_leaves_nothing(
    locked_redis, places, namespace, tmp_path, given
):
    node = _node(locked_redis.url, namespace, places, *_password_file(tmp_path, given))
    code, seconds, last = _failed_start(node)
    assert code == 1, node.log
    if given == "wrong":
        assert last.startswith("kvpool: error: Redis refused the password (")
        assert str(tmp_path / "redis-password") in last  # where it came from, never what it is
    else:
        assert last.startswith(f"kvpool: error: Redis at {locked_redis.url} requires a password")
        assert "--redis-password-file" in last
    assert WRONG not in node.log and PASSWORD not in node.log
    assert "DRAM arena" not in node.log and "claiming node id" not in node.log, node.log  # checked first
    assert seconds < LIMIT_S, (seconds, node.log)
    assert places.left_by(node) == []


@pytest.mark.usefixtures("processes")
def test_a_node_whose_redis_is_unreachable_exits_at_once_naming_the_address(places, namespace):
    url = f"redis://127.0.0.1:{free_port()}/0"
    node = _node(url, namespace, places)
    code, seconds, last = _failed_start(node)
    assert code == 1 and last.startswith(f"kvpool: error: Redis at {url} is unreachable ("), node.log
    assert seconds < LIMIT_S, (seconds, node.log)
    assert places.left_by(node) == []


def test_a_node_takes_no_memory_while_it_waits_for_a_redis_that_does_not_answer(redis_factory, places, namespace):
    """A stopped Redis accepts the connection and never answers: the node waits out its Redis timeout
    (2 s) having made nothing, neither the arena nor the NVMe directory, then says Redis did not answer."""
    server = EmbeddedRedis().start()
    redis_factory.append(server)
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        node = _node(server.url, namespace, places).spawn()
        seen: list[str] = []
        while node.alive():
            seen += places.left_by(node)
            time.sleep(0.05)
        code = node.wait_exit()
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert seen == [] and places.left_by(node) == []
    assert code == 1 and "did not answer" in node.lines[-1], node.log


@pytest.mark.usefixtures("processes")
def test_a_redis_older_than_7_is_named_with_its_version(places, namespace):
    with _OldRedis("6.2.14") as old:
        node = _node(f"redis://127.0.0.1:{old.port}/0", namespace, places)
        code, _, last = _failed_start(node)
    assert code == 1, node.log
    assert "is version 6.2.14; kvpool needs Redis 7.0 or newer" in last, node.log
    assert places.left_by(node) == []


def test_a_redis_that_does_not_let_the_node_write_its_namespace_is_named(
    locked_redis, redis_server, redis_factory, places, namespace, tmp_path
):
    with redis.Redis(port=locked_redis.port, password=PASSWORD) as raw:  # an ACL user kept to other keys
        raw.execute_command("ACL", "SETUSER", "elsewhere", "on", f">{PASSWORD}", "~other:*", "+@all")
    password_file = _secret(tmp_path, "elsewhere-password", PASSWORD)
    url = f"redis://elsewhere@127.0.0.1:{locked_redis.port}/0"
    node = _node(url, namespace, places, "--redis-password-file", str(password_file))
    code, _, last = _failed_start(node)
    assert code == 1 and f"does not let this node write the keys of namespace '{namespace}'" in last, node.log
    assert places.left_by(node) == []

    replica = EmbeddedRedis(args=["--replicaof", "127.0.0.1", str(redis_server.port)]).start()
    redis_factory.append(replica)
    node = _node(replica.url, namespace, places)
    code, _, last = _failed_start(node)
    assert code == 1 and "does not let this node write" in last and "read only replica" in last, node.log
    assert places.left_by(node) == []


# -- secrets and local settings -----------------------------------------------------------------------
@pytest.mark.parametrize("token", ["missing", "empty", "short"])
def test_a_bad_token_file_stops_the_node_before_redis_naming_the_file(locked_redis, places, namespace, tmp_path, token):
    path = tmp_path / "token"
    if token != "missing":
        _secret(tmp_path, "token", "" if token == "empty" else "short")
    password = _secret(tmp_path, "redis-password", PASSWORD)
    node = _node(locked_redis.url, namespace, places, "--token-file", str(path), "--redis-password-file", str(password))
    code, seconds, last = _failed_start(node)
    assert code == 2 and last.startswith("kvpool: error: --token-file") and str(path) in last, node.log
    assert "Redis at" not in node.log  # refused before Redis was asked anything
    assert seconds < LIMIT_S, (seconds, node.log)
    assert places.left_by(node) == []


@pytest.mark.usefixtures("processes")
def test_a_taken_listen_port_leaves_no_arena_behind(redis_server, places, namespace):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        node = _node(redis_server.url, namespace, places, "--port", str(taken.getsockname()[1]))
        code, _, last = _failed_start(node)
    assert code == 1 and last.startswith("kvpool: error: port: cannot listen on 127.0.0.1:"), node.log
    assert places.left_by(node) == []


@pytest.mark.usefixtures("processes")
def test_a_start_failing_after_the_claim_gives_back_the_claim_the_arena_and_the_new_nvme_directory(
    redis_server, places, namespace
):
    """The metrics port opens once the arena is taken: a taken one fails the start after the claim, the NVMe
    directory and the arena were made. All of it is given back; Redis keeps no heartbeat or entry of it."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        node = _node(redis_server.url, namespace, places, "--metrics-port", str(port), dram="64MiB")
        code, _, last = _failed_start(node)
    assert code == 1 and last.startswith("kvpool: error: metrics_port: cannot listen"), node.log
    assert "claiming node id" in node.log and "took" in node.log  # it failed after the claim and the arena
    assert places.left_by(node) == []
    with redis.Redis(port=redis_server.port) as raw:
        assert raw.keys(f"kvp:{{{namespace}}}:hb:*") == [] and raw.hlen(f"kvp:{{{namespace}}}:nodes") == 0


@pytest.mark.usefixtures("processes")
def test_sigterm_while_a_node_prefaults_gives_back_its_arena_and_exits_143(redis_server, places, namespace):
    node = _node(redis_server.url, namespace, places).spawn()
    try:
        assert wait_until(lambda: "taking" in node.log or not node.alive(), 30.0), node.log
        assert node.alive(), node.log
        assert [p.suffix for p in places.shm_dir.iterdir()] == [".arena"]  # being prefaulted
        node.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        code = node.wait_exit(30.0)
    finally:
        node.kill()
    assert code == 143 and "stopped by SIGTERM while starting" in node.log, node.log
    assert places.left_by(node) == []


class _OldRedis:
    """A server that answers as Redis 6 would the calls a node makes first (PING, INFO server) and refuses
    the rest: no Redis older than 7 is installed here, and its version is what the node must name."""

    def __init__(self, version: str) -> None:
        self.version = version
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> _OldRedis:
        self._threads.append(threading.Thread(target=self._accept, daemon=True))
        self._threads[0].start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        info = f"# Server\r\nredis_version:{self.version}\r\nredis_mode:standalone\r\n".encode()
        with conn, conn.makefile("rb") as stream:
            while command := _read_command(stream):
                name = command[0].upper()
                if name == b"PING":
                    conn.sendall(b"+PONG\r\n")
                elif name == b"INFO":
                    conn.sendall(b"$%d\r\n%s\r\n" % (len(info), info))
                else:
                    conn.sendall(b"-ERR unknown command '%s'\r\n" % name)


def _read_command(stream: object) -> list[bytes]:
    """One RESP array of bulk strings (what redis-py sends), or [] at the end of the stream."""
    header = stream.readline()  # type: ignore[attr-defined]
    if not header.startswith(b"*"):
        return []
    parts = []
    for _ in range(int(header[1:])):
        length = int(stream.readline()[1:])  # type: ignore[attr-defined]
        parts.append(stream.read(length + 2)[:-2])  # type: ignore[attr-defined]
    return parts
