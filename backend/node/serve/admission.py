"""Connections that have not finished their handshake yet: how many a node keeps, and what it says about them.

A connection is *pending* from its accept until it is *admitted*: on a node with a
token when its AUTH succeeds, on a node without one when its first complete frame has
arrived (a kvpool client's HELLO). Until then it has proven nothing, so it gets little:

* a deadline (``--handshake-timeout-s``, from the accept, TLS handshake included);
  the session enforces it and reports a miss here (``handshake_timeouts``);
* a small meta section (``Limits.max_handshake_meta_bytes``, checked by the session);
* a place among at most ``--max-pending-connections`` pending connections. Above the
  cap the *oldest* pending one is closed (``connections_shed``): a peer that holds
  connections open without a handshake loses them first, while a client that connects
  and authenticates in a few round trips is rarely the oldest. Refusing new ones
  instead would let such a peer lock every client out by keeping the cap full.

Both events are counted one by one but logged at most once a minute, with the number
since the last line: a flood must not become a flood of log lines too.

A connection closed for either reason is first told why (:func:`say_why`): an error
frame with request id 0 and status ``UNAVAILABLE`` whose message is the reason, e.g.
``node N shed this connection: over 1024 connections without a finished handshake``,
which a kvpool client raises as its NodeUnavailable. It is written only if it can go
at once (one non-blocking send into the socket's empty buffer, never waited on), so a
peer that reads nothing holds nothing of the node's; what the peer sent and nobody will
read is dropped first, so that the close reaches it as a FIN after the frame rather
than a reset. A connection the node could not accept (out of file descriptors) is
never spoken to: the client says it was closed without a reason.

Admitted connections are not limited here: a client keeps its pooled connections
open and idle as long as it likes.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import time
from collections import Counter
from typing import Any

from backend.counters import NodeCounter
from backend.protocol import Op, Status
from backend.protocol.frame import RESPONSE_BIT, encode_header
from backend.transport import FrameSocket

__all__ = ["Admission", "ThrottledWarning", "say_why"]

logger = logging.getLogger(__name__)

WARNING_INTERVAL_S = 60.0
UNREAD_DROP_BYTES = 256 * 1024  # at most this much of a closing peer's unread bytes is read and dropped


class ThrottledWarning:
    """A warning logged at most once per ``interval_s``; the next line says how many were held back."""

    def __init__(self, interval_s: float = WARNING_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_at = float("-inf")
        self._held_back = 0

    def warn(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_at < self.interval_s:
            self._held_back += 1
            return
        if self._held_back:
            message += f" ({self._held_back} more in the last {now - self._last_at:.0f} s, not logged)"
        logger.warning(message, *args)
        self._last_at = now
        self._held_back = 0


class Admission:
    """The node's pending connections, oldest first, and the cap on how many there are."""

    def __init__(self, counters: Counter[NodeCounter], max_pending: int) -> None:
        self.counters = counters
        self.max_pending = max_pending
        self._pending: dict[FrameSocket, None] = {}  # insertion order: oldest first
        self._shed_warning = ThrottledWarning()
        self._timeout_warning = ThrottledWarning()

    def __len__(self) -> int:
        return len(self._pending)

    def arrived(self, conn: FrameSocket, node_id: str) -> None:
        """Count ``conn`` as pending; if that makes too many, close the oldest pending ones.

        Closing wakes the oldest's session with NodeUnavailable, and it ends as if its peer had left.
        """
        while len(self._pending) >= self.max_pending:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            say_why(
                oldest,
                f"node {node_id} shed this connection: over {self.max_pending} connections without a finished "
                "handshake (the oldest are closed first: a connection flood, or a burst of clients above "
                "--max-pending-connections)",
            )
            oldest.close()
            self.counters[NodeCounter.CONNECTIONS_SHED] += 1
            self._shed_warning.warn(
                "node %s: over %d connections without a finished handshake; closed the oldest (%s)",
                node_id,
                self.max_pending,
                oldest.peer,
            )
        self._pending[conn] = None

    def admitted(self, conn: FrameSocket) -> None:
        """``conn`` finished its handshake (or ended): it no longer counts against the cap."""
        self._pending.pop(conn, None)

    def timed_out(self, conn: FrameSocket, node_id: str, timeout_s: float) -> None:
        """``conn`` missed the handshake deadline: told so here, closed by its session."""
        say_why(
            conn,
            f"node {node_id} closed this connection: its handshake did not finish within {timeout_s:.1f} s of the "
            "connect (--handshake-timeout-s)",
        )
        self.counters[NodeCounter.HANDSHAKE_TIMEOUTS] += 1
        self._timeout_warning.warn(
            "node %s: %s did not finish its handshake within %.1f s; closed", node_id, conn.peer, timeout_s
        )


def say_why(conn: FrameSocket, reason: str) -> bool:
    """Tell the peer of ``conn``, which the node is about to close, why: an ``UNAVAILABLE`` error
    frame for request id 0. Whether it went out whole.

    Never waits: one non-blocking send, skipped when a frame of the session is half-sent
    (the stream would be cut) or when TLS is not set up yet. Then what the peer sent and
    nobody will read is dropped (up to ``UNREAD_DROP_BYTES``, without waiting), so that
    the close that follows is a FIN behind the frame, not a reset.
    """
    if conn.closed or conn.send_lock.locked():
        return False
    sock = conn.sock
    message = reason.encode("utf-8", "replace")[:4096]
    frame = encode_header(Op.PING | RESPONSE_BIT, 0, message, 0, Status.UNAVAILABLE) + message
    try:
        if isinstance(sock, ssl.SSLSocket):
            if sock.version() is None:
                return False  # the TLS handshake is not done: nothing can be said in it
            sent = sock.send(frame)
        else:
            sent = sock.send(frame, socket.MSG_DONTWAIT)
    except (OSError, ValueError):  # (ssl.SSLError is an OSError: a write that would block, a closed peer)
        return False
    if not isinstance(sock, ssl.SSLSocket):
        with contextlib.suppress(OSError):
            dropped = 0
            while dropped < UNREAD_DROP_BYTES:
                piece = sock.recv(65536, socket.MSG_DONTWAIT)
                if not piece:
                    break
                dropped += len(piece)
    return sent == len(frame)
