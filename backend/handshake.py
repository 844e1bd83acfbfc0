"""The mutual handshake of a client and a node: each proves the pool token to the other (docs/protocol.md).

::

    client                                               node
      HELLO {proto, nonce: Nc, node_id, address, key_id} ->
                                                          <- {proto, node_id, epoch, auth_required,
                                                              nonce: Nn, key_id, proof: MAC(NODE_PROVES)}
      checks: the node id is the one the index names,
      the node's proof over what *this side* meant
      AUTH {proof: MAC(CLIENT_PROVES)}                   ->
                                                          <- {ok: true}    checks the proof over its own id,
                                                                           its own address, both nonces

Both proofs are HMAC-SHA256 keyed by the token over one :class:`Transcript`: a
direction label, the handshake version, the key id (which token is proven), the node id
and address the client meant, and both nonces. Each side computes the proof it checks
from what *it* knows: the client from the node it dialled (id and address from the
registry), the node from its own id and advertised address. So a listener that relays a
real node's handshake gains nothing: the client meant the relay's address (or id), the
node proves and checks its own, the proofs disagree and both sides refuse. The direction
label keeps one side's proof from being played back as the other's; fresh nonces on
both sides keep a proof from being replayed on another connection.

A pure codec and checker: no I/O. The session (``backend.node.session``) and the
client's connection (``backend.client.connection``) send what it encodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import struct
from collections.abc import Mapping
from typing import Any

from backend.errors import AuthError, NodeUnavailable, ProtocolError

__all__ = [
    "HANDSHAKE_VERSION",
    "NONCE_BYTES",
    "CLIENT_PROVES",
    "NODE_PROVES",
    "Transcript",
    "key_id",
    "prove",
    "ClientHello",
    "NodeHello",
    "KeyRing",
    "WrongNode",
]

HANDSHAKE_VERSION = 2  # 1: the node's nonce only, the client proved and the node did not
NONCE_BYTES = 32
KEY_ID_HEX = 16  # 64 bits of HMAC(token, KEY_ID_LABEL): names a token without revealing it
KEY_ID_LABEL = b"kvpool key id"
NODE_PROVES = b"kvpool node->client"
CLIENT_PROVES = b"kvpool client->node"
MEANT_CHARS = 128  # of the node id and address a client says it meant, quoted in a refusal
_FIELD = struct.Struct("<H")  # every transcript field is length-prefixed: no two transcripts encode alike


def key_id(token: str) -> str:
    """The name of ``token`` in a handshake: which token a side proves (rotation, tenants), not the token."""
    return hmac.new(token.encode("utf-8"), KEY_ID_LABEL, hashlib.sha256).hexdigest()[:KEY_ID_HEX]


@dataclasses.dataclass(frozen=True)
class Transcript:
    """What both proofs of one connection cover."""

    version: int
    key_id: str
    node_id: str  # the node the client meant (the client), this node (the node)
    address: str  # "host:port" as the registry names it: dialled by the client, advertised by the node
    client_nonce: bytes
    node_nonce: bytes

    def message(self, label: bytes) -> bytes:
        """The exact bytes a proof is the HMAC of: the label, then each field as u16 length + bytes."""
        fields = (
            label,
            str(self.version).encode("ascii"),
            self.key_id.encode("utf-8"),
            self.node_id.encode("utf-8"),
            self.address.encode("utf-8"),
            self.client_nonce,
            self.node_nonce,
        )
        return b"".join(_FIELD.pack(len(field)) + field for field in fields)


def prove(token: str, label: bytes, transcript: Transcript) -> str:
    """The proof (lowercase hex HMAC-SHA256) that the side speaking ``label`` holds ``token``."""
    return hmac.new(token.encode("utf-8"), transcript.message(label), hashlib.sha256).hexdigest()


def _proof_matches(token: str, label: bytes, transcript: Transcript, given: object) -> bool:
    if not isinstance(given, str):
        return False
    # As bytes: compare_digest refuses str with non-ASCII characters (a TypeError, not a refusal).
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), prove(token, label, transcript).encode("ascii"))


def _nonce(body: Mapping[str, Any], who: str) -> bytes:
    text = body.get("nonce")
    try:
        nonce = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"{who}'s HELLO has no nonce of {NONCE_BYTES} bytes in hex")
    return nonce


def _version(body: Mapping[str, Any]) -> int:
    version = body.get("proto", 1)
    return version if isinstance(version, int) and not isinstance(version, bool) else 0


class KeyRing:
    """The tokens a node accepts, by key id (one today; two during a rotation)."""

    def __init__(self, tokens: list[str]) -> None:
        self._tokens = {key_id(token): token for token in tokens if token}

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def get(self, kid: str) -> str | None:
        return self._tokens.get(kid)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._tokens)


class WrongNode(NodeUnavailable):
    """The node that answered is not the node the client dialled (a stale or forged registry entry)."""


class ClientHello:
    """The client's side of one handshake with the node it meant (``node_id`` at ``address``)."""

    def __init__(self, node_id: str, address: str, token: str) -> None:
        self.node_id = node_id
        self.address = address
        self.token = token
        self.nonce = secrets.token_bytes(NONCE_BYTES)

    def request(self) -> dict[str, Any]:
        """The HELLO request's body."""
        return {
            "client": "kvpool",
            "proto": HANDSHAKE_VERSION,
            "nonce": self.nonce.hex(),
            "node_id": self.node_id,
            "address": self.address,
            "key_id": key_id(self.token) if self.token else "",
        }

    def answer(self, reply: Mapping[str, Any]) -> dict[str, Any] | None:
        """Check the node's HELLO answer; the AUTH body to send (None: the node asks for no token).

        Raises ProtocolError for another handshake version, AuthError for a node that
        cannot prove the token (or asks for none from a client that has one), and
        :class:`WrongNode` for a node that is not the one meant.
        """
        where = f"node {self.node_id} ({self.address})"
        version = _version(reply)
        if version != HANDSHAKE_VERSION:
            raise ProtocolError(
                f"{where} speaks handshake version {version}, this client {HANDSHAKE_VERSION}: "
                "run the same kvpool release on nodes and clients (upgrade nodes first, docs/operations.md)"
            )
        answered = reply.get("node_id")
        if answered != self.node_id:
            raise WrongNode(
                f"dialled {where}, but node {answered!r} answered: the registry entry is stale or forged, "
                "or something relays the connection; refusing it"
            )
        if not reply.get("auth_required"):
            if self.token:
                raise AuthError(
                    f"{where} does not ask for the pool token, but this client has one: refusing a node that "
                    "cannot prove it holds the token (every node of a pool with a token runs with --token-file)"
                )
            return None
        if not self.token:
            raise AuthError(
                f"node {self.node_id} requires a token; give it as token_file=PATH in the pool URL (or KVPOOL_TOKEN)"
            )
        mine = key_id(self.token)
        if reply.get("key_id") != mine:
            raise AuthError(
                f"{where} holds a token with key id {reply.get('key_id')!r}, this client's is {mine!r}: "
                "the client and the node were given different tokens"
            )
        transcript = Transcript(
            HANDSHAKE_VERSION, mine, self.node_id, self.address, self.nonce, _nonce(reply, f"{where}")
        )
        if not _proof_matches(self.token, NODE_PROVES, transcript, reply.get("proof")):
            raise AuthError(
                f"{where} could not prove it holds the pool token: refusing it (a listener posing as the node, "
                "or a relay; see docs/security.md)"
            )
        return {"proof": prove(self.token, CLIENT_PROVES, transcript)}


