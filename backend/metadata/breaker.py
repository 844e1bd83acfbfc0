"""RedisBreaker: a Redis that stopped answering costs one timeout, not one per call.

A call that times out (no answer within its deadline: a silent link, a frozen Redis)
opens the breaker. While it is open every call fails at once with MetadataError (a
client reads that as misses, a node keeps serving what it holds), and a background
PING, bounded by ``PROBE_TIMEOUT_S``, asks Redis every ``PROBE_INTERVAL_S``; the first
answer closes it. A refused connection or an error reply does not open it: those come
back at once anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from backend.errors import MetadataError

__all__ = ["RedisBreaker", "PROBE_INTERVAL_S", "PROBE_TIMEOUT_S"]

logger = logging.getLogger("backend.metadata")

PROBE_INTERVAL_S = 0.5  # how often an open breaker asks Redis whether it answers again
PROBE_TIMEOUT_S = 1.0  # a PING slower than this (or than the call timeout, if shorter) is no answer


class RedisBreaker:
    """Open after a Redis call timed out, until a background PING is answered."""

    def __init__(self, ping: Callable[[], Awaitable[Any]], where: str, timeout_s: float) -> None:
        self._ping = ping
        self.where = where  # the Redis, as logs name it
        self.probe_timeout_s = min(timeout_s, PROBE_TIMEOUT_S)
        self.open_since: float | None = None  # monotonic time of the timeout that opened it
        self._probe: asyncio.Task[None] | None = None

    def check(self, action: str) -> None:
        """Raise MetadataError at once while the breaker is open (and make sure a probe runs)."""
        if self.open_since is None:
            return
        self._ensure_probe()
        raise MetadataError(
            f"Redis {action} not tried: {self.where} has not answered since a call timed out "
            f"{time.monotonic() - self.open_since:.1f} s ago; it is asked again every {PROBE_INTERVAL_S} s"
        )

    def timed_out(self) -> None:
        """A call got no answer in time: open, and probe in the background."""
        if self.open_since is None:
            self.open_since = time.monotonic()
            logger.warning(
                "Redis at %s timed out; calls fail at once (lookups read as misses) until it answers a PING",
                self.where,
            )
        self._ensure_probe()

    def _ensure_probe(self) -> None:
        loop = asyncio.get_running_loop()
        if self._probe is None or self._probe.done() or self._probe.get_loop() is not loop:
            self._probe = loop.create_task(self._probe_until_answered())

    async def _probe_until_answered(self) -> None:
        while self.open_since is not None:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                async with asyncio.timeout(self.probe_timeout_s):
                    await self._ping()
            except Exception:  # any failure is "not yet": the next probe asks again
                continue
            logger.warning(
                "Redis at %s answers again after %.1f s", self.where, time.monotonic() - (self.open_since or 0.0)
            )
            self.open_since = None

    def close(self) -> None:
        """Stop probing."""
        probe, self._probe = self._probe, None
        if probe is not None and not probe.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed already
                probe.cancel()
