"""MissBoundary: where pool errors stop and become misses, for the connector and the L2 adapter alike.

The architecture lets only the LMCache layer turn library errors into misses, so
serving never fails because the pool did. Each miss is counted under its cause
(``miss_<cause>``); the first of an outage is logged, the rest are not, and the
first success after it logs that the cause recovered.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from backend.counters import MissCause
from backend.errors import KVPoolError

__all__ = ["MissBoundary"]

logger = logging.getLogger(__name__)


class MissBoundary:
    """Counts misses per cause into ``counters``; logs the first of each outage and its end."""

    def __init__(self, counters: Counter[str], label: str = "") -> None:
        self.counters = counters
        self._label = label  # names the layer in "recovered" lines ("L2 " for the adapter)
        self._reported: set[str] = set()

    def miss(self, cause: MissCause, message: str, *args: Any, level: int = logging.WARNING) -> None:
        """Count a miss of ``cause``; log ``message`` (prefixed ``kvpool: ``) if the outage is new."""
        self.counters[cause.counter] += 1
        if cause not in self._reported:
            self._reported.add(cause)
            logger.log(level, "kvpool: " + message, *args)

    def failed(self, cause: MissCause, what: str, exc: BaseException) -> None:
        """A task's error, as a miss: pool errors are logged once per outage, anything else with its trace."""
        if isinstance(exc, KVPoolError):
            self.miss(cause, "%s: %s", what, exc)
            return
        self.counters[cause.counter] += 1
        if f"bug:{cause}" not in self._reported:
            self._reported.add(f"bug:{cause}")
            logger.error("kvpool: %s (unexpected error)", what, exc_info=exc)

    def recovered(self, cause: MissCause) -> None:
        """``cause`` worked again: say so once if its outage was logged."""
        if cause in self._reported:
            self._reported.discard(cause)
            logger.warning("kvpool: %s%s recovered", self._label, cause)
