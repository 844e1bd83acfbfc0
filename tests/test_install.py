"""The core install: a pool node, the CLI and the client run without torch and LMCache.

Engines install ``kvpool[lmcache]``; every pool node installs only the core
(docs/dependencies.md). The fast test hides torch and LMCache from a process of this
checkout; the slow one installs the core into a fresh venv, as an operator would.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import Chunk, PoolConfig, SyncPoolClient
from tests.conftest import REPO, NodeProcess

ENGINE_ONLY = ("torch", "lmcache")
# A Python prologue under which importing torch or lmcache raises ImportError, as where they are not installed.
HIDDEN = "import sys\nfor name in " + repr(ENGINE_ONLY) + ":\n    sys.modules[name] = None\n"
KVPOOL_HIDDEN = [sys.executable, "-c", HIDDEN + "from backend.cli import main\nsys.exit(main())"]
INSTALL_TIMEOUT_S = 600  # a cold pip cache downloads the core's wheels


def _run(command: list[str], cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=120, env=env)


@pytest.mark.usefixtures("processes")
def test_node_cli_and_client_modules_import_neither_torch_nor_lmcache():
    modules = [
        "backend",
        "backend.cli",
        "backend.client",
        "backend.node.server",
        "backend.admin",
        "backend.metrics",
        "backend.lmcache",
        "backend.lmcache.config",
        "nccl_channel",
    ]
    # Installed here, so an import guarded by try/except would show in sys.modules too.
    code = "import importlib, json, sys\nfor m in " + repr(modules) + ":\n    importlib.import_module(m)\n"
    code += "from kvpool import PoolClient, SyncPoolClient, PoolConfig\nprint(json.dumps(sorted(sys.modules)))"
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout))
    assert "backend.node.server" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ENGINE_ONLY}


# The only modules of backend/ that may import LMCache or torch: the LMCache layer. Its config module stays light.
LMCACHE_LAYER = "backend/lmcache/"
LIGHT_IN_LAYER = ("backend/lmcache/__init__.py", "backend/lmcache/config.py")


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_the_lmcache_layer_imports_lmcache_or_torch():
    offenders, layer = [], []
    for path in sorted((REPO / "backend").rglob("*.py")):
        name = str(path.relative_to(REPO))
        engine_only = _imported_roots(path) & set(ENGINE_ONLY)
        if name.startswith(LMCACHE_LAYER) and name not in LIGHT_IN_LAYER:
            layer += [name] if engine_only else []
        elif engine_only:
            offenders.append(f"{name} imports {', '.join(sorted(engine_only))}")
    assert offenders == []
    assert "backend/lmcache/connector.py" in layer and "backend/lmcache/l2/adapter.py" in layer  # the scan sees imports


def test_the_lmcache_layer_reaches_the_metadata_only_through_the_client_index():
    """``PoolClient.index`` is its one door to Redis: no MetadataStore, no reach-through ``client._store``."""
    offenders = []
    for path in sorted((REPO / "backend" / "lmcache").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "backend.metadata":
                offenders.append(f"{path.name} imports backend.metadata")
            elif isinstance(node, ast.Import) and any(a.name == "backend.metadata" for a in node.names):
                offenders.append(f"{path.name} imports backend.metadata")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in ("_store", "store", "_meta", "meta")
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "client"
            ):
                offenders.append(f"{path.name}:{node.lineno} reaches client.{node.attr}")
    assert offenders == []


@pytest.mark.usefixtures("processes")
def test_without_torch_and_lmcache_a_node_serves_and_the_cli_works_but_doctor_names_the_extra(
    redis_server, namespace, pool_url, tmp_path
):
    node = NodeProcess(
        ["--redis", redis_server.url, "--namespace", namespace, "--dram", "16MiB", "--shm-dir", "off"],
        dict(os.environ),
        command=KVPOOL_HIDDEN,
    ).start()
    try:
        with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
            client.put([Chunk("light", b"x" * 4096)])
            fetched = client.get(["light"])[0]
            assert fetched is not None and bytes(fetched.data) == b"x" * 4096
        printed = _run([*KVPOOL_HIDDEN, "lmcache-config", "--url", pool_url, "--form", "remote_url"])
        assert printed.returncode == 0 and "remote_url: external://" in printed.stdout
        lmcache_yaml = tmp_path / "lmcache.yaml"
        lmcache_yaml.write_text(printed.stdout)
        doctor = _run([*KVPOOL_HIDDEN, "doctor", "--lmcache-config", str(lmcache_yaml)])
        assert doctor.returncode == 1 and "kvpool[lmcache]" in doctor.stderr
        assert doctor.stderr.strip().count("\n") == 0
        channel = _run([*KVPOOL_HIDDEN, "node", "--redis", redis_server.url, "--cluster", "c", "--channel", "cpu"])
        assert channel.returncode == 2 and "--channel" in channel.stderr and "kvpool[nccl]" in channel.stderr
    finally:
        node.kill()


@pytest.mark.usefixtures("processes")
@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 120)
def test_core_install_in_a_fresh_venv_runs_a_node_without_torch_or_lmcache(redis_server, namespace, pool_url, tmp_path):
    # A copy of the sources: pip builds in the source tree, and this checkout stays untouched.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("backend", "nccl_channel"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # This environment's pip installs into the new venv (--python): no pip bootstrap, and pip's own cache.
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--disable-pip-version-check",
            "-c",
            str(REPO / "constraints-cpu.txt"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = _run(
        [
            str(python),
            "-c",
            "import importlib.util as u, json\n"
            f"print(json.dumps({{m: u.find_spec(m) is not None for m in {ENGINE_ONLY!r}}}))",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == {"torch": False, "lmcache": False}

    kvpool = str(venv / "bin" / "kvpool")
    node = NodeProcess(
        ["--redis", redis_server.url, "--namespace", namespace, "--dram", "16MiB", "--shm-dir", "off"],
        env,
        command=[kvpool],
        cwd=tmp_path,
    ).start()
    try:
        status = _run([kvpool, "status", "--url", pool_url, "--json"], cwd=tmp_path, env=env)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["nodes"]["alive"] == 1
        where = _run([str(python), "-c", "import backend; print(backend.__file__)"], cwd=tmp_path, env=env)
        assert str(venv) in where.stdout  # the installed package ran, not this checkout
    finally:
        node.kill()


def test_the_launcher_and_the_bench_start_children_in_the_repository_root() -> None:
    from backend.launch.processes import REPO as LAUNCH_REPO
    from bench.paths import REPO as BENCH_REPO

    assert LAUNCH_REPO == BENCH_REPO and (LAUNCH_REPO / "pyproject.toml").is_file()
