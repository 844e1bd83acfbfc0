"""Where a result was measured: the machine and the commit, for every result file of the harness."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

import torch

from backend.launch.processes import REPO
from bench.harness.plan import GIB


def machine() -> dict[str, Any]:
    import lmcache

    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lmcache": getattr(lmcache, "__version__", "?"),
    }


def revision() -> dict[str, Any]:
    """The commit measured, and whether kvpool's code (backend/) differed from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "backend"], cwd=REPO, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"commit": commit, "backend_modified": bool(changed)} if commit else {}
