"""The module path LMCache configs name for kvpool's in-process connector (public API).

The plugin form's ``remote_storage_plugin.kvpool.module_path`` and the ``remote_url``
form's ``external://HOST:PORT/kvpool.lmcache_connector/?connector_name=...`` name this
module, as ``kvpool lmcache-config`` prints them. The code is backend.lmcache.connector.
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
