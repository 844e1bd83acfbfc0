"""The host bed itself: hosts apart, a partition is silent, and nothing is left behind, even after a kill."""

from __future__ import annotations

import subprocess
import sys

from bench.hosts.bed import PREFIX, _namespaces
from tests.conftest import REPO

PROBE = """
import socket, sys, time
start = time.monotonic()
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), 1.0).close()
    print("connected")
except TimeoutError:
    print("timeout", round(time.monotonic() - start, 2))
except OSError as exc:
    print("error", exc)
"""


def test_hosts_have_their_own_hostname_and_shm_and_a_partition_is_a_silent_blackhole(bed_factory):
    bed = bed_factory(["server", "client"])
    redis = bed.start_redis("server")
    seen = bed.run_python("client", "import os, socket; print(socket.gethostname(), os.listdir('/dev/shm'))")
    assert seen.stdout.split()[0] == "client" and "[]" in seen.stdout
    assert bed.run_python("client", PROBE, redis.address, str(redis.port)).stdout.strip() == "connected"
    bed.partition("client", "server")
    assert bed.run_python("client", PROBE, redis.address, str(redis.port)).stdout.startswith("timeout")  # no RST
    bed.heal("client", "server")
    assert bed.run_python("client", PROBE, redis.address, str(redis.port)).stdout.strip() == "connected"
    assert "drop" not in bed.rules()


def test_a_killed_run_leaves_namespaces_that_the_next_bed_removes(bed_factory):
    code = "import os; from bench.hosts.bed import HostBed; bed = HostBed(['lost']); print(bed.owner, flush=True); os._exit(0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    owner = proc.stdout.strip()
    assert owner.startswith(PREFIX) and any(n.startswith(owner) for n in _namespaces()), proc.stderr
    bed_factory(["next"])
    assert not any(n.startswith(owner) for n in _namespaces())
