"""The mutual handshake of a client and a node: each proves the pool token to the other (docs/protocol-connections.md).

::

    client                                                  node
      HELLO {proto, nonce: Nc, node_id, address}        ->
                                                        <- {proto, node_id, epoch, auth_required, nonce: Nn}
      checks: the node id is the one the index names
      AUTH {key_id, proof: MAC(CLIENT_PROVES)}          ->
                                                           checks the proof over its own id and address
                                                        <- {ok: true, proof: MAC(NODE_PROVES)}
      checks the node's proof over what *it* dialled,
      before it sends anything else

Both proofs are HMAC-SHA256 over one :class:`Transcript` (a direction label, the handshake
version, the key id, the node id and address, both nonces), keyed by the *handshake key*:
the token stretched with PBKDF2 (:func:`handshake_key`), so that whoever gets a proof to
guess against pays for every guess. Each side computes the proof it checks from what *it*
knows: the client from the node it dialled (id and address from the registry), the node
from its own id and advertised address. So a listener that relays a real node's handshake
gains nothing: the client's proof names the relay's address, the node checks its own, and
the node refuses it; a listener without the token cannot make the node's proof, and the
client refuses it. The direction label keeps one side's proof from being played back as
the other's; fresh nonces on both sides keep a proof to its connection.

The client proves first, so a peer that only connects to a node learns nothing it could
guess the token against (the node names no key and proves nothing before the client
has); only a listener a client dials gets the client's proof, bound to that listener's
own address, and the stretching makes it costly to guess from.

A pure codec and checker: no I/O. The session (``backend.node.serve.session``) and the
client's connection (``backend.client.connection``) send what it encodes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import secrets
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from backend.errors import AuthError, NodeUnavailable, ProtocolError

__all__ = [
    "HANDSHAKE_VERSION",
    "NONCE_BYTES",
    "STRETCH_ITERATIONS",
    "CLIENT_PROVES",
    "NODE_PROVES",
    "Transcript",
    "handshake_key",
    "key_id",
    "prove",
    "ClientHello",
    "NodeHello",
    "KeyRing",
    "WrongNode",
]

# 1: the node's nonce only, the client proved and the node did not. 2: mutual proofs. 3: the same
# handshake, bumped with the index schema (slots and binary values, kvp:NS/KEY): a client of 2 reads
# another index, and every lookup of what it stored would miss without a word; refused instead.
HANDSHAKE_VERSION = 3
NONCE_BYTES = 32
# PBKDF2-HMAC-SHA256 rounds from the token to the handshake key: ~50 ms once per process and
# token, and as much for every guess of whoever tries tokens against a proof they obtained.
STRETCH_ITERATIONS = 100_000
STRETCH_SALT = b"kvpool handshake key|"  # + the namespace: no table of guesses serves two pools
KEY_ID_HEX = 16  # 64 bits of HMAC(key, KEY_ID_LABEL): names a token without revealing it
KEY_ID_LABEL = b"kvpool key id"
NODE_PROVES = b"kvpool node->client"
CLIENT_PROVES = b"kvpool client->node"
MEANT_CHARS = 128  # of the node id and address a client says it meant, quoted in a refusal
_FIELD = struct.Struct("<H")  # every transcript field is length-prefixed: no two transcripts encode alike


@functools.lru_cache(maxsize=16)
def handshake_key(token: str, namespace: str) -> bytes:
    """The key a pool's handshakes are proven with: ``token`` stretched (PBKDF2-HMAC-SHA256, salted
    with the namespace). Slow on purpose (about 50 ms); computed once per process, token and namespace."""
    salt = STRETCH_SALT + namespace.encode("utf-8")
    return hashlib.pbkdf2_hmac("sha256", token.encode("utf-8"), salt, STRETCH_ITERATIONS)


def key_id(key: bytes) -> str:
    """The name of a handshake key: which token a client proves (rotation, tenants), not the token."""
    return hmac.new(key, KEY_ID_LABEL, hashlib.sha256).hexdigest()[:KEY_ID_HEX]


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


def prove(key: bytes, label: bytes, transcript: Transcript) -> str:
    """The proof (lowercase hex HMAC-SHA256) that the side speaking ``label`` holds ``key``."""
    return hmac.new(key, transcript.message(label), hashlib.sha256).hexdigest()


def _proof_matches(key: bytes, label: bytes, transcript: Transcript, given: object) -> bool:
    if not isinstance(given, str):
        return False
    # As bytes: compare_digest refuses str with non-ASCII characters (a TypeError, not a refusal).
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), prove(key, label, transcript).encode("ascii"))


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
    """The handshake keys a node accepts, by key id: the pool's (one; two during a rotation), each of
    tenant None, and the tenants' tokens (one each; two during a rotation), each bound to its tenant
    (docs/security.md, "Tenant tokens")."""

    def __init__(self, keys: list[bytes], tenants: Mapping[str, Sequence[bytes]] | None = None) -> None:
        """``tenants``: each tenant's keys (one; two during a rotation of its token), all bound to it."""
        self._keys: dict[str, tuple[bytes, str | None]] = {key_id(key): (key, None) for key in keys if key}
        for tenant, tenant_keys in (tenants or {}).items():
            for key in tenant_keys:
                self._keys[key_id(key)] = (key, tenant)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def get(self, kid: str) -> bytes | None:
        found = self._keys.get(kid)
        return found[0] if found is not None else None

    def tenant(self, kid: str) -> str | None:
        """The tenant the key ``kid`` is bound to; None for a pool key (all tenants) or an unknown one."""
        found = self._keys.get(kid)
        return found[1] if found is not None else None


