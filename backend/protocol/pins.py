"""PIN, UNPIN and PINS, the pin ops: hold keys on a node past any connection, let go, list what is held.

All three are JSON both ways (admin ops: a few per minute, not the data path), every field
checked here before the node acts on it:

* PIN ``{"owner", "keys", "ttl_s"}`` -> ``{"held": [0|1, ...], "ttl_s"}``: ``ttl_s`` null asks
  for the node's default, 0 for no expiry; the answer's ``ttl_s`` is what the node applied
  (null: none). A 0 in ``held`` is a key the node does not hold: then nothing was pinned.
* UNPIN ``{"owner", "keys"}`` -> ``{"unpinned": [0|1, ...]}``: 1 where one of ``owner``'s pins
  of the key was let go, 0 where ``owner`` held none.
* PINS ``{"prefix", "after", "limit"}`` -> ``{"pins": [[key, owner, refs, expires_in_s, nbytes,
  tier], ...], "more"}``: one row per key and owner, in (key, owner) order, after ``after``
  (``[key, owner]`` or null); ``expires_in_s`` null for no expiry, ``nbytes`` and ``tier`` null
  for a pinned key the node does not hold now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from backend.errors import ProtocolError
from backend.protocol.frame import DEFAULT_LIMITS, Limits, Op, OpCodec
from backend.protocol.json_codec import JsonReport
from backend.protocol.meta import check_key, decode_json, encode_json

__all__ = ["MAX_PINS_PAGE", "OWNER_RULE", "PinRequest", "PinRow", "PinPage", "check_owner", "Pin", "Unpin", "Pins"]

MAX_PINS_PAGE = 10_000  # rows one PINS answer may carry
OWNER_RULE = "1-128 characters of A-Z a-z 0-9 _ . : @ / -"
_OWNER_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:@/-")
_MAX_OWNER_CHARS = 128


@dataclass(frozen=True)
class PinRequest:
    """A PIN: ``owner``'s pin of ``keys`` for ``ttl_s`` seconds (None: the node's default; 0: no expiry)."""

    owner: str
    keys: tuple[str, ...]
    ttl_s: float | None


@dataclass(frozen=True)
class PinRow(JsonReport):
    """One key a node pins for one owner: how many of the owner's pins hold it, when the last of them ends
    (None: never), and the chunk's size and tier (None: the node does not hold the key now)."""

    what: ClassVar[str] = "a pin"

    key: str
    owner: str
    refs: int
    expires_in_s: float | None
    nbytes: int | None
    tier: str | None


@dataclass(frozen=True)
class PinPage:
    """One PINS answer: rows in (key, owner) order, and whether rows after the last one remain."""

    rows: tuple[PinRow, ...]
    more: bool


def check_owner(owner: object) -> str:
    """``owner`` if it is a pin owner's name (``OWNER_RULE``); ProtocolError naming it otherwise."""
    if not isinstance(owner, str) or not 0 < len(owner) <= _MAX_OWNER_CHARS or not _OWNER_CHARS.issuperset(owner):
        raise ProtocolError(f"pin owner {str(owner)[:80]!r} must be {OWNER_RULE}")
    return owner


