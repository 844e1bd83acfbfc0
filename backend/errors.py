"""Every exception kvpool raises, in one tree.

::

    KVPoolError
    ├── ConfigError          bad URL / option, with the offending key named
    ├── MetadataError        Redis unreachable or inconsistent
    │   ├── RedisFullError   ... Redis refused a write: at maxmemory, evicting nothing
    │   ├── RedisSlowError   ... Redis gave no answer in time (paused, stopped, overloaded)
    │   ├── RedisUnreachableError ... nothing answers at the Redis URL (refused, no route, no such host)
    │   ├── RedisAuthError   ... Redis refused the password (none given, or a wrong one); also an AuthError
    │   └── RedisPermissionError ... Redis's ACL refused the user a command or a key (not authentication)
    ├── NodeUnavailable      connect / timeout / node gone
    ├── ProtocolError        malformed or unexpected frame
    ├── AuthError            missing or wrong credentials: a node's token, Redis's password (RedisAuthError)
    ├── CapacityError        no node can take the write
    │   └── BusyError        ... now: DRAM stayed full of puts in flight until the deadline
    ├── IntegrityError       checksum mismatch
    └── NcclError            binding or communicator failure

Library code raises these. Only the LMCache connector turns them into misses, so
serving never fails because the pool did.

A put that stored only part of its chunks raises with ``outcomes``: each chunk's
:class:`PutOutcome`, so a caller knows exactly which chunks are stored.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType

__all__ = [
    "PutOutcome",
    "KVPoolError",
    "ConfigError",
    "MetadataError",
    "RedisFullError",
    "RedisSlowError",
    "RedisUnreachableError",
    "RedisAuthError",
    "RedisPermissionError",
    "NodeUnavailable",
    "ProtocolError",
    "AuthError",
    "CapacityError",
    "BusyError",
    "IntegrityError",
    "NcclError",
    "refused_outcome",
]


class PutOutcome(enum.Enum):
    """What became of one chunk of a put: stored, or why not.

    A node answers one per chunk (``backend.protocol`` maps its PUT flags here);
    ``FAILED`` is the client's: the request carrying the chunk failed (the error says why).
    """

    STORED = "stored"
    NO_ROOM = "no room"  # larger than the DRAM tier, or the rest is leased or this same put's
    BUSY = "busy"  # DRAM stayed full of other puts in flight until the request's deadline
    CORRUPT = "corrupt"  # the bytes did not match their checksum on arrival
    FAILED = "failed"


class KVPoolError(Exception):
    """Base of every error kvpool raises.

    ``outcomes`` is set on the error of a put that did not store every chunk: each
    chunk's key and what became of it (empty on any other error).
    """

    outcomes: Mapping[str, PutOutcome] = MappingProxyType({})

    def not_stored(self) -> Counter[PutOutcome]:
        """How many chunks of the put were not stored, by outcome."""
        return Counter(o for o in self.outcomes.values() if o is not PutOutcome.STORED)


class ConfigError(KVPoolError, ValueError):
    """A URL, option or environment variable is malformed or unknown.

    ``key`` names the offending option (or ``"url"``) so callers can point at it.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class MetadataError(KVPoolError):
    """The metadata Redis is unreachable or holds something inconsistent."""


class RedisFullError(MetadataError):
    """Redis refused a write for lack of memory: it is at ``maxmemory`` and its policy evicts nothing."""


class RedisSlowError(MetadataError):
    """Redis gave no answer in time: paused, stopped, overloaded or cut off."""


class NodeUnavailable(KVPoolError):
    """A pool node could not be reached, timed out, or has left the pool."""


class ProtocolError(KVPoolError):
    """A frame was malformed, over a limit, or not what the exchange expected."""


class AuthError(KVPoolError):
    """Credentials were refused: a node refused the token (missing or wrong), or Redis the password
    (:class:`RedisAuthError`). ``except kvpool.AuthError`` catches both."""


class RedisUnreachableError(MetadataError):
    """Nothing answers at the Redis URL: the connection was refused (Redis not running, wrong port),
    or the host does not resolve or cannot be reached. ``reason``: what failed, in redis-py's words."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RedisAuthError(MetadataError, AuthError):
    """Redis refused the credentials: a wrong or missing password, or a disabled user. A
    :class:`MetadataError` (Redis is not usable) and an :class:`AuthError` (credentials refused).
    ``reason`` is Redis's own words (or that no password was given); ``password_given``: False when
    Redis asked for a password and none was given (NOAUTH)."""

    def __init__(self, message: str, reason: str, *, password_given: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.password_given = password_given


class RedisPermissionError(MetadataError):
    """Redis's ACL refused the (authenticated) user a command or a key (``NOPERM``): not an
    authentication failure, so not an :class:`AuthError`. ``reason`` is Redis's own words."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class CapacityError(KVPoolError):
    """No node can take the write."""


class BusyError(CapacityError):
    """No room now: the node's DRAM stayed full of puts in flight until the request's deadline.

    A put that only met busy nodes raises this: nothing failed, the pool was saturated,
    and a later put may well be stored (the LMCache layer counts it as a skipped put).
    """


class IntegrityError(KVPoolError):
    """Bytes did not match their recorded checksum."""


class NcclError(KVPoolError):
    """A libnccl call or communicator failed; carries the ncclResult code and its string."""

    def __init__(self, message: str, result: int = -1, result_string: str = "") -> None:
        detail = f" (ncclResult {result}: {result_string})" if result >= 0 else ""
        super().__init__(f"{message}{detail}")
        self.result = result
        self.result_string = result_string


def refused_outcome(error: KVPoolError) -> PutOutcome:
    """What became of each chunk of a put request the node refused whole with ``error``: ``NO_ROOM`` when
    it can never hold the request (a ``CapacityError``: larger than the node), else ``FAILED``."""
    return PutOutcome.NO_ROOM if isinstance(error, CapacityError) else PutOutcome.FAILED