class WrongNode(NodeUnavailable):
    """The node that answered is not the node the client dialled (a stale or forged registry entry)."""


class ClientHello:
    """The client's side of one handshake with the node it meant (``node_id`` at ``address``).

    ``key``: the pool's handshake key (:func:`handshake_key`), None for a pool without a token.
    """

    def __init__(self, node_id: str, address: str, key: bytes | None) -> None:
        self.node_id = node_id
        self.address = address
        self.key = key
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._transcript: Transcript | None = None  # set by answer(), for check()

    @property
    def where(self) -> str:
        return f"node {self.node_id} ({self.address})"

    def request(self) -> dict[str, Any]:
        """The HELLO request's body."""
        return {
            "client": "kvpool",
            "proto": HANDSHAKE_VERSION,
            "nonce": self.nonce.hex(),
            "node_id": self.node_id,
            "address": self.address,
        }

    def answer(self, reply: Mapping[str, Any]) -> dict[str, Any] | None:
        """Check the node's HELLO answer; the AUTH body to send (None: the pool has no token).

        Raises ProtocolError for another handshake version, :class:`WrongNode` for a node
        that is not the one meant, AuthError for a node that asks for no token from a
        client that has one (or for one from a client that has none).
        """
        version = _version(reply)
        if version != HANDSHAKE_VERSION:
            raise ProtocolError(
                f"{self.where} speaks handshake version {version}, this client {HANDSHAKE_VERSION}: "
                "run the same kvpool release on nodes and clients (which builds talk to each other: docs/upgrade.md)"
            )
        answered = reply.get("node_id")
        if answered != self.node_id:
            raise WrongNode(
                f"dialled {self.where}, but node {answered!r} answered: the registry entry is stale or forged, "
                "or something relays the connection; refusing it"
            )
        if not reply.get("auth_required"):
            if self.key is not None:
                raise AuthError(
                    f"{self.where} does not ask for the pool token, but this client has one: refusing a node that "
                    "cannot prove it holds the token (every node of a pool with a token runs with --token-file)"
                )
            return None
        if self.key is None:
            raise AuthError(
                f"node {self.node_id} requires a token; give it as token_file=PATH in the pool URL (or KVPOOL_TOKEN)"
            )
        kid = key_id(self.key)
        self._transcript = Transcript(
            HANDSHAKE_VERSION, kid, self.node_id, self.address, self.nonce, _nonce(reply, self.where)
        )
        return {"key_id": kid, "proof": prove(self.key, CLIENT_PROVES, self._transcript)}

    def check(self, reply: Mapping[str, Any]) -> None:
        """The node's AUTH answer must carry its proof over what this client dialled; AuthError if not."""
        if self.key is None or self._transcript is None:
            raise AuthError(f"{self.where}: no AUTH was sent to check an answer of")
        if not _proof_matches(self.key, NODE_PROVES, self._transcript, reply.get("proof")):
            raise AuthError(
                f"{self.where} could not prove it holds the pool token: refusing it (a listener posing as the node, "
                "or a relay; see docs/security.md)"
            )


