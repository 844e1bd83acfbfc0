"""Deadlines: every bound a client waits under, derived from its :class:`PoolConfig` in one place.

The pool URL names two durations a client waits by (``connect_timeout_s``,
``progress_timeout_s``) and one it pairs by (``pair_timeout_s``). Every other bound
is a share or a multiple of them, and each is named here with why it is that long,
so no module multiplies a timeout by a factor of its own (a syntax-tree test,
tests/test_deadlines.py, holds every other module to it). docs/configuration.md's
deadline table lists every field; the same test reads it against this class.

The node's side of a put follows from the client's: the put carries ``room_wait_ms``
(the protocol's ``wait_ms``), and the node gives its index commit half of it
(``backend.node.serve.puts.commit_wait_s``), which is :attr:`Deadlines.commit_wait_s`.
"""

from __future__ import annotations

import dataclasses

from backend.config.pool import PoolConfig
from backend.config.values import s_to_ms

__all__ = ["Deadlines", "SLOWEST_TRANSFER_BYTES_PER_S"]

# A request that keeps moving bytes is waited on up to its silence plus its bytes at this rate (256 MiB: ~4 min).
SLOWEST_TRANSFER_BYTES_PER_S = 1024 * 1024
# Of the progress timeout, a node may hold a put back waiting for room; the rest is the bytes' and the reply's.
ROOM_WAIT_SHARE = 0.5
# Of the room wait, the node's index commit may wait for Redis (node: COMMIT_WAIT_SHARE), with this floor.
COMMIT_WAIT_SHARE = 0.5
MIN_COMMIT_WAIT_S = 0.05
# An LMCache worker thread waits this many progress timeouts for one call run on LMCache's loop:
# a lookup or a get may pay one timeout on a node, then its replica's answer.
CONNECTOR_CALL_FACTOR = 2
# The L2 adapter's synchronous delete, key listing and usage refresh wait this many progress timeouts:
# each is several Redis round trips and node requests in a row.
DELETE_FACTOR = 4


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """The bounds of one client, in seconds; build with :meth:`from_config`."""

    connect_s: float  # opening a connection to a node (TCP and TLS), a down node's probe included
    progress_s: float  # a node connection that moves no byte this long is given up, whatever the request's size
    redis_call_s: float  # one Redis call as a whole (connect, retries, answer): a Redis answer is small
    touch_s: float  # a node's answer to one lookup TOUCH: a hint, dropped when late, never retried
    room_wait_s: float  # a node may hold a put this long waiting for DRAM room before it answers busy
    commit_wait_s: float  # the node's index commit of a put waits this long for Redis (half the room wait)
    connector_call_s: float  # an LMCache worker thread waits this long for one call on LMCache's loop
    delete_s: float  # the L2 adapter's delete, key listing page and usage refresh (synchronous for LMCache)
    channel_transfer_s: float  # a channel transfer's base: nccl_channel adds its bytes at the floor rate
    pair_s: float  # one channel pairing, in the background: a cold NCCL init takes seconds

    @classmethod
    def from_config(cls, config: PoolConfig) -> Deadlines:
        progress_s = config.progress_timeout_s
        room_wait_s = progress_s * ROOM_WAIT_SHARE
        return cls(
            connect_s=config.connect_timeout_s,
            progress_s=progress_s,
            redis_call_s=progress_s,
            touch_s=progress_s,
            room_wait_s=room_wait_s,
            commit_wait_s=max(room_wait_s * COMMIT_WAIT_SHARE, MIN_COMMIT_WAIT_S),
            connector_call_s=progress_s * CONNECTOR_CALL_FACTOR,
            delete_s=progress_s * DELETE_FACTOR,
            channel_transfer_s=progress_s,
            pair_s=config.pair_timeout_s,
        )

    @property
    def room_wait_ms(self) -> int:
        """:attr:`room_wait_s` as the put's ``wait_ms`` on the wire."""
        return s_to_ms(self.room_wait_s)

    def request_silence_s(self, held_ahead_s: float) -> float:
        """How long a request's connection may move no byte: :attr:`progress_s` plus ``held_ahead_s``,
        the room waits of the puts ahead of it (a node reads a connection's frames in order)."""
        return self.progress_s + held_ahead_s

    @staticmethod
    def request_overall_s(silence_s: float, nbytes: int) -> float:
        """The bound on a request that keeps moving bytes: its silence plus its ``nbytes`` at
        :data:`SLOWEST_TRANSFER_BYTES_PER_S`."""
        return silence_s + nbytes / SLOWEST_TRANSFER_BYTES_PER_S
