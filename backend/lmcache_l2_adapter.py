"""The module path LMCache's ``--l2-adapter`` JSON names for kvpool; the code is backend.lmcache.l2.

Kept for configs written before kvpool.lmcache_l2_adapter (the public path, docs/api.md) existed; it
loads the same classes. New configs name kvpool.lmcache_l2_adapter.
"""

from backend.lmcache.l2 import (
    MP_KEY_PREFIX,
    KVPoolL2Adapter,
    KVPoolL2AdapterConfig,
    object_key_from_pool_key,
    pool_key,
    salt_pattern,
)

__all__ = [
    "KVPoolL2Adapter",
    "KVPoolL2AdapterConfig",
    "MP_KEY_PREFIX",
    "pool_key",
    "object_key_from_pool_key",
    "salt_pattern",
]
