"""Where a DRAM chunk's bytes go: the node's arena (shared memory, else private) and the private buffers beside it.

A chunk lives in the arena when it has room, so clients on this host can copy it without a
socket (``arena.py``); otherwise (no arena, a full one, or a chunk received in parts) in a
buffer of its own (``buffers.py``), served over TCP. The memory is taken once the node's Redis
and id are checked (``startup.py``), so a start that fails before costs none.
"""

from __future__ import annotations

import logging
from pathlib import Path

from backend.node.memory.arena import Arena, PrivateArena, ShmArena, remove_stale_arenas
from backend.node.memory.buffers import BufferFactory, ChunkBuffer
from backend.protocol.reports import ArenaReport

__all__ = ["ChunkMemory"]

logger = logging.getLogger(__name__)

PREFAULT_BUDGET_BYTES = 256 * 1024 * 1024  # ready, pre-faulted buffers (see buffers.py)
ARENA_SLACK = 0.25  # arena room beyond DRAM for regions still held by leases or replies in flight
ARENA_MIN_SLACK_BYTES = 64 * 1024 * 1024


class ChunkMemory:
    """The arena and the private buffers of one node's DRAM tier (none until :meth:`take`)."""

    def __init__(self, dram_bytes: int, shm_dir: Path | None, prefault: bool) -> None:
        self.dram_bytes = dram_bytes
        self.shm_dir = shm_dir  # where the shared-memory arena lives; None: the arena is private memory
        self.prefault = prefault  # a private arena's pages are taken at start
        self.arena: Arena | None = None  # None: each chunk a buffer of its own
        self.buffers = BufferFactory(0)

    def take(self) -> Arena | None:
        """Make the arena (:meth:`_open_arena`) and the private buffers, pre-faulted: for every chunk when there is no
        arena (else only for the chunks that do not go into it, which are few: no pool kept ready for them)."""
        self.arena = self._open_arena()
        prefault = 0 if self.arena is not None else min(PREFAULT_BUDGET_BYTES, self.dram_bytes // 4)
        self.buffers = BufferFactory(prefault)
        return self.arena

    def take_buffer(self, nbytes: int, *, shared: bool = True) -> ChunkBuffer:
        """A buffer for a chunk entering DRAM: in the arena when it has room (and ``shared``), else private."""
        if shared and self.arena is not None:
            buffer = self.arena.alloc(nbytes)
            if buffer is not None:
                return buffer
        return self.buffers.take(nbytes)

    @property
    def shm_arena(self) -> ShmArena | None:
        """The arena same-host clients may map (published in the registry), if DRAM is in one."""
        return self.arena if isinstance(self.arena, ShmArena) else None

    def report(self) -> ArenaReport | None:
        return self.arena.report() if self.arena is not None else None

    def close(self) -> None:
        self.buffers.close()
        if self.arena is not None:
            self.arena.close()

    def _open_arena(self) -> Arena | None:
        """The arena for DRAM: shared memory, else private (its pages taken at start with prefault, else as
        chunks are written); None (logged) when even a private one cannot be mapped."""
        size = self.dram_bytes + max(int(self.dram_bytes * ARENA_SLACK), ARENA_MIN_SLACK_BYTES)
        if self.shm_dir is not None:
            stale = remove_stale_arenas(self.shm_dir)
            if stale:
                logger.info("removed %d shared-memory arena(s) of nodes that no longer run", stale)
            try:
                return ShmArena(self.shm_dir, size)
            except OSError as exc:
                logger.warning(
                    "no shared-memory arena in %s (%s): same-host clients read over TCP",
                    self.shm_dir,
                    exc.strerror or exc,
                )
        try:
            return PrivateArena(size, populate=self.prefault)
        except OSError as exc:
            logger.warning("no private arena of %d bytes (%s): each chunk is a buffer of its own", size, exc.strerror)
            return None
