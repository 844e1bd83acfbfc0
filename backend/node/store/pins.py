"""Pins: keys an operator holds on a node past any connection, reference-counted, with an optional ttl.

A pin is a lease of the node's :class:`~backend.node.store.leases.LeaseTable` whose owner is a
:class:`PinOwner` (a name, not a connection: no close ends it) and whose deadline comes
from the node's ttl settings or is none. So a pinned chunk is pinned exactly as a leased
one is (out of every eviction order, O(1), never demoted or evicted), and a key under two
pins stays pinned until both are let go (unpinned, or past their deadline). Each PIN
request is one lease over its keys; an UNPIN lets go of ``owner``'s newest pin of each key.

* A PIN names keys this node holds now (anything else is refused whole, nothing pinned);
  afterwards the pin is on the key: a chunk deleted, or lost from DRAM at a restart, is pinned
  again when a put brings it back, until the pin ends.
* With an NVMe tier, pins outlive a restart: every change is written to ``pins.json`` in
  the NVMe directory (tmp + fsync + rename + fsync of the directory, on a worker thread)
  before the request is answered, and a pinned chunk held only in DRAM gets a file too
  (it stays in DRAM), so the restarted node recovers both. Deadlines are kept as wall-clock
  times; a restarted node drops the pins past theirs and shortens any past its own cap.
  Without an NVMe tier pins live in memory only. Redis never holds a pin.
* Cost: nothing for a chunk no pin holds; a pinned key costs its entry in the lease
  table's count (a dict entry, ~100 B with the key) and a place in its pin's key set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from backend.errors import CapacityError, KVPoolError, ProtocolError
from backend.node.store.bookkeeping import IN_DRAM, NO_SLOT, ON_NVME, ChunkTable
from backend.node.store.leases import LeaseTable
from backend.protocol.pins import PinPage, PinRequest, PinRow

__all__ = ["PIN_FILE", "PinBook", "PinOwner", "PinTtl"]

logger = logging.getLogger(__name__)

PIN_FILE = "pins.json"
_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class PinOwner:
    """The owner of a pin: a name the operator chose (``kvpool pin --owner``), never a connection."""

    name: str


@dataclasses.dataclass(frozen=True)
class PinTtl:
    """The node's pin deadlines: ``default_s`` for a PIN that names none, at most ``max_s`` (0: no cap,
    and a PIN may then ask for no expiry with ttl 0)."""

    default_s: float
    max_s: float

    def applied(self, ttl_s: float | None) -> float:
        """The ttl a PIN of ``ttl_s`` gets (``math.inf``: no expiry).

        A ttl this node refuses is bad input, not a node failure: ProtocolError (a ``PROTOCOL`` error frame, as
        LEASE answers a ttl_ms over its cap) naming the ttl asked for and the cap, raised before anything is
        pinned."""
        ttl = self.default_s if ttl_s is None else ttl_s
        if not ttl >= 0:  # (NaN too; the codec refuses both before this)
            raise ProtocolError(f"PIN ttl_s {ttl:g} is not a number of seconds >= 0")
        if ttl == 0:
            if self.max_s:
                raise ProtocolError(
                    f"PIN ttl_s 0 (no expiry) is over this node's cap of {self.max_s:g} s (--pin-ttl-max-s; "
                    "0: no cap): nothing pinned"
                )
            return math.inf
        if self.max_s and ttl > self.max_s:
            raise ProtocolError(
                f"PIN ttl_s {ttl:g} s is over this node's cap of {self.max_s:g} s (--pin-ttl-max-s): nothing pinned"
            )
        return ttl


class PinBook:
    """The node's pins: PIN, UNPIN and PINS over the lease table, kept in ``pins.json`` with an NVMe tier."""

    def __init__(
        self,
        leases: LeaseTable,
        table: ChunkTable,
        ttl: PinTtl,
        state_dir: Path | None = None,
        save_copy: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.leases = leases
        self.table = table
        self.ttl = ttl
        self.path = state_dir / PIN_FILE if state_dir is not None else None
        self._save_copy = save_copy  # writes a DRAM chunk's NVMe file, keeping it in DRAM (Demoter.save_copy)
        self._saving = asyncio.Lock()

    # -- the ops ----------------------------------------------------------------------
    async def pin(self, request: PinRequest) -> tuple[list[bool], float | None]:
        """Pin ``request.keys`` for its owner; ``(held per key, the ttl applied or None for none)``.

        All or nothing: if a key is not held here, nothing is pinned (its flag says which).
        ProtocolError for a ttl the node's settings refuse; KVPoolError when the pin could not be saved.
        """
        ttl = self.ttl.applied(request.ttl_s)
        held = [key in self.table for key in request.keys]
        applied = None if ttl == math.inf else ttl
        if not all(held):
            return held, applied
        lease_id = self.leases.hold(set(request.keys), PinOwner(request.owner), time.monotonic() + ttl)
        try:
            await self._save()
        except OSError as exc:
            self.leases.release(lease_id)
            raise KVPoolError(f"nothing pinned: the pins file {self.path} could not be written ({exc})") from None
        await self._copy_to_disk(request.keys)
        return held, applied

    async def unpin(self, owner: str, keys: Sequence[str]) -> list[bool]:
        """Let go of ``owner``'s newest pin of each key; whether it had one."""
        self.leases.expire()
        done = [self.leases.release_one(PinOwner(owner), key) for key in keys]
        if any(done):
            try:
                await self._save()
            except OSError as exc:
                raise KVPoolError(
                    f"unpinned, but the pins file {self.path} could not be written ({exc}): a restart would pin "
                    "these keys again"
                ) from None
        return done

    def page(self, prefix: str, after: tuple[str, str] | None, limit: int) -> PinPage:
        """Up to ``limit`` rows of pinned keys starting with ``prefix``, in (key, owner) order after ``after``."""
        rows = sorted(r for r in self._rows() if r[0].startswith(prefix) and (after is None or r[:2] > after))
        now = time.monotonic()
        out = []
        for key, owner, refs, expires_at in rows[:limit]:
            slot = self.table.slot(key)
            out.append(
                PinRow(
                    key,
                    owner,
                    refs,
                    None if expires_at == math.inf else round(max(expires_at - now, 0.0), 3),
                    self.table.nbytes[slot] if slot != NO_SLOT else None,
                    _tier(self.table.where[slot]) if slot != NO_SLOT else None,
                )
            )
        return PinPage(tuple(out), len(rows) > limit)

    def totals(self) -> tuple[int, int]:
        """``(chunks, bytes)`` held now under a pin (the metrics' ``pinned_chunks`` and ``pinned_bytes``)."""
        keys = {key for owner in self._owners() for lease in self.leases.owned_by(owner) for key in lease.keys}
        slots = [s for s in map(self.table.slot, keys) if s != NO_SLOT]
        return len(slots), sum(self.table.nbytes[s] for s in slots)

    # -- persistence ------------------------------------------------------------------
    async def load(self) -> int:
        """Take back the pins a previous run saved (before NVMe recovery adopts its files, so a pinned chunk
        enters pinned); returns how many pins. Past their deadline: dropped; past this node's cap: shortened."""
        if self.path is None:
            return 0
        saved = await asyncio.to_thread(_read, self.path)
        now_wall, now = time.time(), time.monotonic()
        cap = self.ttl.max_s or math.inf
        taken = 0
        for owner, keys, expires_wall in saved:
            left = math.inf if expires_wall is None else expires_wall - now_wall
            if left <= 0 or not keys:
                continue
            self.leases.hold(keys, PinOwner(owner), now + min(left, cap))
            taken += 1
        if taken:
            logger.info("took back %d pins from %s", taken, self.path)
        return taken

    async def _save(self) -> None:
        """Write every live pin to ``pins.json`` (no NVMe tier: nothing to do). One write at a time, each of
        the state when it starts: a request is answered once a write that includes its change is done."""
        if self.path is None:
            return
        async with self._saving:
            now_wall, now = time.time(), time.monotonic()
            pins = [
                {
                    "owner": owner.name,
                    "keys": sorted(lease.keys),
                    "expires_at": None if lease.expires_at == math.inf else now_wall + (lease.expires_at - now),
                }
                for owner in self._owners()
                for lease in self.leases.owned_by(owner)
            ]
            await asyncio.to_thread(_write, self.path, {"format": _FORMAT, "pins": pins})

    async def _copy_to_disk(self, keys: Sequence[str]) -> None:
        """Give each pinned chunk held only in DRAM an NVMe file too, so a restart finds it."""
        if self._save_copy is None:
            return
        for key in keys:
            try:
                await self._save_copy(key)
            except CapacityError as exc:
                logger.warning("pinned chunk %s stays in DRAM only (a restart loses it): %s", key, exc)

    # -- reading the lease table ------------------------------------------------------
    def _owners(self) -> list[PinOwner]:
        return [owner for owner in self.leases.owners() if isinstance(owner, PinOwner)]

    def _rows(self) -> list[tuple[str, str, int, float]]:
        """``(key, owner, refs, latest deadline)`` per pinned key and owner."""
        rows: dict[tuple[str, str], tuple[int, float]] = {}
        for owner in self._owners():
            for lease in self.leases.owned_by(owner):
                for key in lease.keys:
                    refs, until = rows.get((key, owner.name), (0, 0.0))
                    rows[(key, owner.name)] = (refs + 1, max(until, lease.expires_at))
        return [(key, owner, refs, until) for (key, owner), (refs, until) in rows.items()]


def _tier(where: int) -> str:
    return "+".join(name for bit, name in ((IN_DRAM, "dram"), (ON_NVME, "nvme")) if where & bit)


def _read(path: Path) -> list[tuple[str, list[str], float | None]]:
    """The pins saved in ``path`` (none if it does not exist); a file that cannot be read is set aside
    (renamed ``.bad``, logged) rather than stop the node."""
    try:
        body: Any = json.loads(path.read_text())
        if body.get("format") != _FORMAT or not isinstance(body.get("pins"), list):
            raise ValueError(f"not a pins file of format {_FORMAT}")
        out = []
        for pin in body["pins"]:
            expires = pin["expires_at"]
            if not isinstance(pin["owner"], str) or not isinstance(pin["keys"], list):
                raise ValueError("a pin without owner or keys")
            out.append((pin["owner"], [str(k) for k in pin["keys"]], None if expires is None else float(expires)))
        return out
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        bad = path.with_suffix(".bad")
        logger.error("pins file %s cannot be read (%s): set aside as %s, no pins taken back", path, exc, bad)
        path.replace(bad)
        return []


def _write(path: Path, body: dict[str, Any]) -> None:
    """Crash ordering: the new file whole under a temporary name, fsync, rename over the old one, fsync the
    directory. A crash leaves the old file or the new one, never a mix."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as out:
        json.dump(body, out, separators=(",", ":"))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)  # the line that makes the write visible
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
