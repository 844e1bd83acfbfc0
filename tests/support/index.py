"""The index as Redis holds it, for tests that read or write it directly (``backend.metadata``'s key schema)."""

from __future__ import annotations

import redis

from backend.metadata import Location

__all__ = ["index_key", "index_pattern", "legacy_index_key", "slots", "copies", "write_copies"]


def index_key(namespace: str, key: str) -> str:
    """Where the index keeps ``key``'s copies (``RedisConnection.index_key``)."""
    return f"kvp:{namespace}/{key}"


def index_pattern(namespace: str, match: str = "*") -> str:
    """A SCAN pattern for the namespace's index keys."""
    return f"kvp:{namespace}/{match}"


def legacy_index_key(namespace: str, key: str) -> str:
    """Where the release before this schema kept ``key``'s copies (node id -> ``epoch|tier|nbytes|checksum|time``)."""
    return f"kvp:{namespace}:k:{{{key}}}"


def slots(r: redis.Redis, namespace: str) -> dict[str, int]:
    """Node id -> slot (the index field its copies go under)."""
    return {_text(node): int(slot) for node, slot in r.hgetall(f"kvp:{{{namespace}}}:slots").items()}


def copies(r: redis.Redis, namespace: str, key: str) -> dict[str, Location]:
    """``key``'s copies by node id (``#<slot>`` for a slot no node id holds)."""
    by_slot = {slot: node for node, slot in slots(r, namespace).items()}
    out = {}
    for field, value in r.hgetall(index_key(namespace, key)).items():
        slot = int(field)
        node = by_slot.get(slot, f"#{slot}")
        out[node] = Location.decode(node, value if isinstance(value, bytes) else value.encode(), slot)
    return out


def write_copies(r: redis.Redis, namespace: str, key: str, fields: dict[str, bytes]) -> None:
    """Replace ``key``'s index entry with ``fields`` (node id -> raw value), as someone writing Redis directly would."""
    by_node = slots(r, namespace)
    r.delete(index_key(namespace, key))
    r.hset(index_key(namespace, key), mapping={str(by_node[node]): value for node, value in fields.items()})


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
