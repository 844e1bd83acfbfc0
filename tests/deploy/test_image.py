"""The node image (``make image``) run the way an operator runs it: ``make deploy-test``.

Redis and a pool node run in containers on the host's network, the token and the Redis
password mounted as files, the NVMe tier on a named volume. LMCache engines on the host
store and read through them, each in a fresh process (``bench.engine``); the node
container is then killed and a new one started on the same volume, and the chunks its
NVMe tier held are served again. See docs/image.md.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from backend.client import SyncPoolClient
from backend.embedded import free_port
from backend.errors import AuthError
from kvpool import PoolConfig
from tests.conftest import REPO
from tests.support.waits import wait_until

IMAGE = os.environ.get("DEPLOY_TEST_IMAGE", "localhost/kvpool-node:0.1.0")
BASE = os.environ.get("DEPLOY_TEST_BASE", "localhost/kvpool-base:bookworm")
# crun refuses this kind of host's hybrid cgroups, and podman's default ulimits may exceed the host's.
PODMAN_FLAGS = shlex.split(
    os.environ.get("DEPLOY_TEST_PODMAN_FLAGS", "--runtime runc --ulimit nofile=16384:16384 --ulimit nproc=16384:16384")
)
REDIS_IMAGE = "localhost/kvpool-test-redis:bookworm"
IMAGE_SIZE_LIMIT_BYTES = 350 * 10**6  # the target for a Debian minbase node image
NODE_UID = 10001  # deploy/Containerfile's user
NVME_IN_CONTAINER = "/var/lib/kvpool/nvme"
SECRETS_IN_CONTAINER = "/run/secrets/kvpool"
NAMESPACE = "deploy"
CHUNKS = 12  # 2 MiB each (bench.engine's default shape): 24 MiB through 8 MiB of DRAM reaches NVMe
NODE_DRAM = "8MiB"
NODE_START_TIMEOUT_S = 60.0

# The first run builds the Redis image (apt-get inside a container) and each engine imports torch.
pytestmark = pytest.mark.timeout(600)


def podman(*args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One podman command; a failure names the command and shows what podman said."""
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"podman {shlex.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
        )
    return proc


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text page, or None when it is absent."""
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


def engine(role: str, url: str, chunks: int) -> dict:
    """One LMCache engine on the host, in a fresh process: stores or reads ``chunks`` chunks."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine", role, url, "--chunks", str(chunks)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass
class Deployment:
    """Redis and one pool node in containers, on the host's network, sharing a run-unique name."""

    name: str
    secrets_dir: Path
    volume: str
    redis_port: int
    node_port: int
    metrics_port: int
    redis_password: str

    @property
    def node_container(self) -> str:
        return f"{self.name}-node"

    @property
    def redis_container(self) -> str:
        return f"{self.name}-redis"

    @property
    def pool_url(self) -> str:
        """What an engine on the host is given: secrets by file, never in the URL."""
        return (
            f"kvpool://127.0.0.1:{self.redis_port}/{NAMESPACE}?token_file={self.secrets_dir / 'token'}"
            f"&redis_password_file={self.secrets_dir / 'redis-password'}&connect_timeout_s=5&progress_timeout_s=5"
        )

    def get(self, path: str) -> tuple[int, str]:
        return http_get(f"http://127.0.0.1:{self.metrics_port}{path}")

    def start_redis(self) -> None:
        podman(
            "run",
            "-d",
            "--name",
            self.redis_container,
            *PODMAN_FLAGS,
            "--network",
            "host",
            REDIS_IMAGE,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.redis_port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            self.redis_password,
        )
        client = redis.Redis(port=self.redis_port, password=self.redis_password, socket_timeout=1)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        assert wait_until(answers, 30.0), podman("logs", self.redis_container, check=False).stderr[-2000:]

    def start_node(self) -> None:
        """The node container as docs/image.md runs it; returns once its /health answers 200."""
        podman(
            "run",
            "-d",
            "--name",
            self.node_container,
            *PODMAN_FLAGS,
            "--network",
            "host",
            "--shm-size",
            "128m",  # above the arena: --dram plus max(25 %, 64 MiB)
            "-v",
            f"{self.volume}:{NVME_IN_CONTAINER}",
            "-v",
            f"{self.secrets_dir}:{SECRETS_IN_CONTAINER}:ro",
            "-e",
            f"HEALTHCHECK_PORT={self.metrics_port}",
            "--health-interval",
            "disable",  # no systemd here to time it: the test runs it
            IMAGE,
            "--redis",
            f"redis://127.0.0.1:{self.redis_port}",
            "--redis-password-file",
            f"{SECRETS_IN_CONTAINER}/redis-password",
            "--token-file",
            f"{SECRETS_IN_CONTAINER}/token",
            "--namespace",
            NAMESPACE,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.node_port),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(self.metrics_port),
            "--dram",
            NODE_DRAM,
            "--nvme",
            "256MiB",
        )
        healthy = wait_until(lambda: self.get("/health")[0] == 200, NODE_START_TIMEOUT_S, 0.2)
        assert healthy, podman("logs", self.node_container, check=False).stderr[-4000:]

    def metrics(self) -> str:
        status, text = self.get("/metrics")
        assert status == 200, (status, text[-1000:])
        return text


@pytest.fixture(scope="module")
def redis_image(processes: None) -> str:
    podman(
        "build",
        *PODMAN_FLAGS,
        "--network",
        "host",
        "--build-arg",
        f"BASE={BASE}",
        "-t",
        REDIS_IMAGE,
        "-f",
        str(REPO / "tests" / "deploy" / "redis.Containerfile"),
        str(REPO / "tests" / "deploy"),
        timeout_s=600,
    )
    return REDIS_IMAGE


