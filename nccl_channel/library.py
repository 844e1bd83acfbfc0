"""ctypes binding to libnccl: where the library is found, a function table, one check.

The library is looked for in this order; the first candidate that exists is used:

1. ``KVPOOL_NCCL_LIBRARY`` (a path; when set, nothing else is tried, so a wrong path
   is reported instead of silently loading another library);
2. the ``nvidia-nccl-cuNN`` wheel whose CUDA major version ``NN`` is the one the
   installed torch was built for (``torch.version.cuda``, read from torch's
   ``version.py`` without importing torch when it is not loaded yet);
3. the other ``nvidia-nccl-cu*`` wheels (cu12 before cu13 when torch's CUDA is unknown);
4. the system library (``ctypes.util.find_library("nccl")``).

A libnccl built for another CUDA major than the running torch loads, but its kernels
need that CUDA's runtime: the matching wheel must win even when both are installed.

Before this process maps a library, a child process loads it and calls
``ncclGetVersion`` (:func:`probe`): a broken or foreign library can crash that child,
never the caller. Every call goes through :meth:`NcclLibrary.check`, which raises
:class:`NcclError` carrying the ncclResult code and ``ncclGetErrorString``.

The function prototypes follow ``nccl.h``. Communicators are created non-blocking
(``ncclCommInitRankConfig`` with ``blocking = 0``), so a caller can poll
``ncclCommGetAsyncError`` with a deadline and ``ncclCommAbort`` instead of hanging.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from importlib import metadata as importlib_metadata
from typing import Any

from backend.errors import NcclError

__all__ = [
    "ENV_LIBRARY",
    "WHEELS",
    "Candidate",
    "torch_cuda_major",
    "wheel_order",
    "NcclLibrary",
    "NcclUniqueId",
    "candidates",
    "find_library",
    "probe",
    "load_library",
    "version_string",
]

ENV_LIBRARY = "KVPOOL_NCCL_LIBRARY"
WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu13")
_TORCH_CUDA = re.compile(r"""^cuda\b[^=]*=\s*['"](\d+)(?:\.\d+)*['"]""", re.MULTILINE)
PROBE_TIMEOUT_S = 30.0

# ncclResult_t values (nccl.h)
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
NCCL_UINT8 = 1  # ncclDataType_t: bytes are moved as uint8, whatever the tensor's dtype
NCCL_CONFIG_UNDEF_INT = -(2**31)
NCCL_API_MAGIC = 0xCAFEBEEF
NCCL_CONFIG_VERSION = 21700  # the ncclConfig_t layout below (fields up to splitShare)

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p


class NcclUniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes that rank 0 makes and every rank needs."""

    _fields_ = [("internal", ctypes.c_byte * 128)]

    def to_bytes(self) -> bytes:
        return bytes(ctypes.string_at(ctypes.addressof(self), ctypes.sizeof(self)))

    @classmethod
    def from_bytes(cls, raw: bytes) -> NcclUniqueId:
        if len(raw) != ctypes.sizeof(cls):
            raise NcclError(f"an NCCL unique id is {ctypes.sizeof(cls)} bytes, got {len(raw)}")
        out = cls()
        ctypes.memmove(ctypes.addressof(out), raw, len(raw))
        return out


class NcclConfig(ctypes.Structure):
    """``ncclConfig_t`` as of NCCL 2.17; later versions append fields and read ``size``/``version``."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]

    @classmethod
    def non_blocking(cls) -> NcclConfig:
        undef = NCCL_CONFIG_UNDEF_INT
        return cls(ctypes.sizeof(cls), NCCL_API_MAGIC, NCCL_CONFIG_VERSION, 0, undef, undef, undef, None, undef)


@dataclasses.dataclass(frozen=True)
class Function:
    name: str
    restype: Any
    argtypes: list[Any]


