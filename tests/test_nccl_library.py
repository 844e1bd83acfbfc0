"""libnccl discovery, probing and the ctypes binding, on any machine.

Discovery runs against real files: fake wheels are real dist-info directories on
``sys.path`` (found by importlib.metadata as pip-installed ones are), fake libraries are
real files. The binding's function table and error check run against a small C
library with NCCL's symbols, compiled here when a C compiler is present.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

import nccl_channel
from kvpool import NcclError
from nccl_channel import library
from nccl_channel.library import ENV_LIBRARY, Candidate, NcclLibrary, NcclUniqueId, candidates, find_library, probe

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler to build a fake library")

FAKE_NCCL_C = r"""
#include <string.h>
static char buf[64];
const char* ncclGetErrorString(int r) { strcpy(buf, "fake error "); buf[11] = '0' + r; buf[12] = 0; return buf; }
int ncclGetVersion(int* v) { *v = 21903; return 0; }
int ncclGetUniqueId(char* id) { for (int i = 0; i < 128; i++) id[i] = (char)i; return 0; }
int ncclCommInitRank(void** c, int n, char id[128], int r) { return 5; }
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { unsigned long size; unsigned int magic, version; int blocking; } configHead;
/* 4 (invalid argument) unless the config is a non-blocking ncclConfig_t of NCCL 2.17's layout;
   5 (invalid usage) once it is, so the test sees which one it got. */
