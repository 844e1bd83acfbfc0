"""What a connection that proved a tenant's token may touch (docs/security.md, "Tenant tokens").

Such a connection (``Peer.tenant``, set by the handshake: ``backend/handshake.py``) names
only keys of its tenant, ``~t/NAME/...`` (:func:`check_keys`), whatever op it sends. It is
refused the ops that list or report every tenant's keys (INVENTORY, PINS, EVENTS, STAT)
and those that reach bytes outside the connection: the same-host arena (a mapped read,
:func:`refuse_mapped_read`), stages (PUT_STAGED) and the channel (CHANNEL_GET). Each refusal
is an AuthError on an open connection, counted in ``tenant_refusals``. A connection of the
pool token (``tenant`` None) passes every check.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from backend.counters import NodeCounter
from backend.errors import AuthError
from backend.protocol import Op
from backend.tenants import scoped

__all__ = ["KEY_QUOTED", "TENANT_REFUSED", "check_keys", "refuse_mapped_read", "refused_op"]

TENANT_REFUSED = frozenset({Op.INVENTORY, Op.PINS, Op.EVENTS, Op.STAT, Op.PUT_STAGED, Op.CHANNEL_GET})
KEY_QUOTED = 128  # characters of a refused key a refusal quotes


def refused_op(tenant: str | None, op: int, counters: Counter[NodeCounter]) -> AuthError | None:
    """The refusal (counted) of ``op`` to a connection of ``tenant``'s token, or None if it may ask it."""
    if tenant is None or op not in TENANT_REFUSED:
        return None
    counters[NodeCounter.TENANT_REFUSALS] += 1
    return AuthError(
        f"{Op(op).name} is refused to a connection that proved tenant {tenant}'s token "
        "(same-host and channel reads take TCP; listings and reports need the pool token)"
    )


def check_keys(tenant: str | None, keys: Iterable[str], counters: Counter[NodeCounter]) -> None:
    """AuthError (counted) unless every key of ``keys`` is ``tenant``'s; any key passes when ``tenant`` is None."""
    if tenant is None:
        return
    prefix = scoped(tenant, "")
    for key in keys:
        if not key.startswith(prefix):
            counters[NodeCounter.TENANT_REFUSALS] += 1
            raise AuthError(
                f"this connection proved tenant {tenant}'s token: it may touch only keys {prefix}KEY, "
                f"not {key[:KEY_QUOTED]!r}"
            )


def refuse_mapped_read(tenant: str | None, counters: Counter[NodeCounter]) -> None:
    """AuthError (counted) for a mapped read (LEASE with LEASE_MAP) of a connection of ``tenant``'s token."""
    if tenant is None:
        return
    counters[NodeCounter.TENANT_REFUSALS] += 1
    raise AuthError(
        f"a mapped read (LEASE_MAP) is refused to a connection that proved tenant {tenant}'s token: "
        "the arena holds every tenant's bytes; read over TCP"
    )
