"""The implementation of kvpool. Import the public API from ``kvpool`` (docs/api.md).

The modules under ``backend`` may change in any release. The names ``kvpool`` exports
are still found here for one release (``from backend import SyncPoolClient``), with a
DeprecationWarning that names their new home; this module imports nothing until then,
so ``nccl_channel`` (which imports ``backend.errors``) loads on a GPU machine without
redis-py.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from backend.version import __version__

__all__ = ["__version__"]

# name kvpool exports -> the module of backend that defines it
MOVED = {
    **dict.fromkeys(("PoolClient", "SyncPoolClient", "Chunk", "Fetched", "Lock"), "backend.client"),
    "PoolConfig": "backend.config",
    **dict.fromkeys(
        (
            "PutOutcome",
            "KVPoolError",
            "ConfigError",
            "MetadataError",
            "NodeUnavailable",
            "ProtocolError",
            "AuthError",
            "CapacityError",
            "BusyError",
            "IntegrityError",
            "NcclError",
        ),
        "backend.errors",
    ),
}


def __getattr__(name: str) -> Any:
    module = MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'backend' has no attribute {name!r}")
    warnings.warn(
        f"'from backend import {name}' is deprecated: use 'from kvpool import {name}' (backend is the implementation)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
