"""kvpool as an L2 adapter of LMCache's multiprocess mode (see :mod:`.adapter`)."""

from backend.lmcache.l2.adapter import KVPoolL2Adapter
from backend.lmcache.l2.config import KVPoolL2AdapterConfig
from backend.lmcache.l2.keys import MP_KEY_PREFIX, object_key_from_pool_key, pool_key, salt_pattern

__all__ = [
    "KVPoolL2Adapter",
    "KVPoolL2AdapterConfig",
    "MP_KEY_PREFIX",
    "pool_key",
    "object_key_from_pool_key",
    "salt_pattern",
]
