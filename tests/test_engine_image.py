"""deploy/engine.Containerfile (vLLM + LMCache + kvpool's plugin) cannot be built here: no image
registry is reachable for its base. What can be checked is: every file it copies exists, it
installs kvpool with the ``[lmcache]`` extra from what it copied, and its build-time check,
``deploy/engine_check.py``, passes where LMCache loads the plugin and names the problem
where it would not.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

CONTAINERFILE = (REPO / "deploy" / "engine.Containerfile").read_text()
CHECK = REPO / "deploy" / "engine_check.py"


def _engine_check():
    spec = importlib.util.spec_from_file_location("engine_check", CHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_file_the_engine_image_copies_is_in_the_checkout_and_it_installs_the_lmcache_extra_from_them():
    copied = re.findall(r"^COPY (.+) (\S+)$", CONTAINERFILE, re.MULTILINE)
    sources = [source for sources, _ in copied for source in sources.split()]
    assert {"pyproject.toml", "backend", "deploy/engine_check.py"} <= set(sources), sources
    assert all((REPO / source).exists() for source in sources), sources
    assert "'/opt/kvpool-src[lmcache]'" in CONTAINERFILE
    assert "python3 /opt/kvpool-src/deploy/engine_check.py" in CONTAINERFILE
    assert re.search(r"^ARG BASE$", CONTAINERFILE, re.MULTILINE) and "FROM ${BASE}" in CONTAINERFILE


@pytest.mark.usefixtures("processes")
def test_the_engine_check_passes_where_lmcache_loads_the_plugin():
    proc = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "engine check: LMCache 0.5." in proc.stdout and "loads kvpool" in proc.stdout


def test_the_engine_check_names_an_lmcache_outside_the_range_kvpool_works_with(monkeypatch):
    check = _engine_check()
    real = check.metadata.version
    monkeypatch.setattr(check.metadata, "version", lambda name: "0.6.0" if name == "lmcache" else real(name))
    assert check.problems() == ["LMCache 0.6.0 is installed; kvpool's plugin works with lmcache<0.6,>=0.5.6"]


def test_the_engine_check_names_a_plugin_class_that_is_gone(monkeypatch):
    """What LMCache would only log a warning for: the config names a class the module lacks."""
    check = _engine_check()
    from backend.lmcache import config

    monkeypatch.setattr(config, "ADAPTER_CLASS", "KVPoolConnectorAdapterGone")
    assert check.problems() == ["kvpool.lmcache_connector has no KVPoolConnectorAdapterGone"]


@pytest.mark.parametrize("path", ["deploy/engine.Containerfile", "deploy/Containerfile"])
def test_the_images_recipes_are_linted_by_make_image(path):
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"hadolint .*{re.escape(path)}", makefile), path
