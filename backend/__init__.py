"""kvpool: a disaggregated KV-cache pool that LMCache uses as remote storage.

The public surface is what ``__all__`` lists; everything else is private.
"""

from backend.client import Chunk, Fetched, Lock, PoolClient, SyncPoolClient
from backend.config import PoolConfig
from backend.errors import (
    AuthError,
    CapacityError,
    ConfigError,
    IntegrityError,
    KVPoolError,
    MetadataError,
    NcclError,
    NodeUnavailable,
    ProtocolError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "PoolClient",
    "SyncPoolClient",
    "PoolConfig",
    "Chunk",
    "Fetched",
    "Lock",
    "KVPoolError",
    "ConfigError",
    "MetadataError",
    "NodeUnavailable",
    "ProtocolError",
    "AuthError",
    "CapacityError",
    "IntegrityError",
    "NcclError",
]
