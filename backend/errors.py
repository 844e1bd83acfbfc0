"""Every exception kvpool raises, in one tree.

::

    KVPoolError
    ├── ConfigError          bad URL / option, with the offending key named
    ├── MetadataError        Redis unreachable or inconsistent
    ├── NodeUnavailable      connect / timeout / node gone
    ├── ProtocolError        malformed or unexpected frame
    ├── AuthError            missing or wrong token
    ├── CapacityError        no node can take the write
    ├── IntegrityError       checksum mismatch
    └── NcclError            binding or communicator failure

Library code raises these. Only the LMCache connector turns them into misses, so
serving never fails because the pool did.
"""

from __future__ import annotations

__all__ = [
    "KVPoolError",
    "ConfigError",
    "MetadataError",
    "NodeUnavailable",
    "ProtocolError",
    "AuthError",
    "CapacityError",
    "IntegrityError",
    "NcclError",
]


class KVPoolError(Exception):
    """Base of every error kvpool raises."""


class ConfigError(KVPoolError, ValueError):
    """A URL, option or environment variable is malformed or unknown.

    ``key`` names the offending option (or ``"url"``) so callers can point at it.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class MetadataError(KVPoolError):
    """The metadata Redis is unreachable or holds something inconsistent."""


class NodeUnavailable(KVPoolError):
    """A pool node could not be reached, timed out, or has left the pool."""


class ProtocolError(KVPoolError):
    """A frame was malformed, over a limit, or not what the exchange expected."""


class AuthError(KVPoolError):
    """The node refused the token (missing or wrong)."""


class CapacityError(KVPoolError):
    """No node can take the write."""


class IntegrityError(KVPoolError):
    """Bytes did not match their recorded checksum."""


class NcclError(KVPoolError):
    """A libnccl call or communicator failed; carries the ncclResult code and its string."""

    def __init__(self, message: str, result: int = -1, result_string: str = "") -> None:
        detail = f" (ncclResult {result}: {result_string})" if result >= 0 else ""
        super().__init__(f"{message}{detail}")
        self.result = result
        self.result_string = result_string