class NodeHello:
    """The node's side of one connection's handshake."""

    def __init__(self, keys: KeyRing, node_id: str, address: str) -> None:
        self.keys = keys
        self.node_id = node_id
        self.address = address
        self._transcript: Transcript | None = None  # set by a HELLO, for the AUTH that follows
        self._token = ""
        self._meant = ""  # whom the client said it meant, for the refusal's message

    def answer(self, request: Mapping[str, Any], epoch: int) -> dict[str, Any]:
        """The HELLO answer: this node, a fresh nonce and, with a token, this node's proof.

        Raises ProtocolError for a client of another handshake version, AuthError for a
        client that proves a token this node does not hold. A client that names no token gets
        no proof (it has nothing to check it with) and no AUTH of it can succeed.
        """
        version = _version(request)
        if version != HANDSHAKE_VERSION:
            raise ProtocolError(
                f"this node speaks handshake version {HANDSHAKE_VERSION}, the client {version}: "
                "run the same kvpool release on clients and nodes"
            )
        client_nonce = _nonce(request, "the client")
        node_nonce = secrets.token_bytes(NONCE_BYTES)
        # Only for the refusal's message: what the client said it meant proves nothing.
        self._meant = (
            f"node {str(request.get('node_id'))[:MEANT_CHARS]!r} at {str(request.get('address'))[:MEANT_CHARS]!r}"
        )
        body: dict[str, Any] = {
            "proto": HANDSHAKE_VERSION,
            "node_id": self.node_id,
            "epoch": epoch,
            "auth_required": bool(self.keys),
            "nonce": node_nonce.hex(),
        }
        if not self.keys:
            return body
        kid = request.get("key_id")
        if not kid:
            return body  # a client without a token: it stops here, telling its user how to give one
        token = self.keys.get(kid) if isinstance(kid, str) else None
        if token is None:
            raise AuthError(
                f"the client proves a token with key id {kid!r}; this node holds {', '.join(self.keys.key_ids)}: "
                "the client and the node were given different tokens"
            )
        self._token = token
        self._transcript = Transcript(HANDSHAKE_VERSION, str(kid), self.node_id, self.address, client_nonce, node_nonce)
        body["key_id"] = kid
        body["proof"] = prove(token, NODE_PROVES, self._transcript)
        return body

    def check(self, request: Mapping[str, Any]) -> None:
        """AUTH: the client's proof over this node's own id and address and both nonces, or AuthError."""
        if self._transcript is None:
            why = "AUTH before HELLO" if not self._meant else "the client's HELLO named no token"
            raise AuthError(f"wrong or missing token proof: {why}")
        if not _proof_matches(self._token, CLIENT_PROVES, self._transcript, request.get("proof")):
            raise AuthError(
                f"wrong or missing token proof (the client said it meant {self._meant}; this is node "
                f"{self.node_id!r} at {self.address!r})"
            )
