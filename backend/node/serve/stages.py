"""Client put stages in a node's arena directory: removed once no live client holds them.

A client on the node's host writes its puts into a stage file (``backend/shm.py``) that
it holds locked for its process's life; the node maps it per connection
(``Session.stage``) and drops that mapping when the connection closes. The file is the
client's, and the client removes it when it closes. One that dies without closing
(``kill -9``, the OOM killer) leaves it behind, 128 MiB of ``/dev/shm``: every
``STAGE_SWEEP_INTERVAL_S`` the node removes the stages of its directory that no live
process holds and that are at least ``STAGE_MIN_AGE_S`` old, so a dead client's stage is
gone within about ``STAGE_SWEEP_INTERVAL_S`` of its death. A live client's stage is never
taken: its lock is held until its process ends.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from backend.counters import NodeCounter
from backend.node.context import NodeContext
from backend.shm import remove_abandoned_stages

__all__ = ["STAGE_SWEEP_INTERVAL_S", "sweep_stages"]

logger = logging.getLogger(__name__)

STAGE_SWEEP_INTERVAL_S = 2.0  # a scan of the directory and a tried lock per stage: cheap


async def sweep_stages(ctx: NodeContext, directory: Path) -> None:
    """Until the node stops: every ``STAGE_SWEEP_INTERVAL_S``, remove the stages in ``directory`` no
    live client holds (counted as ``stages_removed``; each sweep done as ``stage_sweeps``)."""
    while not ctx.stopping:
        await asyncio.sleep(STAGE_SWEEP_INTERVAL_S)
        removed = await asyncio.to_thread(remove_abandoned_stages, directory)
        ctx.counters[NodeCounter.STAGE_SWEEPS] += 1
        if removed:
            ctx.counters[NodeCounter.STAGES_REMOVED] += removed
            logger.info(
                "node %s: removed %d put stage(s) in %s left by clients that are gone", ctx.node_id, removed, directory
            )
