"""Another user on a node's host: the shared-memory files that carry chunks are their owner's alone."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from backend.node.memory.arena import ShmArena
from backend.shm import PutStage

MIB = 1024 * 1024


def test_a_nodes_arena_and_a_clients_stage_are_readable_by_their_owner_only():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        old_umask = os.umask(0)  # even a process that lets everything through makes them 0600
        try:
            arena = ShmArena(Path(directory), MIB)
            stage = PutStage(directory, MIB)
        finally:
            os.umask(old_umask)
        try:
            for path in (arena.path, Path(stage.path)):
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
                assert path.stat().st_uid == os.getuid()
        finally:
            stage.close()
            arena.close()