@pytest.fixture(scope="module")
def deployment(redis_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    name = f"kvpool-test-{uuid.uuid4().hex[:8]}"
    secrets_dir = tmp_path_factory.mktemp("secrets")
    password = secrets.token_hex(16)
    for file, value in (("token", secrets.token_hex(16)), ("redis-password", password)):
        (secrets_dir / file).write_text(value + "\n")
        os.chmod(secrets_dir / file, 0o444)  # the node runs as uid 10001; a Secret volume sets the mode the same way
    os.chmod(secrets_dir, 0o755)
    deployment = Deployment(name, secrets_dir, f"{name}-nvme", free_port(), free_port(), free_port(), password)
    podman("volume", "create", deployment.volume)
    try:
        deployment.start_redis()
        deployment.start_node()
        yield deployment
    finally:
        for container in (deployment.node_container, deployment.redis_container):
            podman("rm", "--force", "--ignore", "--time", "0", container, check=False)
        podman("volume", "rm", "-f", deployment.volume, check=False)


@pytest.mark.usefixtures("processes")  # podman is a process: the rule of tests/support/processes.py
def test_the_image_is_small_runs_as_its_own_user_and_holds_no_torch():
    size_bytes = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    print(f"{IMAGE}: {size_bytes} bytes ({size_bytes / 1e6:.0f} MB) uncompressed")
    assert size_bytes <= IMAGE_SIZE_LIMIT_BYTES
    inspected = json.loads(podman("image", "inspect", IMAGE).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == f"{NODE_UID}:{NODE_UID}"
    assert config["Entrypoint"][:2] == ["kvpool", "node"]
    assert NVME_IN_CONTAINER in config["Volumes"]
    assert "/health" in " ".join(inspected["Healthcheck"]["Test"])  # kept: built with --format docker
    for module in ("torch", "lmcache"):
        proc = podman(
            "run",
            "--rm",
            *PODMAN_FLAGS,
            "--network",
            "none",
            "--entrypoint",
            "python3",
            IMAGE,
            "-c",
            f"import {module}",
            check=False,
        )
        assert proc.returncode != 0 and f"No module named '{module}'" in proc.stderr, proc.stderr
    proc = podman("run", "--rm", *PODMAN_FLAGS, "--network", "none", "--entrypoint", "id", IMAGE, "-u")
    assert proc.stdout.strip() == str(NODE_UID)


def test_the_node_container_answers_health_and_metrics_and_its_healthcheck_passes(deployment):
    status, body = deployment.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    text = deployment.metrics()
    assert metric(text, "kvpool_node_healthy") == 1.0
    assert metric(text, "kvpool_node_tier_capacity_bytes", tier="dram") == 8 * 2**20
    assert metric(text, "kvpool_node_tier_capacity_bytes", tier="nvme") == 256 * 2**20
    # the node read its token from the mounted file: the pool's URL without it is refused
    without_token = deployment.pool_url.replace(f"token_file={deployment.secrets_dir / 'token'}&", "")
    with SyncPoolClient(PoolConfig.from_url(without_token)) as client:
        with pytest.raises(AuthError):
            client.node_stats(client.nodes()[0])
    # the image's own HEALTHCHECK, run by podman inside the container
    assert podman("healthcheck", "run", deployment.node_container, check=False).returncode == 0
    assert podman("exec", deployment.node_container, "id", "-u").stdout.strip() == str(NODE_UID)


def _nvme_files_settled(deployment: Deployment) -> float:
    """The node's NVMe file count once demotion has stopped (the same count on two scrapes 1 s apart)."""
    counts: list[float] = []

    def settled() -> bool:
        counts.append(metric(deployment.metrics(), "kvpool_node_tier_objects", tier="nvme") or 0.0)
        return len(counts) >= 2 and counts[-1] == counts[-2] and counts[-1] > 0

    assert wait_until(settled, 30.0, 1.0), counts
    return counts[-1]


def test_engines_round_trip_through_containers_and_nvme_chunks_survive_a_new_node_container(deployment):
    stored = engine("put", deployment.pool_url, CHUNKS)
    assert stored["hit_prefix"] == CHUNKS
    read = engine("get", deployment.pool_url, CHUNKS)  # a fresh engine: nothing in its own cache
    assert read["hits"] == CHUNKS and read["identical"] == CHUNKS
    on_nvme = _nvme_files_settled(deployment)
    node_id = re.search(r'kvpool_node_healthy\{node="([^"]+)"\}', deployment.metrics())
    assert node_id is not None

    podman("kill", deployment.node_container)  # SIGKILL: no clean shutdown, DRAM is lost
    podman("rm", "-f", deployment.node_container)
    started = time.monotonic()
    deployment.start_node()  # a new container on the same NVMe volume
    print(
        f"{on_nvme:.0f} of {CHUNKS} chunks on NVMe; a new node container was healthy in {time.monotonic() - started:.1f} s"
    )
    text = deployment.metrics()
    assert metric(text, "kvpool_node_recovery_files", node=node_id.group(1)) == on_nvme  # same id, kept on NVMe

    again = engine("get", deployment.pool_url, CHUNKS)
    assert again["hits"] == on_nvme and again["identical"] == on_nvme
    assert on_nvme >= CHUNKS // 2  # 24 MiB through 8 MiB of DRAM: most of it had reached NVMe
    reads = metric(deployment.metrics(), "kvpool_node_nvme_reads_total")
    assert reads is not None and reads >= on_nvme