int ncclCommInitRankConfig(void** c, int n, ncclUniqueId id, int r, configHead* cfg) {
    if (!cfg || cfg->size != 48 || cfg->magic != 0xcafebeef || cfg->version != 21700 || cfg->blocking != 0) return 4;
    return 5;
}
int ncclCommAbort(void* c) { return 0; }
int ncclCommDestroy(void* c) { return 0; }
int ncclCommGetAsyncError(void* c, int* e) { *e = 0; return 0; }
int ncclSend(const void* b, unsigned long n, int t, int p, void* c, void* s) { return 4; }
int ncclRecv(void* b, unsigned long n, int t, int p, void* c, void* s) { return 4; }
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
"""

CRASHING_C = r"""
#include <stdlib.h>
__attribute__((constructor)) static void boom(void) { abort(); }
int ncclGetVersion(int* v) { return 0; }
"""


def _compile(tmp_path: Path, name: str, source: str) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / f"{name}.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True, timeout=60)
    return out


def _fake_wheel(site: Path, distribution: str, version: str = "2.21.5") -> Path:
    """A dist-info as pip writes it, with the library its RECORD names."""
    lib = site / "nvidia" / "nccl" / distribution / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not really a library")
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{lib.relative_to(site).as_posix()},,\n{info.name}/METADATA,,\n")
    return lib


# -- discovery ----------------------------------------------------------------------------------
def test_the_env_var_wins_and_is_the_only_candidate(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_wheel(tmp_path, "nvidia-nccl-cu12")
    found = candidates({ENV_LIBRARY: "/opt/nccl/libnccl.so.2"}, system_library=lambda: "libnccl.so.2")
    assert found == [Candidate("/opt/nccl/libnccl.so.2", ENV_LIBRARY)]


def test_wheels_come_before_the_system_library_cu12_first_when_torch_has_no_cuda(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    cu13 = _fake_wheel(tmp_path, "nvidia-nccl-cu13")
    cu12 = _fake_wheel(tmp_path, "nvidia-nccl-cu12")
    found = candidates({}, system_library=lambda: "libnccl.so.2", cuda_major=lambda: None)
    assert found == [
        Candidate(str(cu12), "nvidia-nccl-cu12"),
        Candidate(str(cu13), "nvidia-nccl-cu13"),
        Candidate("libnccl.so.2", "system"),
    ]
    assert find_library({}, system_library=lambda: None, cuda_major=lambda: None) == Candidate(
        str(cu12), "nvidia-nccl-cu12"
    )


@pytest.mark.parametrize(
    ("major", "first", "second"),
    [(13, "nvidia-nccl-cu13", "nvidia-nccl-cu12"), (12, "nvidia-nccl-cu12", "nvidia-nccl-cu13")],
)
def test_the_wheel_of_torchs_cuda_major_is_tried_first_with_both_installed(tmp_path, monkeypatch, major, first, second):
    """A CUDA 13 torch beside both wheels loads libnccl from nvidia-nccl-cu13, not the cu12 one."""
    monkeypatch.syspath_prepend(str(tmp_path))
    paths = {w: str(_fake_wheel(tmp_path, w)) for w in ("nvidia-nccl-cu12", "nvidia-nccl-cu13")}
    found = candidates({}, system_library=lambda: "libnccl.so.2", cuda_major=lambda: major)
    assert found == [
        Candidate(paths[first], first),
        Candidate(paths[second], second),
        Candidate("libnccl.so.2", "system"),
    ]
    assert find_library({}, system_library=lambda: None, cuda_major=lambda: major).source == first
    assert find_library({ENV_LIBRARY: paths[second]}, cuda_major=lambda: major).source == ENV_LIBRARY  # still wins


def test_torch_cuda_major_comes_from_a_loaded_torch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert library.torch_cuda_major() == 13
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build
    assert library.torch_cuda_major() is None


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize(
    ("version_line", "expected"),
    [("cuda: Optional[str] = '13.0'", "13"), ("cuda = '12.8'", "12"), ("cuda: Optional[str] = None", "None")],
)
def test_torch_cuda_major_reads_torchs_version_file_without_importing_torch(tmp_path, version_line, expected):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('torch was imported')\n")
    (fake / "version.py").write_text(f"__version__ = '2.11.0'\n{version_line}\n")
    code = "import sys\nfrom nccl_channel.library import torch_cuda_major\nprint(torch_cuda_major())\n"
    code += "assert 'torch' not in sys.modules\n"
    from tests.conftest import REPO

    proc = subprocess.run(
        [__import__("sys").executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{REPO}"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == expected


@pytest.mark.usefixtures("processes")
def test_without_torch_the_order_is_the_default_and_nothing_is_imported():
    code = "import sys\nsys.modules['torch'] = None\nfrom nccl_channel.library import torch_cuda_major, wheel_order\n"
    code += "assert torch_cuda_major() is None\nprint(wheel_order(None))\n"
    from tests.conftest import REPO

    proc = subprocess.run(
        [__import__("sys").executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "['nvidia-nccl-cu12', 'nvidia-nccl-cu13']"


def test_the_cu13_wheel_is_used_when_it_is_the_only_one(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    cu13 = _fake_wheel(tmp_path, "nvidia-nccl-cu13")
    assert find_library({}, system_library=lambda: "libnccl.so.2", cuda_major=lambda: 12) == Candidate(
        str(cu13), "nvidia-nccl-cu13"
    )


def test_no_library_anywhere_names_the_env_var_and_the_extra():
    with pytest.raises(NcclError) as caught:
        find_library({}, wheel_library=lambda _name: None, system_library=lambda: None)
    message = str(caught.value)
    assert ENV_LIBRARY in message and "kvpool[nccl]" in message and "nvidia-nccl-cu12" in message
    assert "kvpool[nccl-cu12]" in message and "kvpool[nccl-cu13]" in message


def test_an_env_var_pointing_at_nothing_is_reported_not_skipped(tmp_path):
    with pytest.raises(NcclError, match=f"{ENV_LIBRARY}='{tmp_path}/missing.so' is not a file"):
        find_library({ENV_LIBRARY: str(tmp_path / "missing.so")}, system_library=lambda: "libnccl.so.2")


# -- probing (in a child process) ----------------------------------------------------------------
@pytest.mark.usefixtures("processes")
def test_probing_a_file_that_is_not_a_library_raises_and_the_caller_lives(tmp_path):
    fake = tmp_path / "libnccl.so.2"
    fake.write_text("#!/bin/sh\necho not a library\n")
    with pytest.raises(NcclError, match=r"cannot load .*libnccl\.so\.2"):
        probe(str(fake))


@pytest.mark.usefixtures("processes")
def test_probing_a_missing_file_raises(tmp_path):
    with pytest.raises(NcclError, match="cannot load"):
        probe(str(tmp_path / "nothing-here.so"))


@pytest.mark.usefixtures("processes")
def test_probing_a_library_without_nccl_symbols_names_what_is_missing():
    with pytest.raises(NcclError, match=r"lacks ncclGetErrorString.*NCCL 2\.17 or later"):
        probe("libc.so.6")


@pytest.mark.usefixtures("processes")
@needs_cc
def test_a_library_that_crashes_on_load_crashes_only_the_probe(tmp_path):
    crashing = _compile(tmp_path, "crash", CRASHING_C)
    with pytest.raises(NcclError, match="crashed the probe process"):
        probe(str(crashing))


def test_available_is_false_with_a_reason_without_gpu_or_libnccl(monkeypatch):
    import torch

    if torch.cuda.device_count() > 0:
        pytest.skip("this machine has a GPU")
    status = nccl_channel.available({ENV_LIBRARY: "/nonexistent/libnccl.so.2"})
    assert not status and status.ok is False
    assert "no CUDA GPU is visible" in status.reason
    assert f"{ENV_LIBRARY}='/nonexistent/libnccl.so.2' is not a file" in status.reason


# -- the binding against a library with NCCL's symbols --------------------------------------------
@pytest.mark.usefixtures("processes")
@needs_cc
def test_the_function_table_loads_and_every_failure_carries_code_and_string(tmp_path, monkeypatch):
    fake = _compile(tmp_path, "libnccl_fake", FAKE_NCCL_C)
    monkeypatch.setattr(library, "_loaded", {})
    lib = library.load_library({ENV_LIBRARY: str(fake)})
    assert isinstance(lib, NcclLibrary)
    assert lib.version() == 21903 and library.version_string(lib.version()) == "2.19.3"
    assert probe(str(fake)).version_string == "2.19.3"
    uid = lib.unique_id()
    assert uid.to_bytes() == bytes(range(128))
    assert NcclUniqueId.from_bytes(uid.to_bytes()).to_bytes() == uid.to_bytes()
    with pytest.raises(NcclError) as caught:
        lib.comm_init_rank_config(2, uid, 0)
    # 5, not 4: the fake accepted the config struct (size 48, magic, version 21700, blocking 0)
    assert caught.value.result == 5 and caught.value.result_string == "fake error 5"
    assert "ncclCommInitRankConfig failed (ncclResult 5: fake error 5)" in str(caught.value)
    with pytest.raises(NcclError, match="ncclSend failed"):
        lib.send(0, 16, 1, None, 0)
    lib.group_start()
    assert lib.group_end() == 0
    assert lib.check(7, "in progress") == 7  # ncclInProgress is not a failure on a non-blocking comm
    assert library.load_library({ENV_LIBRARY: str(fake)}) is lib  # probed and loaded once per path


def test_a_unique_id_of_the_wrong_size_is_refused():
    with pytest.raises(NcclError, match="128 bytes, got 3"):
        NcclUniqueId.from_bytes(b"abc")


@pytest.mark.usefixtures("processes")
def test_the_channel_package_imports_without_touching_a_gpu():
    code = textwrap.dedent("""
        import sys, nccl_channel, nccl_channel.channel, nccl_channel.rendezvous, nccl_channel.library
        assert "nccl_channel.communicator" not in sys.modules
        assert not any(m.startswith("backend.node") for m in sys.modules)
    """)
    from tests.conftest import REPO

    proc = subprocess.run(
        [__import__("sys").executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_channel_module_still_offers_every_name_its_users_import():
    """The channel is split into modules; ``nccl_channel.channel`` keeps the names backend/, bench/ and tests/ use."""
    from nccl_channel import channel

    names = [
        "ChannelServer",
        "CpuTransport",
        "CpuLink",
        "NcclChannel",
        "NcclTransport",
        "NcclLink",
        "Link",
        "Transport",
        "make_transport",
        "transfer_timeout",
        "BACKOFF_S",
        "MAX_PAIRS",
    ]
    assert [n for n in names if not hasattr(channel, n)] == []
    assert set(channel.__all__) <= set(dir(channel))
