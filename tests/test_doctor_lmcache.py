"""``kvpool doctor --lmcache-config``: light enough for a small engine host, quiet, and one cause per mistake.

The doctor builds LMCache from the config it checks, as an engine would, but with the
memory settings a probe needs: a test runs it as its own process against a real pool
and measures that process's peak resident memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from backend.doctor.memory import MemoryLimit, check_cache_size, memory_limit
from tests.conftest import REPO
from tests.support.cli import kvpool

MIB = 2**20
GIB = 2**30
PEAK_RSS_LIMIT_BYTES = 600 * MIB  # issue #47: the check must fit a small engine host
DOCTOR_TIME_LIMIT_S = 15.0  # loose: most of it is importing torch and LMCache

# Runs doctor as its child, then prints the child's peak RSS and wall time as the last line.
MEASURE = textwrap.dedent(
    """
    import json, resource, subprocess, sys, time
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "backend.cli", *sys.argv[1:]], capture_output=True, text=True)
    took = time.monotonic() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({"code": done.returncode, "out": done.stdout, "err": done.stderr, "peak": peak, "s": took}))
    """
)


def _measured_doctor(*args: str) -> dict[str, object]:
    """``kvpool doctor ARGS`` as a process of its own: exit code, stdout, stderr, peak RSS (bytes), seconds."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, "doctor", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def _config(url: str, tmp_path: Path, name: str, **changes: object) -> Path:
    out = kvpool("lmcache-config", "--url", url)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    for key, value in changes.items():
        if key.startswith("remote_storage_plugin."):
            config["extra_config"][key] = value
        else:
            config[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def _finding(findings: list[dict[str, str]], check: str) -> dict[str, str]:
    [found] = [f for f in findings if f["check"] == check]
    return found


def test_doctor_builds_lmcache_with_a_probe_sized_buffer_and_stays_under_600_mb(node_factory, pool_url, tmp_path):
    node_factory(shm=True)  # same host: the probe must not map the node's arena either
    path = _config(pool_url, tmp_path, "lmcache.yaml")
    assert yaml.safe_load(path.read_text())["max_local_cpu_size"] == 5.0  # what `kvpool lmcache-config` prints

    run = _measured_doctor("--lmcache-config", str(path), "--json")
    findings = json.loads(str(run["out"]))
    print(f"doctor --lmcache-config: {run['s']:.1f} s, peak RSS {int(str(run['peak'])) / MIB:.0f} MiB")
    assert run["code"] == 0, findings
    assert int(str(run["peak"])) <= PEAK_RSS_LIMIT_BYTES
    assert float(str(run["s"])) <= DOCTOR_TIME_LIMIT_S
    # what LMCache itself allocated for the probe, not the 5 GiB the config asks an engine for
    trip = _finding(findings, "round trip")
    assert trip["state"] == "ok" and "CPU buffer of 16.0 MiB for the probe" in trip["detail"], trip
    memory = _finding(findings, "LMCache memory")
    assert memory["state"] == "ok" and "max_local_cpu_size 5.0 GiB fits" in memory["detail"], memory
    assert run["err"] == ""  # LMCache's INFO lines (its whole config, each backend) are not shown


def test_doctor_warns_when_the_cache_exceeds_the_hosts_memory_and_shows_lmcache_logs_only_when_verbose(
    node_factory, pool_url, tmp_path
):
    node_factory()
    limit = memory_limit()
    too_big_gib = 2 * limit.limit_bytes // GIB + 1
    path = _config(pool_url, tmp_path, "big.yaml", max_local_cpu_size=float(too_big_gib))

    run = _measured_doctor("--lmcache-config", str(path), "--json", "--verbose")
    findings = json.loads(str(run["out"]))
    assert run["code"] == 0, findings  # a warning fails nothing: the probe still ran, small
    memory = _finding(findings, "LMCache memory")
    assert memory["state"] == "warn" and f"max_local_cpu_size is {too_big_gib}.0 GiB" in memory["detail"]
    assert limit.source in memory["detail"] and "lower max_local_cpu_size" in memory["fix"]
    assert int(str(run["peak"])) <= PEAK_RSS_LIMIT_BYTES
    err = str(run["err"])
    assert "LMCache INFO: Loading config file" in err  # --verbose shows LMCache's own log ...
    assert "\x1b[" not in err  # ... uncoloured, stderr being a pipe


def test_a_misspelt_plugin_class_is_one_failure_whose_fix_names_the_key(node_factory, pool_url, tmp_path):
    node_factory()
    key = "remote_storage_plugin.kvpool.class_name"
    path = _config(pool_url, tmp_path, "typo.yaml", **{key: "KVPoolConnectorAdaptor"})

    out = kvpool("doctor", "--lmcache-config", str(path), "--json", timeout=180)
    findings = json.loads(out.stdout)
    assert out.returncode == 1
    [failure] = [f for f in findings if not f["ok"]]
    assert failure["check"] == "plugin import" and "KVPoolConnectorAdaptor" in failure["detail"]
    assert failure["fix"] == f"set extra_config['{key}'] = 'KVPoolConnectorAdapter'"
    assert failure["cause"] == "plugin-not-loaded"
    assert _finding(findings, "round trip")["state"] == "skip"  # the consequence, not a second failure
    assert not any("pip install" in f["fix"] for f in findings)  # kvpool is installed: no reinstall advice

    text = kvpool("doctor", "--lmcache-config", str(path), timeout=180).stdout
    assert text.count("[FAIL]") == 1 and "\x1b[" not in text  # stdout a pipe: plain tags


# -- the memory a process here may have ---------------------------------------------------------
def _cgroup(tmp_path: Path, lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(lines)
    return root, proc


def test_a_containers_cgroup_limit_is_the_limit_when_below_the_hosts_memory(tmp_path):
    v2 = _cgroup(tmp_path / "v2", "0::/pod/engine\n", {"memory.max": "max\n", "pod/memory.max": f"{GIB}\n"})
    assert memory_limit(*v2) == MemoryLimit(GIB, f"the container's limit ({v2[0] / 'pod' / 'memory.max'})")
    v1 = _cgroup(tmp_path / "v1", "4:memory:/docker/abc\n", {"memory/docker/abc/memory.limit_in_bytes": f"{GIB}"})
    assert memory_limit(*v1).limit_bytes == GIB
    unlimited = _cgroup(tmp_path / "none", "0::/\n", {"memory.max": "max\n"})
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory_limit(*unlimited) == MemoryLimit(host, "the host's memory")


def test_a_cache_size_over_the_limit_is_a_warning_naming_both():
    limit = MemoryLimit(4 * GIB, "the container's limit (/sys/fs/cgroup/memory.max)")
    warned = check_cache_size("LMCache memory", "max_local_cpu_size", 5 * GIB, limit)
    assert warned.state.value == "warn" and warned.ok
    assert "5.0 GiB, more than the container's limit (/sys/fs/cgroup/memory.max), 4.0 GiB" in warned.detail
    assert check_cache_size("LMCache memory", "max_local_cpu_size", 3 * GIB, limit).state.value == "ok"
