"""The pin verbs: ``pin`` (keys, or the keys a prefix names in the index now), ``unpin`` and ``pins``.

A pin is kept by the nodes that hold the key (``backend/node/store/pins.py``), never in Redis: ``pin``
finds the holders in the index and pins every copy; ``unpin`` and ``pins`` ask every live
node, since a pin outlives its chunk (deleted, or lost from DRAM at a restart) and its index
entry with it. A pinned chunk of a tenant counts against that tenant's byte quota, and a quota
never evicts it (docs/fleet.md, "Tenants and quotas").
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from backend.admin.shared import SCAN_BATCH, key_pattern, refusal
from backend.client import PoolClient
from backend.errors import AuthError, ConfigError, KVPoolError, ProtocolError
from backend.metadata import NodeInfo
from backend.protocol.pins import PinRequest, PinRow, check_owner

__all__ = ["DEFAULT_PIN_OWNER", "NodePin", "PinReport", "UnpinReport", "pin", "unpin", "list_pins"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PIN_OWNER = "default"
PIN_BATCH = 1000  # keys per PIN or UNPIN request


@dataclass(frozen=True)
class PinReport:
    """What ``pin`` did: keys pinned, copies pinned (a key with replicas is pinned on each node), where,
    and the ttl the nodes applied (None: no expiry)."""

    owner: str
    keys: int
    copies: int
    nodes: tuple[str, ...]
    ttl_s: float | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class UnpinReport:
    """What ``unpin`` did: keys let go (one of ``owner``'s pins each, on every node pinning it), and keys
    ``owner`` pinned nowhere."""

    owner: str
    unpinned: int
    not_pinned: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class NodePin:
    """One row of ``pins``: a key one node pins for one owner."""

    node_id: str
    pin: PinRow

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, **self.pin.to_json()}


def _check(keys: Sequence[str], prefix: str | None, owner: str, ttl_s: float | None = None) -> None:
    if prefix == "" and not keys:
        raise ConfigError("--prefix", "is empty, which would name every key: give a prefix, or name the keys")
    if bool(keys) == bool(prefix):
        raise ConfigError("KEY", "name keys, or --prefix P, not both and not neither")
    try:
        check_owner(owner)
    except ProtocolError as exc:
        raise ConfigError("--owner", str(exc)) from None
    if ttl_s is not None and (not math.isfinite(ttl_s) or ttl_s < 0):
        raise ConfigError("--ttl", f"{ttl_s:g} is not a number of seconds >= 0 (0: no expiry, where nodes allow it)")


async def _live(client: PoolClient) -> dict[str, NodeInfo]:
    return {n.node_id: n for n in await client.nodes(refresh=True)}  # (the registry's view holds live nodes only)


async def _ask(node: NodeInfo, answer: Awaitable[T], verb: str | None = None) -> T:
    """``node``'s answer. Its refusal of this client's token names the node (``refusal``); with ``verb``, so does
    any other error (the same kind, "node N (ADDRESS) refused the VERB: ...")."""
    try:
        return await answer
    except AuthError as exc:
        raise refusal(node, exc) from None
    except KVPoolError as exc:
        if verb is None:
            raise
        text = str(exc).removeprefix("node: ")
        raise type(exc)(f"node {node.node_id} ({node.address}) refused the {verb}: {text}") from None


async def pin(
    client: PoolClient,
    keys: Sequence[str] = (),
    *,
    prefix: str | None = None,
    owner: str = DEFAULT_PIN_OWNER,
    ttl_s: float | None = None,
) -> PinReport:
    """Pin ``keys`` (or every key the index holds now that starts with ``prefix``) on every node holding a copy.

    ConfigError, before anything is pinned, for a key the index does not know or a prefix that names none;
    also ConfigError for a ttl a node refuses (over its cap), after the pins this call took on other nodes
    are let go again: nothing pinned.
    """
    _check(keys, prefix, owner, ttl_s)
    wanted = list(dict.fromkeys(keys))
    if prefix:
        async for batch in client.index.scan_key_batches(key_pattern(None, prefix), SCAN_BATCH):
            wanted.extend(batch)
        if not wanted:
            raise ConfigError("--prefix", f"no key in the pool index starts with {prefix!r}: nothing was pinned")
    live = await _live(client)
    holders: dict[str, list[str]] = defaultdict(list)
    for key, entry in zip(wanted, await client.index.lookup(wanted)):
        nodes = [loc.node_id for loc in entry if loc.node_id in live]
        if not nodes:
            raise ConfigError(
                "KEY", f"{key!r} is not held by any live node (the pool index has no entry for it): nothing was pinned"
            )
        for node_id in nodes:
            holders[node_id].append(key)
    ttl: float | None = None
    copies = 0
    taken: list[tuple[NodeInfo, list[str]]] = []  # the batches pinned so far, let go again if a node refuses the ttl
    for node_id, node_keys in holders.items():
        node = live[node_id]
        for start in range(0, len(node_keys), PIN_BATCH):
            batch = node_keys[start : start + PIN_BATCH]
            try:
                held, ttl = await _ask(node, client.node_admin.pin(node, PinRequest(owner, tuple(batch), ttl_s)), "pin")
            except ProtocolError as exc:
                if ttl_s is None:  # the node's own default ttl is within its cap: not a refusal of ours
                    raise
                # The request passed this side's checks (owner, keys, ttl >= 0): the node refused the ttl.
                await _let_go(client, owner, taken)
                raise ConfigError("--ttl", str(exc)) from None
            gone = [key for key, h in zip(batch, held) if not h]
            if gone:
                raise KVPoolError(
                    f"node {node_id} no longer holds {gone[0]!r}"
                    + (f" (and {len(gone) - 1} more)" if len(gone) > 1 else "")
                    + f": that batch of {len(batch)} keys was not pinned there ({copies} copies were, elsewhere "
                    "or before; `kvpool pins` lists them)"
                )
            copies += len(batch)
            taken.append((node, batch))
    return PinReport(owner, len(wanted), copies, tuple(sorted(holders)), ttl)


async def _let_go(client: PoolClient, owner: str, taken: Sequence[tuple[NodeInfo, list[str]]]) -> None:
    """Unpin what this call pinned before a node refused it (``owner``'s newest pin of each key: this call's)."""
    for node, batch in taken:
        try:
            await _ask(node, client.node_admin.unpin(node, owner, batch))
        except KVPoolError as exc:
            logger.warning(
                "%d keys stay pinned on node %s for owner %s (`kvpool unpin` lets go of them): %s",
                len(batch),
                node.node_id,
                owner,
                exc,
            )


async def unpin(
    client: PoolClient, keys: Sequence[str] = (), *, prefix: str | None = None, owner: str = DEFAULT_PIN_OWNER
) -> UnpinReport:
    """Let go of one of ``owner``'s pins of each key (or of each key it pins that starts with ``prefix``) on
    every live node pinning it."""
    _check(keys, prefix, owner)
    named = list(dict.fromkeys(keys))  # every live node is asked of them: a pin outlives its chunk and entry
    asked: set[str] = set()
    done: set[str] = set()
    for node in (await _live(client)).values():
        if prefix:
            rows = await _pins_of(client, node, prefix)
            node_keys = sorted({row.key for row in rows if row.owner == owner})
            asked.update(node_keys)
        else:
            node_keys = named
        for start in range(0, len(node_keys), PIN_BATCH):
            batch = node_keys[start : start + PIN_BATCH]
            flags = await _ask(node, client.node_admin.unpin(node, owner, batch))
            done.update(key for key, flag in zip(batch, flags) if flag)
    return UnpinReport(owner, len(done), tuple(key for key in named or sorted(asked) if key not in done))


async def _pins_of(client: PoolClient, node: NodeInfo, prefix: str) -> list[PinRow]:
    return await _ask(node, client.node_admin.pins(node, prefix))


async def list_pins(client: PoolClient, prefix: str = "", owner: str | None = None) -> list[NodePin]:
    """Every pin of every live node (of keys starting with ``prefix``, of ``owner``), by node then key."""
    out: list[NodePin] = []
    for node_id, node in sorted((await _live(client)).items()):
        out.extend(NodePin(node_id, row) for row in await _pins_of(client, node, prefix) if owner in (None, row.owner))
    return out
