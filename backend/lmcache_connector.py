"""The module path LMCache configs name for kvpool's in-process connector; the code is backend.lmcache.connector.

Kept for configs written before kvpool.lmcache_connector (the public path, docs/api.md) existed; it
loads the same classes. New configs name kvpool.lmcache_connector.
"""

from backend.lmcache.connector import (
    ALLOCATE_TIMEOUT_S,
    CLIENT_COUNTERS,
    KVPoolConnector,
    KVPoolConnectorAdapter,
    KVPoolRemoteURLConnector,
)
from backend.lmcache.doctor import diagnose

__all__ = [
    "KVPoolConnector",
    "KVPoolConnectorAdapter",
    "KVPoolRemoteURLConnector",
    "ALLOCATE_TIMEOUT_S",
    "CLIENT_COUNTERS",
    "diagnose",
]
