"""bench/device_check.sh and the GPU machine it runs on: Python, torch (CUDA), nvidia-nccl, numpy,
xxhash and safetensors, but no redis-py, no lmcache and no network.

Here there is no GPU: the script must say so and exit 0, and must exit non-zero when the
environment is broken, never turning a broken torch into "no GPU". On a machine with a GPU
these tests skip: the script itself is then the check (docs/nccl.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nccl_channel
from tests.conftest import REPO

# Makes redis-py and LMCache unimportable in a child Python, as on the GPU machine.
WITHOUT_REDIS_OR_LMCACHE = textwrap.dedent("""
    import sys

    class _Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("redis", "hiredis", "lmcache"):
                raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)", name=name)
            return None

    sys.meta_path.insert(0, _Absent())
""")


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_REDIS_OR_LMCACHE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false", **(env or {})},
    )


@pytest.mark.usefixtures("processes")
def test_the_channel_and_its_gpu_tests_import_without_redis_py_or_lmcache():
    out = _python("""
        import nccl_channel, nccl_channel.channel, nccl_channel.communicator, nccl_channel.library
        import nccl_channel.rendezvous, backend, backend.errors, backend.protocol, bench.nccl.bandwidth, bench.nccl.path
        import nccl_channel.pipeline, nccl_channel.staging, nccl_channel.transport_nccl, nccl_channel.waits
        assert "redis" not in sys.modules and "lmcache" not in sys.modules, sorted(sys.modules)
        print("available:", bool(nccl_channel.available()))
        import pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", "tests/test_nccl_gpu.py"]))
    """)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "available:" in out.stdout


def _device_check(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], str]:
    dest = tmp_path / "out"
    out = subprocess.run(
        ["bash", "bench/device_check.sh"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(dest), **env},
    )
    summary = dest / "device_check.txt"
    return out, summary.read_text() if summary.exists() else ""


@pytest.mark.usefixtures("processes")
@pytest.mark.skipif(nccl_channel.available().gpus > 0, reason="this machine has a GPU: the check runs for real")
def test_device_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    out, summary = _device_check(tmp_path, {})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no CUDA GPU visible here; the GPU part is unmeasured" in out.stdout
    assert "libnccl:" in summary and "python " in summary and "no CUDA GPU" in summary


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize(
    ("module", "failure"),
    [
        ("torch", "raise ImportError('libcudart.so.13: cannot open shared object file')"),  # a CUDA torch gone bad
        ("xxhash", "raise ImportError('No module named xxhash')"),  # a package the channel needs is missing
    ],
)
def test_device_check_fails_loudly_when_the_environment_is_broken(tmp_path, module, failure):
    """A torch that cannot load its CUDA libraries is not "no GPU": it is a broken machine, exit 2."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / f"{module}.py").write_text(failure + "\n")
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    out, summary = _device_check(tmp_path, {"PYTHONPATH": path})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "BROKEN environment" in out.stdout and "ImportError" in out.stdout, out.stdout
    assert "BROKEN environment" in summary
