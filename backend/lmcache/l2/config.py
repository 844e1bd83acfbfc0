"""KVPoolL2AdapterConfig: the ``adapter_params`` of the kvpool L2 adapter, validated once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from backend.client import MAX_LEASE_TTL_MS
from backend.config import PoolConfig
from backend.config.suggest import did_you_mean
from backend.errors import ConfigError
from backend.lmcache.config import pool_config_from

__all__ = ["KVPoolL2AdapterConfig", "ADAPTER_PARAMS", "DEFAULT_LEASE_TTL_MS", "DEFAULT_USAGE_REFRESH_MS"]

DEFAULT_LEASE_TTL_MS = 30_000  # longer than LMCache's lookup -> load window; a crash frees it by itself
DEFAULT_USAGE_REFRESH_MS = 10_000  # registry capacity and per-salt bytes are at most this old
ADAPTER_PARAMS = ("url", "lock_ttl_ms", "usage_refresh_ms")


class KVPoolL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """``adapter_params`` of the kvpool L2 adapter: the pool URL and lease settings.

    ``lock_ttl_ms`` (the public key, after LMCache's lookup-and-lock) is the ttl of the lease
    each looked-up chunk takes on its node.
    """

    def __init__(
        self,
        pool: PoolConfig,
        lock_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
        usage_refresh_ms: int = DEFAULT_USAGE_REFRESH_MS,
    ) -> None:
        super().__init__()
        self.pool = pool
        self.lock_ttl_ms = lock_ttl_ms
        self.usage_refresh_ms = usage_refresh_ms

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVPoolL2AdapterConfig:
        """Validate ``adapter_params``; a ConfigError (a ValueError) names the bad key."""
        if not isinstance(d, dict):
            raise ConfigError("adapter_params", f"must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - set(ADAPTER_PARAMS) - {"type"})
        if unknown:
            hint = did_you_mean(unknown[0], ADAPTER_PARAMS)
            raise ConfigError(
                f"adapter_params.{unknown[0]}",
                f"unknown option; {hint + ' ' if hint else ''}known: {', '.join(ADAPTER_PARAMS)}",
            )
        pool = pool_config_from(d.get("url") or None, "adapter_params.url", multiprocess=True)
        lock_ttl_ms = _positive_int(d, "lock_ttl_ms", DEFAULT_LEASE_TTL_MS)
        if lock_ttl_ms > MAX_LEASE_TTL_MS:
            raise ConfigError(
                "adapter_params.lock_ttl_ms", f"{lock_ttl_ms} exceeds the nodes' bound of {MAX_LEASE_TTL_MS}"
            )
        return cls(pool, lock_ttl_ms, _positive_int(d, "usage_refresh_ms", DEFAULT_USAGE_REFRESH_MS))

    @classmethod
    def help(cls) -> str:
        return (
            "kvpool L2 adapter (load with type 'plugin', module_path 'kvpool.lmcache_l2_adapter',\n"
            "class_name 'KVPoolL2Adapter'). adapter_params:\n"
            "- url (str): kvpool://[:TOKEN@]REDIS_HOST:PORT/NAMESPACE[?options] (or KVPOOL_URL)\n"
            f"- lock_ttl_ms (int): lease of a looked-up chunk (default {DEFAULT_LEASE_TTL_MS})\n"
            f"- usage_refresh_ms (int): how often capacity and per-salt usage are refreshed "
            f"(default {DEFAULT_USAGE_REFRESH_MS})"
        )


def _positive_int(d: Mapping[str, Any], name: str, default: int) -> int:
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"adapter_params.{name}", f"must be a positive integer, got {value!r}")
    return value
