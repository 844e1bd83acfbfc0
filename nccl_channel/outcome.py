"""What a channel get returns for each key: the chunk landed and verified, or why the channel did not bring it.

No torch here: the client (``backend.client.channel``) reads these without loading the channel.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Generic, TypeVar

__all__ = ["Landed", "NotBrought", "Why", "ChannelResult"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Landed(Generic[T]):
    """The chunk is in the sink's buffer ``handle``, its checksum verified."""

    handle: T


class Why(enum.Enum):
    """Why one key did not come over the channel (the client then reads it over its next path)."""

    NOT_HELD = "the node does not hold it"
    NO_ROOM = "the sink had no room"
    CORRUPT = "checksum mismatch over the channel"
    OTHER_LAYOUT = "stored with another layout fingerprint"


@dataclasses.dataclass(frozen=True, slots=True)
class NotBrought:
    """The channel did not bring this key; ``why`` says why."""

    why: Why


ChannelResult = Landed[T] | NotBrought
