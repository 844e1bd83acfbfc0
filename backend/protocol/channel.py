"""CHANNEL_GET: ask a node for chunks whose bytes travel over the channel (``nccl_channel``), not the socket.

The request and response are JSON metas with no data section: the bytes travel over the
channel's communicator, in the order of the keys that were found. ``nccl_channel`` imports
this codec (and ``backend.errors``) of backend, nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backend.errors import ProtocolError
from backend.protocol.frame import DEFAULT_LIMITS, Limits, Op, OpCodec
from backend.protocol.meta import ItemMeta, bounded, check_fingerprint, decode_json, encode_json

__all__ = ["MAX_PAIR_ID_BYTES", "MAX_OFFER_DIGEST_CHARS", "ChannelRequest", "ChannelGet"]

MAX_PAIR_ID_BYTES = 64
MAX_OFFER_DIGEST_CHARS = 128


@dataclass(frozen=True)
class ChannelRequest:
    """A CHANNEL_GET: the pair's id (``session`` on the wire), the keys wanted, and, when it pairs (no keys), the
    digest of the offer the client published (``nccl_channel.rendezvous.Offer.digest``); ``fingerprint``: the
    reader's layout fingerprint (None: an older client sent none)."""

    pair_id: str
    keys: list[str]
    offer: str = ""
    fingerprint: int | None = None


class ChannelGet(OpCodec):
    """CHANNEL_GET: JSON both ways, no data section; the found chunks' bytes travel over the channel."""

    op = Op.CHANNEL_GET

    @staticmethod
    def encode_request(
        pair_id: str, keys: Sequence[str], offer: str = "", limits: Limits = DEFAULT_LIMITS, fingerprint: int = 0
    ) -> bytes:
        """Meta of a CHANNEL_GET: the pair's id (``session`` on the wire), the keys wanted (none: pair, naming
        ``offer``, the digest of the offer published for it) and the reader's layout ``fingerprint``."""
        if len(keys) > limits.max_items:
            raise ProtocolError(f"{len(keys)} keys exceed the limit of {limits.max_items}")
        body: dict[str, Any] = {"session": pair_id, "keys": list(keys)}
        if keys:
            body["fingerprint"] = check_fingerprint(fingerprint, "CHANNEL_GET")
        if offer:
            body["offer"] = offer
        return bounded(bytearray(encode_json(body)), limits)

    @staticmethod
    def decode_request(meta: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> ChannelRequest:
        body = decode_json(meta)
        pair_id, keys, offer = body.get("session"), body.get("keys"), body.get("offer", "")
        fingerprint = body.get("fingerprint")
        if not isinstance(pair_id, str) or not 0 < len(pair_id) <= MAX_PAIR_ID_BYTES or not pair_id.isascii():
            raise ProtocolError(f"CHANNEL_GET session must be 1..{MAX_PAIR_ID_BYTES} ASCII characters")
        if not isinstance(keys, list) or len(keys) > limits.max_items:
            raise ProtocolError(f"CHANNEL_GET keys must be a list of at most {limits.max_items}")
        for key in keys:
            if not isinstance(key, str) or not 0 < len(key.encode("utf-8")) <= limits.max_key_bytes:
                raise ProtocolError(f"CHANNEL_GET key outside 1..{limits.max_key_bytes} bytes")
        if not isinstance(offer, str) or len(offer) > MAX_OFFER_DIGEST_CHARS or not offer.isascii():
            raise ProtocolError(f"CHANNEL_GET offer must be at most {MAX_OFFER_DIGEST_CHARS} ASCII characters")
        if fingerprint is not None:
            fingerprint = check_fingerprint(fingerprint, "CHANNEL_GET")
        return ChannelRequest(pair_id, keys, offer, fingerprint)

    @staticmethod
    def encode_answer(
        found: Sequence[ItemMeta | None], limits: Limits = DEFAULT_LIMITS, *, fingerprints: bool = True
    ) -> bytes:
        """Meta of a CHANNEL_GET response: per key null or [nbytes, checksum, dtype, shape, fmt, fingerprint]
        (without the fingerprint for a request that carried none). A chunk of another layout is answered null."""
        rows = [
            None
            if item is None
            else [item.nbytes, item.checksum, item.dtype, list(item.shape), item.fmt]
            + ([item.fingerprint] if fingerprints else [])
            for item in found
        ]
        return bounded(bytearray(encode_json({"found": rows})), limits)

    @staticmethod
    def decode_answer(
        meta: bytes | bytearray | memoryview, keys: Sequence[str], limits: Limits = DEFAULT_LIMITS
    ) -> list[ItemMeta | None]:
        rows = decode_json(meta).get("found")
        if not isinstance(rows, list) or len(rows) != len(keys):
            raise ProtocolError(f"CHANNEL_GET response does not carry one result per key ({len(keys)})")
        found: list[ItemMeta | None] = []
        for key, row in zip(keys, rows):
            if row is None:
                found.append(None)
                continue
            try:
                nbytes, item_sum, dtype, shape, fmt, *rest = row
                fingerprint = int(rest[0]) if rest else 0  # an older node sends none
                item = ItemMeta(
                    key, int(nbytes), int(item_sum), str(dtype), tuple(int(d) for d in shape), int(fmt), fingerprint
                )
            except (TypeError, ValueError, IndexError):
                raise ProtocolError(f"CHANNEL_GET response row for {key[:80]!r} is malformed") from None
            if not 0 <= item.nbytes <= limits.max_data_bytes or len(item.shape) > limits.max_ndim:
                raise ProtocolError(f"CHANNEL_GET response row for {key[:80]!r} is out of range")
            found.append(item)
        return found
