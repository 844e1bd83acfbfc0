"""How much memory this host, or the container it runs in, lets a process take: what a cache size is checked against.

The host's is its physical memory; a container's is its cgroup's limit (``memory.max`` in
cgroup v2, ``memory.limit_in_bytes`` in v1), the smallest along the cgroup's path, since
a parent's limit binds its children. An engine that configures more than that is killed
by the kernel as its cache fills, or at start when the cache is allocated up front.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from backend.config import format_size
from backend.doctor.findings import Finding

__all__ = ["MemoryLimit", "check_cache_size", "memory_limit"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number near 2**63


@dataclasses.dataclass(frozen=True)
class MemoryLimit:
    """The most memory a process here can have: ``limit_bytes``, and what sets it (``source``)."""

    limit_bytes: int
    source: str


def memory_limit(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> MemoryLimit:
    """The smaller of the host's physical memory and this process's cgroup limit, named."""
    host = MemoryLimit(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host's memory")
    container = _cgroup_limit(cgroup_root, proc_cgroup)
    return container if container is not None and container.limit_bytes < host.limit_bytes else host


def _cgroup_limit(root: Path, proc_cgroup: Path) -> MemoryLimit | None:
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[MemoryLimit] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            limits += _limits_along(root, path, "memory.max")
        elif "memory" in controllers.split(","):
            limits += _limits_along(root / "memory", path, "memory.limit_in_bytes")
    return min(limits, key=lambda limit: limit.limit_bytes, default=None)


def _limits_along(root: Path, path: str, name: str) -> list[MemoryLimit]:
    """Every limit set from the cgroup at ``path`` up to ``root``; "max" (or v1's huge number) is none."""
    found = []
    directory = root / path.lstrip("/")
    for folder in (directory, *directory.parents):
        if not folder.is_relative_to(root):
            break
        try:
            text = (folder / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < V1_UNLIMITED:
            found.append(MemoryLimit(int(text), f"the container's limit ({folder / name})"))
    return found


def check_cache_size(check: str, setting: str, configured_bytes: int, limit: MemoryLimit) -> Finding:
    """A finding on one configured cache size: a warning when it is more than ``limit`` allows."""
    if configured_bytes <= limit.limit_bytes:
        return Finding.passed(
            check, f"{setting} {format_size(configured_bytes)} fits in {limit.source}, {format_size(limit.limit_bytes)}"
        )
    return Finding.warned(
        check,
        f"{setting} is {format_size(configured_bytes)}, more than {limit.source}, {format_size(limit.limit_bytes)}: "
        "the engine can be killed for memory as its cache fills",
        f"lower {setting} to well under {format_size(limit.limit_bytes)}, leaving room for the engine itself",
    )
