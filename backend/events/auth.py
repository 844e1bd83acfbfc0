"""Who may subscribe to a pool's events endpoint: the CURVE keys derived from the pool token, or, in plain
mode, whoever reaches its addresses (docs/fleet-events.md).

Events carry what the pool holds (and, once engines pass them, token ids: prompt text), so the
endpoint speaks ZMQ CURVE and admits one client key. Both key pairs are derived from the pool
token and namespace: every holder of the token can compute the server's public key and the
client key pair, nobody else can complete the handshake, and there are no key files to hand out.

Derivation (so a consumer in another language can do the same): for each role in
``b"server"``, ``b"client"``, the secret key is HMAC-SHA256(key=token, msg=b"kvpool events
curve " + role + b" " + namespace) (32 bytes, Z85-encoded); the public key is its Curve25519
public key (``zmq_curve_public``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass

import zmq
from zmq.utils import z85

__all__ = ["CurveKeys", "curve_keys", "is_loopback"]


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:
        return f"CurveKeys(server_public={self.server_public!r}, client_public={self.client_public!r}, secrets=***)"


def _pair(token: str, namespace: str, role: bytes) -> tuple[bytes, bytes]:
    raw = hmac.new(token.encode(), b"kvpool events curve " + role + b" " + namespace.encode(), hashlib.sha256)
    secret = z85.encode(raw.digest())
    return zmq.curve_public(secret), secret


def curve_keys(token: str, namespace: str) -> CurveKeys:
    """The endpoint's and its subscribers' keys for ``token`` in ``namespace``; an empty token has none."""
    if not token:
        raise ValueError("the events endpoint's keys derive from the pool token, and there is none")
    server_public, server_secret = _pair(token, namespace, b"server")
    client_public, client_secret = _pair(token, namespace, b"client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def is_loopback(address: str) -> bool:
    """Whether only this machine reaches the ZMQ bind ``address``: ipc:// and inproc://, or tcp:// on a loopback
    host. A wildcard, an interface or a host name is not (it may be any address of the machine)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
