"""Unique-id exchange through the metadata layer, so two processes that know only
each other's id can build a communicator.

The side that starts a pair (rank 0, the client) makes the transport's unique id
and publishes an :class:`Offer` under a fresh pair id, as a Redis key with a TTL
(``kvp:{NS}:rdv:<pair id>``). It then tells the peer the pair id over the node's
TCP protocol, with the offer's digest; the peer takes the offer (read and delete: it is
joined once), checks that it is meant for it and that it is the offer the client made
(the digest came over the authenticated connection: an offer rewritten in Redis by
someone holding the Redis password but not the pool token is refused, so they cannot
make the node join their own communicator and send them chunks), and joins as rank 1.
An offer nobody takes expires.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import uuid
from typing import Protocol

from backend.errors import MetadataError, NcclError

__all__ = ["Offer", "RendezvousStore", "Rendezvous", "new_pair_id"]

DEFAULT_TTL_MS = 30_000


class RendezvousStore(Protocol):
    """What the rendezvous needs of the metadata layer (``backend.metadata.Rendezvous``)."""

    async def offer_rendezvous(self, pair_id: str, value: str, ttl_ms: int) -> None: ...

    async def take_rendezvous(self, pair_id: str) -> str | None: ...


@dataclasses.dataclass(frozen=True)
class Offer:
    """What rank 0 publishes: who offers, to whom, over which transport, with which id."""

    pair_id: str
    transport: str
    unique_id: bytes
    initiator: str  # endpoint id of rank 0
    target: str  # node id that may join
    cluster: str

    def encode(self) -> str:
        body = dataclasses.asdict(self)
        body["session"] = body.pop("pair_id")  # the stored offer's field keeps its name (wire)
        body["unique_id"] = self.unique_id.hex()
        return json.dumps(body, sort_keys=True)

    def digest(self) -> str:
        """What the client tells the node of its offer, so that the node joins this offer and no other."""
        return hashlib.sha256(self.encode().encode("utf-8")).hexdigest()

    @classmethod
    def decode(cls, text: str) -> Offer:
        try:
            body = json.loads(text)
            return cls(
                pair_id=str(body["session"]),
                transport=str(body["transport"]),
                unique_id=bytes.fromhex(str(body["unique_id"])),
                initiator=str(body["initiator"]),
                target=str(body["target"]),
                cluster=str(body["cluster"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise NcclError(f"rendezvous offer is malformed: {exc}") from None


def new_pair_id() -> str:
    return uuid.uuid4().hex


class Rendezvous:
    """Publishes and takes offers through a :class:`RendezvousStore`."""

    def __init__(self, store: RendezvousStore, ttl_ms: int = DEFAULT_TTL_MS) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"rendezvous TTL must be positive, got {ttl_ms} ms")
        self.store = store
        self.ttl_ms = ttl_ms

    async def publish(self, offer: Offer) -> None:
        try:
            await self.store.offer_rendezvous(offer.pair_id, offer.encode(), self.ttl_ms)
        except MetadataError as exc:
            raise NcclError(f"cannot publish rendezvous {offer.pair_id}: {exc}") from None

    async def take(
        self, pair_id: str, *, target: str, cluster: str, transport: str, digest: str | None = None
    ) -> Offer:
        """The offer for ``pair_id``, checked to be meant for this endpoint and (unless ``digest`` is None:
        two ranks of one test that share no connection) to be the one whose :meth:`Offer.digest` is
        ``digest``; NcclError otherwise."""
        try:
            text = await self.store.take_rendezvous(pair_id)
        except MetadataError as exc:
            raise NcclError(f"cannot read rendezvous {pair_id}: {exc}") from None
        if text is None:
            raise NcclError(f"rendezvous {pair_id} is missing or expired")
        offer = Offer.decode(text)
        if digest is not None and not hmac.compare_digest(
            offer.digest().encode("ascii"), digest.encode("ascii", "replace")
        ):
            raise NcclError(
                f"rendezvous {pair_id} is not the offer the client made (rewritten in Redis?): refusing to join it"
            )
        if offer.pair_id != pair_id or offer.target != target:
            raise NcclError(f"rendezvous {pair_id} is meant for {offer.target!r}, not {target!r}")
        if offer.cluster != cluster:
            raise NcclError(f"rendezvous {pair_id} comes from cluster {offer.cluster!r}; this is {cluster!r}")
        if offer.transport != transport:
            raise NcclError(f"rendezvous {pair_id} wants transport {offer.transport!r}; this side has {transport!r}")
        return offer
