"""A node's start, in one order: what costs nothing is checked before what costs time or memory, and a start
that fails leaves nothing behind.

The order, which :meth:`PoolNode.start <backend.node.server.PoolNode.start>` follows (docs/design.md):

1. **Secrets.** The token file and the Redis password file are read and checked when the node's settings
   are built (``NodeConfig.from_options``), before the node exists: a file missing, unreadable or empty,
   or a token too short, stops it naming the file.
2. **Local settings.** The TLS certificate and key, the channel's transport, the listen port
   (:func:`listen`; its number may be in the default node id).
3. **Redis** (:func:`check_redis`): reachable, the password accepted, version 7.0 or newer, this
   namespace's keys writable.
4. **The node id's claim** (``claim.py``), under the NVMe directory's lock (``dirlock.py``); then the id
   kept in that directory.
5. **The DRAM arena**, made and prefaulted (:func:`take_arena`): the first step that costs memory, and
   with ``--prefault`` seconds per GiB.
6. The metrics port (a startup probe waits for it: it opens once the arena is taken), the channel, and
   the **NVMe tier's recovery**, begun in the background (``recovery.py``).
7. **Join**: the registry entry and the first heartbeat (``publisher.py``).

A failure at any step, or a SIGTERM or Ctrl-C while starting, leaves nothing: the node cancels what it
began and gives back what the steps before took (its claim and registry entry, its ports, the arena,
whose file in ``/dev/shm`` is removed, the NVMe directory's lock), and removes the NVMe directory if this
start made it (:class:`NewDirectory`). The CLI prints the error's one line and exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from pathlib import Path

from backend.config import NodeConfig
from backend.config.values import format_size
from backend.errors import (
    MetadataError,
    NodeUnavailable,
    RedisAuthError,
    RedisPermissionError,
    RedisSlowError,
    RedisUnreachableError,
)
from backend.metadata import MetadataStore
from backend.node.index.recovery import NODE_ID_FILE
from backend.node.store.dirlock import LOCK_NAME
from backend.node.store.tiers import TierManager
from backend.redis_topology import RedisTarget, mask_url

__all__ = ["NewDirectory", "Prefault", "check_redis", "listen", "take_arena"]

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 512


def listen(config: NodeConfig) -> socket.socket:
    """The node's listening socket (non-blocking); NodeUnavailable naming the address if it cannot be had
    (taken, or not an address of this machine): a fact of the machine, exit 1."""
    try:
        listener = socket.create_server((config.host, config.port), backlog=LISTEN_BACKLOG, reuse_port=False)
    except OSError as exc:
        where = f"{config.host}:{config.port}"
        raise NodeUnavailable(f"port: cannot listen on {where}: {exc.strerror or exc}") from None
    listener.setblocking(False)
    return listener


async def check_redis(store: MetadataStore, config: NodeConfig) -> str:
    """Step 3: Redis answers, takes the password, is new enough, and lets this namespace's keys be written;
    returns its version ("" where this user may not ask). MetadataError with one line naming what is wrong
    and the flag that sets it."""
    where = mask_url(config.redis_url)
    try:
        await store.connection.ping()
    except RedisAuthError as exc:
        raise MetadataError(_password_refused(config, where, exc.reason)) from None
    except RedisSlowError as exc:
        raise MetadataError(f"Redis at {where} did not answer ({exc}); is it paused, overloaded or cut off?") from None
    except RedisUnreachableError as exc:
        raise MetadataError(
            f"Redis at {where} is unreachable ({exc.reason}); check that redis-server runs there and that --redis "
            "names it (host, port, and rediss:// for a TLS Redis)"
        ) from None
    except MetadataError as exc:
        raise MetadataError(
            f"Redis at {where} is unreachable ({exc}); check that redis-server runs there and that --redis "
            "names it (host, port, and rediss:// for a TLS Redis)"
        ) from None
    version = await store.connection.check_version()
    try:
        await store.connection.check_writable()
    except MetadataError as exc:
        why = exc.reason if isinstance(exc, (RedisAuthError, RedisPermissionError)) else str(exc)
        raise MetadataError(
            f"Redis at {where} does not let this node write the keys of namespace {config.namespace!r} ({why}): "
            "--redis must name a primary, not a read-only replica, and an ACL user needs the keys ~kvp:*"
        ) from None
    logger.info(
        "Redis at %s: version %s, password accepted, namespace %s writable",
        where,
        version or "unknown (this user may not run INFO)",
        config.namespace,
    )
    return version


def _password_refused(config: NodeConfig, where: str, reason: str) -> str:
    """The one line for a password Redis refused, naming where it came from (never what it is)."""
    target = RedisTarget.parse(config.redis_url, key="--redis")
    user = target.user or "default"
    if not (target.password or config.redis_password):
        return (
            f"Redis at {where} requires a password, and this node was given none: give "
            "--redis-password-file FILE (or set KVPOOL_REDIS_PASSWORD), and USER@ in --redis for an ACL user"
        )
    if target.password:
        source = "the --redis URL"
    elif config.redis_password_file:
        source = f"--redis-password-file {config.redis_password_file}"
    else:
        source = "KVPOOL_REDIS_PASSWORD"
    return (
        f"Redis refused the password ({reason}) of user {user!r}, from {source}, at {where}: give the password "
        "Redis requires (requirepass, or the ACL user's), and USER@ in --redis for an ACL user"
    )


@dataclasses.dataclass(frozen=True)
class Prefault:
    """What ``--prefault`` took of the DRAM arena at start, and how long it took."""

    taken_bytes: int = 0
    seconds: float = 0.0


async def take_arena(tiers: TierManager, prefault: bool, node_id: str) -> Prefault:
    """Step 5: make the DRAM arena (``TierManager.take_memory``) and, with ``--prefault``, take its pages now, on
    a worker thread: the node registers (and clients find it) only once its first puts find their pages ready."""
    arena = tiers.take_memory()
    if not prefault or arena is None:
        return Prefault()
    logger.info(
        "node %s: taking %s of memory for its DRAM arena before it registers (--prefault; 1-3 s per GiB)",
        node_id,
        format_size(arena.size_bytes),
    )
    started = time.monotonic()
    taken = await asyncio.to_thread(arena.prefault)
    seconds = time.monotonic() - started
    logger.info(
        "node %s: took %d bytes of memory for its DRAM arena (%s) in %.2f s",
        node_id,
        taken,
        arena.report().path,
        seconds,
    )
    return Prefault(taken, seconds)


class NewDirectory:
    """The NVMe directory, when this start is to make it (``--nvme-dir`` names one that does not exist yet):
    :meth:`remove` takes away what the start made there, if the start fails."""

    def __init__(self, path: Path | None) -> None:
        self.made: list[Path] = []  # the directories that do not exist yet, deepest first
        while path is not None and not path.exists():
            self.made.append(path)
            path = path.parent if path.parent != path else None

    def remove(self) -> None:
        """Remove the directory's lock and kept node id, the empty directories under it, and the directories
        made for it. Anything else found there stays (and is named): it is not this start's to remove."""
        if not self.made:
            return
        root = self.made[0]
        for name in (LOCK_NAME, NODE_ID_FILE):
            with contextlib.suppress(FileNotFoundError):
                (root / name).unlink()
        for below, _, _ in os.walk(root, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(below)
        for directory in self.made:
            try:
                directory.rmdir()
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("left %s, made by this start: %s", directory, exc.strerror or exc)
                return