class NodeHello:
    """The node's side of one connection's handshake."""

    def __init__(self, keys: KeyRing, node_id: str, address: str) -> None:
        self.keys = keys
        self.node_id = node_id
        self.address = address
        self._nonces: tuple[bytes, bytes] | None = None  # (client's, node's), set by a HELLO
        self._meant = ""  # whom the client said it meant, for a refusal's message
        self.tenant: str | None = None  # once AUTH proved a tenant's token: the only tenant it may touch

    def answer(self, request: Mapping[str, Any], epoch: int) -> dict[str, Any]:
        """The HELLO answer: this node, whether it asks for a token, and a fresh nonce. It proves nothing
        yet: the client proves first (see the module's docstring).

        Raises ProtocolError for a client of another handshake version or without a nonce.
        """
        version = _version(request)
        if version != HANDSHAKE_VERSION:
            raise ProtocolError(
                f"this node speaks handshake version {HANDSHAKE_VERSION}, the client {version}: "
                "run the same kvpool release on clients and nodes (docs/upgrade.md)"
            )
        client_nonce = _nonce(request, "the client")
        node_nonce = secrets.token_bytes(NONCE_BYTES)
        self._nonces = (client_nonce, node_nonce)
        # Only for the refusal's message: what the client said it meant proves nothing.
        node_id, address = str(request.get("node_id"))[:MEANT_CHARS], str(request.get("address"))[:MEANT_CHARS]
        self._meant = f"node {node_id!r} at {address!r}"
        return {
            "proto": HANDSHAKE_VERSION,
            "node_id": self.node_id,
            "epoch": epoch,
            "auth_required": bool(self.keys),
            "nonce": node_nonce.hex(),
        }

    def check(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """AUTH: the client's proof over this node's own id and address and both nonces; the answer, with
        this node's proof. AuthError if the proof is wrong or missing, or proves a key this node lacks."""
        if self._nonces is None:
            raise AuthError("wrong or missing token proof: AUTH before HELLO")
        kid = request.get("key_id")
        if not isinstance(kid, str) or not kid:
            raise AuthError("wrong or missing token proof: the AUTH names no key id")
        key = self.keys.get(kid)
        if key is None:
            raise AuthError(
                "the client proves a token this node does not hold: the client and the node were given different "
                "tokens (or namespaces)"
            )
        transcript = Transcript(HANDSHAKE_VERSION, str(kid), self.node_id, self.address, *self._nonces)
        if not _proof_matches(key, CLIENT_PROVES, transcript, request.get("proof")):
            raise AuthError(
                f"wrong or missing token proof (the client said it meant {self._meant}; this is node "
                f"{self.node_id!r} at {self.address!r})"
            )
        answer: dict[str, Any] = {"ok": True, "proof": prove(key, NODE_PROVES, transcript)}
        self.tenant = self.keys.tenant(kid)
        if self.tenant is not None:
            # Outside the proof: it can only make the client use less (TCP, no channel), never more.
            answer["tenant"] = self.tenant
        return answer
