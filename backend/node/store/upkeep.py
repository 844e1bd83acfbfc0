"""What the node's background work asks of the store: its changes for the index, NVMe recovery, quotas, its report.

The index side of a node (``backend.node.index``: the publisher, recovery, the quota sync) and its
statistics ask these of :attr:`TierManager.upkeep`; the data path (puts, reads, deletes) asks the
manager itself.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from backend.counters import NodeCounter
from backend.node.store.bookkeeping import IndexChanges
from backend.node.store.chunk_memory import ChunkMemory
from backend.node.store.leases import LeaseTable
from backend.node.store.nvme_format import NvmeFile
from backend.node.store.nvme_tier import NvmeTier
from backend.node.store.quotas import PoolShare, TenantQuotas
from backend.node.store.room import NewerThanDisk
from backend.protocol.reports import ArenaReport, TenantReport, TierReport

__all__ = ["StoreReport", "StoreUpkeep"]


@dataclasses.dataclass(frozen=True)
class StoreReport:
    """The store's part of STAT: what the tiers and leases counted, and each part's report."""

    counters: Counter[NodeCounter]
    objects: int
    leases: int
    arena: ArenaReport | None
    tiers: dict[str, TierReport]
    tenants: dict[str, TenantReport]


class StoreUpkeep:
    """The store's side of keeping Redis in step, recovering NVMe files and reporting."""

    def __init__(
        self,
        changes: IndexChanges,
        newer: NewerThanDisk,
        nvme: NvmeTier | None,
        quotas: TenantQuotas,
        leases: LeaseTable,
        memory: ChunkMemory,
        counters: Counter[NodeCounter],
        tier_reports: Callable[[], dict[str, TierReport]],
        objects: Callable[[], int],
    ) -> None:
        self._changes = changes
        self._newer = newer
        self._nvme = nvme
        self._quotas = quotas
        self._leases = leases
        self._memory = memory
        self._counters = counters
        self._tier_reports = tier_reports
        self._objects = objects

    # -- the index --------------------------------------------------------------------
    def take_changes(self) -> tuple[set[str], dict[str, str]]:
        """The keys this node stopped holding and those that moved tier (to which) since the last take."""
        return self._changes.take()

    def keep_changes(self, removed: set[str], moved: dict[str, str]) -> None:
        """Changes taken that did not reach Redis: kept for the next take."""
        self._changes.put_back(removed, moved)

    def expire_leases(self) -> None:
        """End the leases whose time is up (each heartbeat)."""
        self._leases.expire()

    # -- NVMe recovery ----------------------------------------------------------------
    def begin_recovery(self) -> None:
        """From now on, remember the keys stored or deleted: they are newer than any file of them on disk."""
        self._newer.begin()

    def end_recovery(self) -> None:
        self._newer.end()

    def load_nvme(self, records: Iterable[NvmeFile]) -> list[NvmeFile]:
        """Adopt files found by recovery, oldest first (so eviction order follows file age); returns those adopted.

        Recovery runs while the node serves (``recovery.py``), handing files over in batches
        (``NvmeTier.load``: cheap per record): a key this run stored or deleted since it began
        (:meth:`begin_recovery`), or holds now, is newer than any file of it found on disk, which is not adopted.
        """
        assert self._nvme is not None
        return self._nvme.load(r for r in records if r.meta.key not in self._newer)

    def warn_if_nvme_larger_than_disk(self) -> None:
        if self._nvme is not None:
            self._nvme.warn_if_larger_than_disk()

    # -- tenant quotas ----------------------------------------------------------------
    def tenant_bytes(self, tenant: str) -> int:
        return self._quotas.held(tenant)

    def set_quota_limits(self, node: Mapping[str, int], pool: Mapping[str, PoolShare] | None = None) -> None:
        """Each tenant's quota on this node, and its share of a pool quota (``quotas.py``)."""
        self._quotas.set_limits(node, pool)

    # -- the report -------------------------------------------------------------------
    def report(self) -> StoreReport:
        return StoreReport(
            counters=self._counters + self._leases.counters,
            objects=self._objects(),
            leases=len(self._leases),
            arena=self._memory.report(),
            tiers=self._tier_reports(),
            tenants=self._quotas.reports(),
        )
