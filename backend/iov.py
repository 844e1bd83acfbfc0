"""Scatter-gather write loops: what is left to write after a partial ``writev``/``sendmsg``.

A vectored write may take fewer bytes than asked. The caller then drops what was
written from the front of its buffer list and calls again with the rest. Every
such loop in kvpool goes through :func:`advance`, which also drops buffers that
are empty, wherever they stand: a zero-length buffer left at the front makes the
next call write nothing, return 0, and the loop spins forever (an empty chunk
once wedged a node's NVMe writer that way, holding its lock).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Union

__all__ = ["IOV_MAX", "Buffer", "to_write", "advance"]

Buffer = Union[bytes, bytearray, memoryview]

# writev and sendmsg accept at most IOV_MAX (1024 on Linux) buffers per call.
IOV_MAX = 512


def to_write(buffers: Iterable[Buffer]) -> list[memoryview]:
    """The byte views still to write: each buffer as bytes, empty ones left out."""
    return [view for view in (memoryview(b).cast("B") for b in buffers) if len(view)]


def advance(views: list[memoryview], written: int) -> None:
    """Drop ``written`` bytes from the front of ``views`` (a :func:`to_write` list), in place.

    Raises OSError when ``written`` is more than is left, which no write call does.
    """
    while written:
        if not views:
            raise OSError(f"a write reported {written} bytes more than it was given")
        head = views[0]
        if written >= len(head):
            written -= len(head)
            views.pop(0)
        else:
            views[0] = head[written:]
            written = 0
