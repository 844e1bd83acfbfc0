"""The module path LMCache's ``--l2-adapter`` JSON names for kvpool (public API).

``{"type": "plugin", "module_path": "kvpool.lmcache_l2_adapter", "class_name": "KVPoolL2Adapter",
"config_class_name": "KVPoolL2AdapterConfig", ...}``, as ``kvpool lmcache-config --mode mp``
prints it. The code is backend.lmcache.l2.
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
