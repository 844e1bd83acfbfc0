"""kvpool: a disaggregated KV-cache pool that LMCache uses as remote storage.

This package is the public API: the names in ``__all__`` here, and the two module paths
LMCache configs name (:mod:`kvpool.lmcache_connector`, :mod:`kvpool.lmcache_l2_adapter`).
They keep their meaning across minor releases (docs/api.md). The implementation lives in
``backend``; its modules may change in any release.

The client, the config and the events keys are imported on first use: they need redis-py
(the keys pyzmq), and the errors must import on a GPU machine that has neither.
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
from backend.version import __version__

if TYPE_CHECKING:
    from backend.client import Chunk, Fetched, Lock, PoolClient, SyncPoolClient
    from backend.config import PoolConfig
    from backend.events.auth import CurveKeys, curve_keys

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
    "CurveKeys",
    "curve_keys",
]

# public name -> the module that defines it, imported when the name is first used
LAZY = {
    "PoolClient": "backend.client",
    "SyncPoolClient": "backend.client",
    "Chunk": "backend.client",
    "Fetched": "backend.client",
    "Lock": "backend.client",
    "PoolConfig": "backend.config",
    # what a subscriber of `kvpool events` needs for its CURVE handshake (needs pyzmq: the [events] extra)
    "CurveKeys": "backend.events.auth",
    "curve_keys": "backend.events.auth",
}


def __getattr__(name: str) -> Any:
    module = LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY))
