"""A request's silence deadline: given up once its connection has moved no byte for a while.

A request on a node connection is bounded two ways (``Deadlines.request_silence_s`` and
``request_overall_s``, backend/config/deadlines.py): by silence, so a dead or partitioned
link costs the progress timeout whatever the request's size, and by an overall bound, so a
slow link that keeps moving bytes is waited on, but not for ever. :class:`SilenceWatch` is
the first; ``asyncio.timeout`` the second, and the watch expires that same timeout when the
silence is reached.
"""

from __future__ import annotations

import asyncio
import time

from backend.transport import FrameSocket

__all__ = ["SilenceWatch", "HELD_UP_RECHECK_S"]

HELD_UP_RECHECK_S = 0.05  # how soon a silence found to be this side's is looked at again


class SilenceWatch:
    """Expires a request's deadline once its socket has moved no byte for ``silence_s``.

    Checks the socket's progress timestamp once per ``silence_s`` (not per byte): a timer
    that re-arms itself for when the silence would reach the limit.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: FrameSocket, silence_s: float, deadline: asyncio.Timeout
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.silence_s = silence_s
        self.deadline = deadline
        self.since = time.monotonic()
        self.silent = False
        self._timer = loop.call_later(silence_s, self._check)

    def _check(self) -> None:
        quiet_since = max(self.sock.progress_at, self.since)
        left_s = quiet_since + self.silence_s - time.monotonic()
        if left_s > 0:
            self._timer = self.loop.call_later(left_s, self._check)
            return
        if self.sock.held_up_here():  # the peer sent; this side has not read yet: not its silence
            self._timer = self.loop.call_later(min(self.silence_s, HELD_UP_RECHECK_S), self._check)
            return
        self.silent = True
        if not self.deadline.expired():
            self.deadline.reschedule(self.loop.time())  # expires now: the request's task is cancelled

    def cancel(self) -> None:
        self._timer.cancel()