# The function table: C prototypes from nccl.h.
FUNCTIONS = [
    # const char* ncclGetErrorString(ncclResult_t result)
    Function("ncclGetErrorString", ctypes.c_char_p, [ncclResult_t]),
    # ncclResult_t ncclGetVersion(int* version)
    Function("ncclGetVersion", ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId)
    Function("ncclGetUniqueId", ncclResult_t, [ctypes.POINTER(NcclUniqueId)]),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank)
    Function("ncclCommInitRank", ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int]),
    # ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
    #                                     ncclConfig_t* config)
    Function(
        "ncclCommInitRankConfig",
        ncclResult_t,
        [ctypes.POINTER(ncclComm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int, ctypes.POINTER(NcclConfig)],
    ),
    # ncclResult_t ncclCommAbort(ncclComm_t comm)
    Function("ncclCommAbort", ncclResult_t, [ncclComm_t]),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm)
    Function("ncclCommDestroy", ncclResult_t, [ncclComm_t]),
    # ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError)
    Function("ncclCommGetAsyncError", ncclResult_t, [ncclComm_t, ctypes.POINTER(ncclResult_t)]),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
    #                       ncclComm_t comm, cudaStream_t stream)
    Function(
        "ncclSend", ncclResult_t, [buffer_type, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ncclComm_t, cudaStream_t]
    ),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
    #                       ncclComm_t comm, cudaStream_t stream)
    Function(
        "ncclRecv", ncclResult_t, [buffer_type, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ncclComm_t, cudaStream_t]
    ),
    # ncclResult_t ncclGroupStart(void); ncclResult_t ncclGroupEnd(void)
    Function("ncclGroupStart", ncclResult_t, []),
    Function("ncclGroupEnd", ncclResult_t, []),
]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A place libnccl may be: the path (or soname) and where that came from."""

    path: str
    source: str  # "KVPOOL_NCCL_LIBRARY", a wheel name, or "system"


def _wheel_library(distribution: str) -> str | None:
    """The libnccl file an installed wheel ships, from its RECORD; None if not installed."""
    try:
        dist = importlib_metadata.distribution(distribution)
    except importlib_metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        name = file.name
        if name.startswith("libnccl.so"):
            return str(dist.locate_file(file))
    return None


def torch_cuda_major() -> int | None:
    """The CUDA major version the installed torch was built for; None for a CPU build or no torch.

    Never imports torch: a loaded torch is asked, otherwise its ``version.py`` is read.
    """
    loaded = sys.modules.get("torch")
    if loaded is not None:
        text = str(getattr(getattr(loaded, "version", None), "cuda", None) or "")
        return int(text.split(".")[0]) if text.split(".")[0].isdigit() else None
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as file:
                match = _TORCH_CUDA.search(file.read())
        except OSError:
            continue
        return int(match.group(1)) if match else None
    return None


def wheel_order(cuda_major: int | None) -> list[str]:
    """The nvidia-nccl wheels in the order they are tried: the one for ``cuda_major`` first."""
    matching = f"nvidia-nccl-cu{cuda_major}"
    return sorted(WHEELS, key=lambda wheel: wheel != matching)  # stable: the rest keep WHEELS' order


def candidates(
    environ: Mapping[str, str] | None = None,
    *,
    wheel_library: Callable[[str], str | None] = _wheel_library,
    system_library: Callable[[], str | None] = lambda: ctypes.util.find_library("nccl"),
    cuda_major: Callable[[], int | None] = torch_cuda_major,
) -> list[Candidate]:
    """Every place libnccl was found, in the order they are tried.

    With ``KVPOOL_NCCL_LIBRARY`` set, that path is the only candidate.
    """
    env = os.environ if environ is None else environ
    explicit = env.get(ENV_LIBRARY, "")
    if explicit:
        return [Candidate(explicit, ENV_LIBRARY)]
    order = wheel_order(cuda_major())
    found = [Candidate(path, wheel) for wheel in order if (path := wheel_library(wheel))]
    system = system_library()
    if system:
        found.append(Candidate(system, "system"))
    return found


def find_library(environ: Mapping[str, str] | None = None, **kwargs: Any) -> Candidate:
    """The libnccl to use, or NcclError saying where it was looked for and how to point at one."""
    env = os.environ if environ is None else environ
    found = candidates(env, **kwargs)
    if not found:
        raise NcclError(
            f"libnccl not found: {ENV_LIBRARY} is unset, neither {' nor '.join(WHEELS)} is installed "
            f"(install kvpool[nccl], or kvpool[nccl-cu12] / kvpool[nccl-cu13] to match torch's CUDA: in a kvpool "
            f"checkout, pip install -e '.[nccl]'), "
            f"and the system has no libnccl; set {ENV_LIBRARY}=/path/to/libnccl.so.2"
        )
    choice = found[0]
    if choice.source == ENV_LIBRARY and not os.path.isfile(choice.path):
        raise NcclError(f"{ENV_LIBRARY}={choice.path!r} is not a file; point it at libnccl.so.2 or unset it")
    return choice


_PROBE_CODE = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
names = json.loads(sys.argv[2])
missing = [n for n in names if not hasattr(lib, n)]
version = ctypes.c_int(0)
result = lib.ncclGetVersion(ctypes.byref(version)) if "ncclGetVersion" not in missing else -1
print(json.dumps({"version": version.value, "result": result, "missing": missing}))
"""


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    path: str
    version: int

    @property
    def version_string(self) -> str:
        return version_string(self.version)


