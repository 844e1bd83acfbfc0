"""Whether the pool can serve a connector's engine: the check at start, the quiet rechecks, the ``pool_up`` metric.

LMCache itself would only ever show misses when the pool is not usable, so the connector says it
once, loudly, with its cause (``backend.doctor``'s findings and docs/troubleshooting.md), then looks
again every ``POOL_RECHECK_S`` until the pool is usable and says that once too. Everything here runs on
LMCache's loop and never blocks it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from backend.client import PoolClient
from backend.doctor import TROUBLESHOOTING, Finding, reach
from backend.errors import KVPoolError

__all__ = ["POOL_RECHECK_S", "PoolHealth"]

logger = logging.getLogger(__name__)

# While the pool is not usable (start check failed), how often the connector looks again, quietly,
# so that its metric turns to 1 (and one line says so) once the pool is up.
POOL_RECHECK_S = 10.0


class PoolHealth:
    """The pool as one connector's client sees it: usable or not, and why not (``problem``)."""

    def __init__(self, client: PoolClient, url: str, fix_hint: str, closed: Callable[[], bool]) -> None:
        """``url``: the pool's URL as the logs show it (no token); ``fix_hint``: what the start error suggests
        when the finding names no fix; ``closed``: whether the connector closed (the rechecks stop)."""
        self.client = client
        self._url = url
        self._fix_hint = fix_hint
        self._closed = closed
        # Why the pool is not usable (None: it is); unknown until the start check answers.
        self.problem: Finding | None = None
        self._checked = False
        self._recheck: asyncio.Task[None] | None = None

    def state(self) -> tuple[bool, str] | None:
        """For the ``pool_up`` metric: usable or not, and why not (None before the start check answered)."""
        if not self._checked:
            return None
        problem = self.problem
        if problem is None:
            return True, ""
        return False, problem.cause.slug if problem.cause is not None else "unknown"

    async def _problem(self, search_elsewhere: bool = True) -> Finding | None:
        """Why the pool cannot serve this engine (None: Redis answers with these credentials and a node is alive).
        ``search_elsewhere``: look for the namespaces that have live nodes (a keyspace SCAN: the start check
        only, never the timer's)."""
        try:
            found = await reach(self.client, search_elsewhere=search_elsewhere)
        except KVPoolError as exc:
            return Finding.failed("pool", str(exc))
        return next((f for f in found if not f.ok), None)

    async def _usable(self, said: str, level: int) -> bool:
        """The pool answered: learn its nodes and open the put connections; False if that failed (said once)."""
        try:
            nodes = await self.client.nodes(refresh=True)
            logger.log(level, "kvpool: %s %s (%d live nodes)", said, self._url, len(nodes))
            # The engine will put: the first put to a node on this host should not wait for its stage.
            await self.client.prepare_puts()
        except KVPoolError as exc:
            logger.warning("kvpool: pool %s answered, then failed: %s", self._url, exc)
            return False
        return True

    async def startup_check(self) -> None:
        """The check at start: say once, with its cause, that the pool is not usable, and recheck until it is."""
        problem = await self._problem()
        if problem is None:
            usable = await self._usable("connected to", logging.INFO)
            self.problem, self._checked = None, True  # after the log line, as the recheck does
            if not usable:
                self._recheck = asyncio.ensure_future(self._recheck_until_usable())
            return
        self.problem, self._checked = problem, True
        where = f" ({problem.cause.title}: {TROUBLESHOOTING}#{problem.cause.slug})" if problem.cause else ""
        logger.error(
            "kvpool: pool %s is not usable at start: %s%s; every lookup misses until it is (metric "
            "kvpool_connector_pool_up 0). Fix: %s; `kvpool doctor --url URL` checks it",
            self._url,
            problem.detail,
            where,
            problem.fix or self._fix_hint,
        )
        self._recheck = asyncio.ensure_future(self._recheck_until_usable())

    async def _recheck_until_usable(self) -> None:
        """Look again every ``POOL_RECHECK_S`` until the pool is usable; say so once, then stop."""
        while not self._closed():
            await asyncio.sleep(POOL_RECHECK_S)
            problem = await self._problem(search_elsewhere=False)
            known = self.problem
            if problem is not None and known is not None and problem.check == known.check == "nodes":
                problem = known  # the start check's search for other namespaces named the cause better
            if problem is not None:
                self.problem = problem
            elif await self._usable("pool is usable now:", logging.WARNING):
                # Up only once it said so and its put connections are open: the metric never runs ahead of the log.
                self.problem = None
                return

    def close(self) -> None:
        """Stop rechecking."""
        if self._recheck is not None:
            self._recheck.cancel()
