"""GPU-direct transfer of KV chunks between members of one cluster (see docs/nccl.md).

Importing this package never loads libnccl or touches a GPU. :func:`available`
says whether the NCCL channel can run here, and why not.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from backend.errors import NcclError

__all__ = ["Availability", "available"]


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether the NCCL channel can run in this process; ``reason`` says why not."""

    ok: bool
    reason: str = ""
    library: str = ""
    version: str = ""
    gpus: int = 0

    def __bool__(self) -> bool:
        return self.ok


def available(environ: Mapping[str, str] | None = None) -> Availability:
    """Check for a CUDA GPU and a loadable libnccl (probed in a child process)."""
    from nccl_channel.library import find_library, probe

    env = os.environ if environ is None else environ
    problems: list[str] = []
    try:
        import torch

        gpus = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken CUDA install raises many kinds of errors here
        gpus = 0
        problems.append(f"torch cannot query CUDA ({exc})")
    else:
        if gpus == 0:
            build = getattr(torch.version, "cuda", None)
            problems.append("no CUDA GPU is visible" + ("" if build else " (this torch is a CPU-only build)"))
    library = ""
    version = ""
    try:
        library = find_library(env).path
        version = probe(library).version_string
    except NcclError as exc:
        problems.append(str(exc))
    if problems:
        return Availability(False, "; ".join(problems), library, version, gpus)
    return Availability(True, "", library, version, gpus)