def _ttl(value: object, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ProtocolError(f"{what} ttl_s {str(value)[:40]} is not a number of seconds >= 0 (or null)")
    return float(value)


def _keys(value: object, what: str, limits: Limits) -> tuple[str, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= limits.max_items:
        raise ProtocolError(f"{what} wants 1..{limits.max_items} keys")
    for key in value:
        check_key(key, limits)
    return tuple(value)


def _flags(body: dict[str, Any], name: str, expected: int, what: str) -> list[bool]:
    flags = body.get(name)
    if not isinstance(flags, list) or len(flags) != expected or any(f not in (0, 1) for f in flags):
        raise ProtocolError(f"{what} answer wants {name}: {expected} flags of 0 or 1")
    return [bool(f) for f in flags]


class Pin(OpCodec):
    """PIN: an owner's pin of keys for a while; answered with which keys are held and the ttl applied."""

    op = Op.PIN

    @staticmethod
    def encode_request(request: PinRequest, limits: Limits = DEFAULT_LIMITS) -> bytes:
        _keys(list(request.keys), "PIN", limits)
        return encode_json(
            {"owner": check_owner(request.owner), "keys": list(request.keys), "ttl_s": _ttl(request.ttl_s, "PIN")}
        )

    @staticmethod
    def decode_request(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> PinRequest:
        body = decode_json(meta)
        return PinRequest(
            check_owner(body.get("owner")), _keys(body.get("keys"), "PIN", limits), _ttl(body.get("ttl_s"), "PIN")
        )

    @staticmethod
    def encode_answer(held: Sequence[bool], ttl_s: float | None) -> bytes:
        return encode_json({"held": [int(h) for h in held], "ttl_s": ttl_s})

    @staticmethod
    def decode_answer(meta: bytes | bytearray | memoryview, keys: int) -> tuple[list[bool], float | None]:
        """``(held per key, the ttl the node applied or None for none)`` of a PIN answer."""
        body = decode_json(meta)
        return _flags(body, "held", keys, "PIN"), _ttl(body.get("ttl_s"), "PIN answer")


class Unpin(OpCodec):
    """UNPIN: let go of one of an owner's pins of each key; answered with which were let go."""

    op = Op.UNPIN

    @staticmethod
    def encode_request(owner: str, keys: Sequence[str], limits: Limits = DEFAULT_LIMITS) -> bytes:
        return encode_json({"owner": check_owner(owner), "keys": list(_keys(list(keys), "UNPIN", limits))})

    @staticmethod
    def decode_request(
        meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
    ) -> tuple[str, tuple[str, ...]]:
        body = decode_json(meta)
        return check_owner(body.get("owner")), _keys(body.get("keys"), "UNPIN", limits)

    @staticmethod
    def encode_answer(unpinned: Sequence[bool]) -> bytes:
        return encode_json({"unpinned": [int(u) for u in unpinned]})

    @staticmethod
    def decode_answer(meta: bytes | bytearray | memoryview, keys: int) -> list[bool]:
        return _flags(decode_json(meta), "unpinned", keys, "UNPIN")


class Pins(OpCodec):
    """PINS: a page of the keys a node pins, per owner."""

    op = Op.PINS

    @staticmethod
    def encode_request(prefix: str = "", after: tuple[str, str] | None = None, limit: int = 1000) -> bytes:
        """Meta of a PINS request: up to ``limit`` rows of keys starting with ``prefix``, after ``(key, owner)``."""
        if not 0 < limit <= MAX_PINS_PAGE:
            raise ProtocolError(f"PINS limit {limit} is outside 1..{MAX_PINS_PAGE}")
        return encode_json({"prefix": prefix, "after": list(after) if after is not None else None, "limit": limit})

    @staticmethod
    def decode_request(meta: bytes | bytearray | memoryview) -> tuple[str, tuple[str, str] | None, int]:
        """``(prefix, after or None, limit)`` of a PINS request."""
        body = decode_json(meta)
        prefix, after, limit = body.get("prefix", ""), body.get("after"), body.get("limit", 1000)
        if (
            not isinstance(prefix, str)
            or not isinstance(limit, int)
            or isinstance(limit, bool)
            or not 0 < limit <= MAX_PINS_PAGE
            or not (
                after is None
                or (isinstance(after, list) and len(after) == 2 and all(isinstance(a, str) for a in after))
            )
        ):
            raise ProtocolError(f"PINS wants {{prefix: str, after: [key, owner] or null, limit: 1..{MAX_PINS_PAGE}}}")
        return prefix, (after[0], after[1]) if after is not None else None, limit

    @staticmethod
    def encode_answer(page: PinPage) -> bytes:
        rows = [[r.key, r.owner, r.refs, r.expires_in_s, r.nbytes, r.tier] for r in page.rows]
        return encode_json({"pins": rows, "more": page.more})

    @staticmethod
    def decode_answer(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> PinPage:
        """A PINS answer, checked row by row."""
        body = decode_json(meta)
        items, more = body.get("pins"), body.get("more")
        if not isinstance(items, list) or len(items) > MAX_PINS_PAGE or not isinstance(more, bool):
            raise ProtocolError(f"PINS answer wants {{pins: list of at most {MAX_PINS_PAGE}, more: bool}}")
        rows = []
        for item in items:
            try:
                key, owner, refs, expires_in_s, nbytes, tier = item
            except (TypeError, ValueError):
                raise ProtocolError(
                    f"PINS row {str(item)[:80]} is not [key, owner, refs, expires_in_s, nbytes, tier]"
                ) from None
            check_key(key, limits)
            check_owner(owner)
            if (
                not isinstance(refs, int)
                or refs <= 0
                or not (nbytes is None or (isinstance(nbytes, int) and 0 <= nbytes <= limits.max_data_bytes))
                or not (tier is None or isinstance(tier, str))
            ):
                raise ProtocolError(f"PINS row for {str(key)[:80]!r} is malformed or out of range")
            rows.append(PinRow(key, owner, refs, _ttl(expires_in_s, "PINS row"), nbytes, tier))
        return PinPage(tuple(rows), more)
