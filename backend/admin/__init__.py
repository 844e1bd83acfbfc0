"""Admin operations behind the CLI: inspect, move and repair a pool.

Each function takes a :class:`PoolClient`; the CLI only parses arguments and
prints. The listings ``status``, ``nodes`` and ``stats`` return typed values
(:class:`PoolStatus`, :class:`NodeRow`, :class:`PoolStats`), built from the nodes'
typed STAT answers (``backend.protocol.reports.NodeReport``); ``ls`` streams JSON-ready rows; the
operations that remove, move or repair (evict, drain, flush, check) return a report
dataclass. Each one's ``to_json()`` is what ``--json`` prints. Nothing here holds more than
one batch of chunk bytes at a time. A node that refuses this client's token fails the
verb (AuthError naming the node): figures or removals without it would mislead.

One module per verb family: ``listing`` (status, nodes, ls, stats), ``removal`` (evict,
flush), ``draining`` (drain, undrain), ``fsck`` (check), ``pinning`` (pin, unpin, pins), ``quotas`` (quota);
``shared`` holds what they share.
None imports another family.
"""

from backend.admin.draining import DRAIN_BATCH_ITEMS, DrainReport, drain, undrain
from backend.admin.fsck import CheckFixes, CheckReport, Copy, check
from backend.admin.listing import (
    NodeRow,
    OpLatency,
    PoolStats,
    PoolStatus,
    RecentHits,
    StatusNode,
    iter_keys,
    node_rows,
    pool_stats,
    pool_status,
    redis_memory,
)
from backend.admin.pinning import DEFAULT_PIN_OWNER, NodePin, PinReport, UnpinReport, list_pins, pin, unpin
from backend.admin.quotas import TenantRow, clear_quota, list_quotas, set_quota
from backend.admin.removal import EvictReport, FlushReport, evict, flush
from backend.metadata import RedisMemory

__all__ = [
    "TenantRow",
    "clear_quota",
    "list_quotas",
    "set_quota",
    "DRAIN_BATCH_ITEMS",
    "RedisMemory",
    "redis_memory",
    "pool_status",
    "node_rows",
    "iter_keys",
    "pool_stats",
    "evict",
    "drain",
    "undrain",
    "flush",
    "check",
    "pin",
    "unpin",
    "list_pins",
    "DEFAULT_PIN_OWNER",
    "PinReport",
    "UnpinReport",
    "NodePin",
    "DrainReport",
    "EvictReport",
    "FlushReport",
    "CheckReport",
    "CheckFixes",
    "Copy",
    "PoolStatus",
    "StatusNode",
    "RecentHits",
    "NodeRow",
    "PoolStats",
    "OpLatency",
]
