"""docs/versions.md tells the truth: the versions it says were tested are the ones the tests run
with, and what it says of each engine is shown here.

- SGLang cannot run on a CPU-only machine (nor can LMCache's SGLang GPU connector, which
  requires a CUDA device). What runs here is the part of SGLang's LMCache integration that
  decides whether kvpool is used at all: its own config loader
  (``lmcache.integration.sglang.utils.lmcache_get_config``) and LMCache's storage built
  from what it returns, as its engine builds it. That loader reads a file only: without
  one it takes LMCache's defaults and ignores ``LMCACHE_*`` variables.
- vLLM cannot either; an LMCache engine configured by the file ``kvpool lmcache-config``
  writes (what ``LMCACHE_CONFIG_FILE`` gives vLLM's integration) stores, and a fresh
  engine in another process reads back, byte for byte.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

VERSIONS = (REPO / "docs" / "versions.md").read_text()


def _kvpool(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _sglang_loader_from_file(path: str):
    from lmcache.integration.sglang.utils import lmcache_get_config

    return lmcache_get_config(path)


def test_lmcaches_sglang_loader_reads_kvpools_config_file_and_a_fresh_engine_reads_what_one_stored(
    node_factory, pool_url
):
    import torch

    from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config

    node_factory()
    config = kvpool_lmcache_config(pool_url)
    writer = LMCacheStack(config, loader=_sglang_loader_from_file)
    try:
        assert "RemoteBackend-kvpool" in writer.backends
        keys = [writer.key(0x5EED + i) for i in range(4)]
        objs = [writer.make_object(i) for i in range(4)]
        writer.put(keys, objs)
        writer.release(objs)
    finally:
        writer.close()
    reader = LMCacheStack(config, loader=_sglang_loader_from_file)  # a fresh engine: its local CPU backend is empty
    try:
        assert reader.contains_prefix(keys) == 4
        got = reader.get(keys)
        assert all(g is not None for g in got)
        expected = [reader.expected_tensor(i).view(torch.uint8) for i in range(4)]
        assert all(torch.equal(g.tensor.view(torch.uint8), e) for g, e in zip(got, expected))
        reader.release(got)
    finally:
        reader.close()


@pytest.mark.usefixtures("processes")
def test_lmcaches_sglang_loader_without_a_file_ignores_lmcache_variables_so_sglang_needs_the_file(
    pool_url, monkeypatch
):
    """LMCache 0.5.6's ``lmcache_get_config("")`` is ``from_defaults()``: ``LMCACHE_*`` is not read, so
    the ``--format env`` setup that vLLM's loader honours gives SGLang no kvpool (docs/versions.md)."""
    from lmcache.integration.sglang.utils import lmcache_get_config
    from lmcache.v1.config import load_engine_config_with_overrides

    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    for line in _kvpool("lmcache-config", "--url", pool_url, "--format", "env", "--offline").splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        monkeypatch.setenv(name, value.strip("'"))
    assert load_engine_config_with_overrides().remote_storage_plugins == ["kvpool"]  # vLLM's loader reads them
    assert not lmcache_get_config("").remote_storage_plugins  # SGLang's does not


def test_an_engine_configured_by_the_file_kvpool_lmcache_config_writes_gets_hits(node_factory, pool_url, tmp_path):
    """What docs/two-hosts.md runs on the engine's machine before vLLM: ``bench.engine --lmcache-config``."""
    node_factory()
    config = tmp_path / "lmcache.yaml"
    config.write_text(_kvpool("lmcache-config", "--url", pool_url))

    def engine(role: str) -> dict:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.engine", role, "--lmcache-config", str(config), "--chunks", "4"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert engine("put")["hit_prefix"] == 4
    read = engine("get")
    assert read["hits"] == 4 and read["identical"] == 4 and "RemoteBackend-kvpool" in read["backends"]


def _row(name: str) -> str:
    row = re.search(rf"^\| \*\*{re.escape(name)}\*\* \|([^|]*)\|", VERSIONS, re.MULTILINE)
    assert row, f"docs/versions.md has no row for {name}"
    return row.group(1)


def _pinned(package: str) -> str:
    pins = dict(line.split("==", 1) for line in (REPO / "constraints-cpu.txt").read_text().splitlines() if "==" in line)
    return pins[package]


def test_the_table_names_the_lmcache_and_torch_the_tests_pin_and_run():
    for package in ("lmcache", "torch"):
        pinned = _pinned(package)
        assert metadata.version(package).split("+")[0] == pinned, f"{package} installed is not the pinned {pinned}"
        assert pinned in _row({"lmcache": "LMCache", "torch": "torch"}[package]), package


@pytest.mark.usefixtures("processes")
def test_the_table_names_the_python_and_redis_minor_versions_the_tests_run_on():
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in _row("Python")
    version = subprocess.run(
        [shutil.which("redis-server") or "redis-server", "--version"], capture_output=True, text=True, timeout=10
    ).stdout
    minor = re.search(r"v=(\d+\.\d+)\.\d+", version)
    assert minor and minor.group(1) in _row("Redis"), version


def test_the_table_says_vllm_and_sglang_were_not_run_and_the_readme_promises_neither_untested():
    for engine in ("vLLM", "SGLang"):
        assert "not run" in _row(engine), engine
    readme = (REPO / "README.md").read_text()
    assert "SGLang" not in readme.split("## Two commands")[0]  # the opening promise is vLLM's only
