"""A node's claim on its id: one process per node id, taken before anything of the id is touched.

Two processes under one id would both beat, and whichever took the newer epoch makes the
other's index entries look like those of an ended run: the dead-node reaper removes them.
So a node claims its id in Redis before it touches anything the id names (its NVMe
directory, the registry, the index), and the claim is exclusive:

* **Free id** (no heartbeat key): taken at once, atomically (``CLAIM_LUA``): of two nodes
  started at once under one id, exactly one wins.
* **Held id**: the heartbeat key holds another run's epoch. That run is alive if it renews
  the key, dead if it stopped (``kill -9``: its last beat stays for up to one TTL). The
  node watches the key's PTTL for at most what it has left: a PTTL that grows was renewed,
  so a live process holds the id and this node refuses to start (``ConfigError`` naming
  the id and the holder's address and pid, exit code 2), having written nothing; a key
  that expires was a dead run's, and the node takes the id over. A crashed node restarted
  at once thus starts within one ``heartbeat_ttl_s``, and recovers its NVMe chunks as before.
* **While starting** (recovery, prefault, the first publication), :meth:`IdClaim.kept`
  renews the claim every heartbeat interval, so a slow start-up never lets it lapse; from
  the first heartbeat on, each beat renews it (``BEAT_LUA``), and only its own.

A running node whose beat finds another epoch on its id (possible only if its beat lapsed
for a whole TTL, frozen or cut off from Redis, and another process claimed the id
meanwhile, or if Redis lost its keys) does not fight for it: the publisher logs an ERROR
and stops the node (``IndexPublisher``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from backend.config import NodeConfig
from backend.config.values import check_node_id, default_node_id, ms_to_s, s_to_ms
from backend.errors import ConfigError, MetadataError
from backend.metadata import ClaimHeld, ClaimHolder
from backend.node.index.recovery import NODE_ID_FILE, stored_node_id

__all__ = ["CLAIM_POLL_S", "ClaimLost", "ClaimStore", "IdClaim", "chosen_node_id"]

logger = logging.getLogger(__name__)

CLAIM_POLL_S = 0.1  # how often a held id's heartbeat is looked at while its holder may be dead


async def chosen_node_id(given: str, nvme_root: Path | None, port: int) -> tuple[str, str]:
    """The id this node is to claim, and where it came from (for errors): ``--node-id``, else the id kept
    in the NVMe directory (read only: it is written once claimed), else a new one: HOSTNAME-XXXXXXXX
    with an NVMe tier (kept from then on), HOSTNAME-PORT without. Checked against the node id rule."""
    if given:
        return check_node_id(given, "--node-id"), "--node-id"
    if nvme_root is not None:
        stored = await asyncio.to_thread(stored_node_id, nvme_root)
        if stored:
            source = f"the node id kept in {nvme_root / NODE_ID_FILE}"
            return check_node_id(stored, source), source
        return default_node_id(socket.gethostname(), uuid.uuid4().hex[:8]), "node id"
    return default_node_id(socket.gethostname(), str(port)), "node id"


class ClaimLost(MetadataError):
    """Another process holds this node's id now: this node must stop serving under it."""


class ClaimStore(Protocol):
    """What a claim asks of Redis (``backend.metadata.NodeRegistry``)."""

    async def claim(self, node_id: str, holder: ClaimHolder, ttl_ms: int) -> ClaimHeld | None: ...


class IdClaim:
    """This node's claim on ``node_id`` for ``holder.epoch``, held for ``config``'s heartbeat TTL and
    renewed every heartbeat interval; ``source`` names where the id came from."""

    def __init__(self, store: ClaimStore, node_id: str, holder: ClaimHolder, config: NodeConfig, source: str) -> None:
        self.store = store
        self.node_id = node_id
        self.holder = holder
        self.ttl_ms = s_to_ms(config.heartbeat_ttl_s)
        self.interval_s = config.heartbeat_interval_s
        self.source = source

    async def take(self) -> None:
        """Claim the id, waiting out a holder that may be dead; ConfigError while a live one holds it."""
        logger.info("claiming node id %s (epoch %d)", self.node_id, self.holder.epoch)
        watched: ClaimHeld | None = None
        lowest_ms = 0  # the least time the watched beat had left: it only grows if renewed
        while True:
            held = await self.store.claim(self.node_id, self.holder, self.ttl_ms)
            if held is None:
                if watched is not None:
                    logger.warning(
                        "node id %s: the heartbeat of %s lapsed; this node takes the id over",
                        self.node_id,
                        watched.holder.describe(),
                    )
                return
            if watched is None:
                watched, lowest_ms = held, held.ttl_left_ms
                logger.warning(
                    "node id %s is held by %s, whose heartbeat has %d ms left: waiting for it to lapse "
                    "(a crashed node: its id is taken over) or be renewed (a live node: this one stops)",
                    self.node_id,
                    held.holder.describe(),
                    held.ttl_left_ms,
                )
            elif held.holder.epoch != watched.holder.epoch:
                raise self._refused(held, "claimed it meanwhile")
            elif held.ttl_left_ms > lowest_ms:
                raise self._refused(held, "renewed its heartbeat")
            if held.ttl_left_ms < 0:  # a key without an expiry (no node sets one) would never lapse
                raise self._refused(held, "holds it with a heartbeat key that never expires")
            lowest_ms = min(lowest_ms, held.ttl_left_ms)
            await asyncio.sleep(min(CLAIM_POLL_S, ms_to_s(max(held.ttl_left_ms, 1))))

    def _refused(self, held: ClaimHeld, how: str) -> ConfigError:
        return ConfigError(
            self.source,
            f"node id {self.node_id!r} is held by a live node: {held.holder.describe()} {how}. Two processes "
            "under one id would destroy each other's index entries, so this node does not start and has "
            "touched nothing of the other's; stop that node first, or give this one another --node-id",
        )

    async def renew(self) -> None:
        """Renew the claim for another TTL; ClaimLost if another process holds the id now."""
        held = await self.store.claim(self.node_id, self.holder, self.ttl_ms)
        if held is not None:
            raise ClaimLost(
                f"node id {self.node_id!r} was taken by {held.holder.describe()} while this node started "
                "(its claim lapsed: Redis did not take its renewals for a whole heartbeat TTL)"
            )

    @contextlib.asynccontextmanager
    async def kept(self) -> AsyncIterator[None]:
        """Renew the claim every heartbeat interval while the block runs (a slow start-up keeps its id);
        raises at the end of the block if the claim was lost meanwhile."""
        lost: list[ClaimLost] = []

        async def keep() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                try:
                    await self.renew()
                except ClaimLost as exc:
                    lost.append(exc)
                    return
                except MetadataError as exc:  # Redis trouble: the next renewal may land, within the TTL
                    logger.warning("node id %s: could not renew its claim: %s", self.node_id, exc)

        keeper = asyncio.get_running_loop().create_task(keep())
        try:
            yield
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        if lost:
            raise lost[0]
