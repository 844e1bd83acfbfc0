"""kvpool: a disaggregated KV-cache pool that LMCache uses as remote storage.

The public surface is what ``__all__`` lists; everything else is private.

The client and the config are imported on first use: both need redis-py, and
``nccl_channel`` (which imports ``backend.errors`` and ``backend.protocol``) must load
on a GPU machine that has no redis-py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from backend.errors import (
    AuthError,
    BusyError,
    CapacityError,
    ConfigError,
    IntegrityError,
    KVPoolError,
    MetadataError,
    NcclError,
    NodeUnavailable,
    ProtocolError,
    PutOutcome,
)

if TYPE_CHECKING:
    from backend.client import Chunk, Fetched, Lock, PoolClient, SyncPoolClient
    from backend.config import PoolConfig

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "PoolClient",
    "SyncPoolClient",
    "PoolConfig",
    "Chunk",
    "Fetched",
    "Lock",
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
]

# public name -> the module that defines it, imported when the name is first used
_LAZY = {
    "PoolClient": "backend.client",
    "SyncPoolClient": "backend.client",
    "Chunk": "backend.client",
    "Fetched": "backend.client",
    "Lock": "backend.client",
    "PoolConfig": "backend.config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