def version_string(code: int) -> str:
    """``21903`` -> ``"2.19.3"`` (NCCL_VERSION_CODE for 2.9 and later)."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code >= 10000 else str(code)


def probe(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """Load ``path`` in a child process and ask its version; NcclError if that fails in any way."""
    names = json.dumps([f.name for f in FUNCTIONS])
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE_CODE, path, names],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
    except subprocess.TimeoutExpired:
        raise NcclError(f"loading {path} did not finish in {timeout_s:.0f} s") from None
    if proc.returncode < 0:
        raise NcclError(f"loading {path} crashed the probe process (signal {-proc.returncode})")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise NcclError(f"cannot load {path}: {last}")
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise NcclError(f"probing {path} gave no answer") from None
    if report["missing"]:
        raise NcclError(f"{path} lacks {', '.join(report['missing'])}; NCCL 2.17 or later is needed")
    if report["result"] != NCCL_SUCCESS:
        raise NcclError(f"ncclGetVersion in {path} failed", int(report["result"]))
    return ProbeResult(path, int(report["version"]))


class NcclLibrary:
    """libnccl loaded in this process, with its function table. Build with :func:`load_library`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(path)
        self._funcs: dict[str, Any] = {}
        for func in FUNCTIONS:
            try:
                handle = getattr(self._lib, func.name)
            except AttributeError:
                raise NcclError(f"{path} lacks {func.name}; NCCL 2.17 or later is needed") from None
            handle.restype = func.restype
            handle.argtypes = func.argtypes
            self._funcs[func.name] = handle

    def error_string(self, result: int) -> str:
        raw = self._funcs["ncclGetErrorString"](result)
        return raw.decode("utf-8", "replace") if raw else "unknown error"

    def check(self, result: int, what: str) -> int:
        """Raise NcclError for a failed call; ``ncclInProgress`` is not a failure (non-blocking comms)."""
        if result not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclError(f"{what} failed", result, self.error_string(result))
        return result

    def version(self) -> int:
        code = ctypes.c_int()
        self.check(self._funcs["ncclGetVersion"](ctypes.byref(code)), "ncclGetVersion")
        return int(code.value)

    def unique_id(self) -> NcclUniqueId:
        uid = NcclUniqueId()
        self.check(self._funcs["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
        return uid

    def comm_init_rank_config(self, nranks: int, uid: NcclUniqueId, rank: int) -> tuple[Any, int]:
        """Start a non-blocking communicator; returns it and ncclSuccess or ncclInProgress."""
        comm = ncclComm_t()
        config = NcclConfig.non_blocking()
        result = self._funcs["ncclCommInitRankConfig"](ctypes.byref(comm), nranks, uid, rank, ctypes.byref(config))
        return comm, self.check(result, "ncclCommInitRankConfig")

    def comm_async_error(self, comm: Any) -> int:
        """The communicator's state: ncclSuccess, ncclInProgress, or the error that broke it."""
        state = ncclResult_t()
        self.check(self._funcs["ncclCommGetAsyncError"](comm, ctypes.byref(state)), "ncclCommGetAsyncError")
        return int(state.value)

    def comm_abort(self, comm: Any) -> None:
        self.check(self._funcs["ncclCommAbort"](comm), "ncclCommAbort")

    def comm_destroy(self, comm: Any) -> None:
        self.check(self._funcs["ncclCommDestroy"](comm), "ncclCommDestroy")

    def send(self, ptr: int, nbytes: int, peer: int, comm: Any, stream: int) -> int:
        return self.check(self._funcs["ncclSend"](ptr, nbytes, NCCL_UINT8, peer, comm, stream), "ncclSend")

    def recv(self, ptr: int, nbytes: int, peer: int, comm: Any, stream: int) -> int:
        return self.check(self._funcs["ncclRecv"](ptr, nbytes, NCCL_UINT8, peer, comm, stream), "ncclRecv")

    def group_start(self) -> None:
        self.check(self._funcs["ncclGroupStart"](), "ncclGroupStart")

    def group_end(self) -> int:
        return self.check(self._funcs["ncclGroupEnd"](), "ncclGroupEnd")


_loaded: dict[str, NcclLibrary] = {}
_load_lock = threading.Lock()


def load_library(environ: Mapping[str, str] | None = None) -> NcclLibrary:
    """Find, probe (in a child process) and load libnccl once per path."""
    choice = find_library(environ)
    with _load_lock:
        lib = _loaded.get(choice.path)
        if lib is None:
            probe(choice.path)
            lib = _loaded[choice.path] = NcclLibrary(choice.path)
        return lib
