"""The handshake for tests that speak the raw protocol over a plain socket (a hostile or minimal peer).

``hello_frame`` makes the HELLO a kvpool client sends to ``node`` (anything with ``node_id``,
``host`` and ``port``: a ``NodeProcess`` or a ``NodeInfo``); ``auth_frame`` checks the node's
answer as a client does (``backend.handshake.ClientHello``) and makes the AUTH that follows.
"""

from __future__ import annotations

from typing import Any, Protocol

from backend.handshake import ClientHello
from backend.protocol import Op, decode_json, encode_header, encode_json

__all__ = ["Dialled", "hello_frame", "auth_frame", "frame"]


class Dialled(Protocol):
    node_id: str
    host: str
    port: int


def frame(op: int, request_id: int, body: dict[str, Any]) -> bytes:
    """A whole frame whose meta is ``body`` as JSON (HELLO, AUTH, PING, STAT)."""
    meta = encode_json(body)
    return encode_header(op, request_id, meta) + meta


def hello_frame(node: Dialled, token: str, request_id: int = 1) -> tuple[ClientHello, bytes]:
    """The handshake's client side, and its HELLO frame to ``node`` as the registry names it."""
    handshake = ClientHello(node.node_id, f"{node.host}:{node.port}", token)
    return handshake, frame(Op.HELLO, request_id, handshake.request())


def auth_frame(handshake: ClientHello, answer_meta: bytes | bytearray, request_id: int = 2) -> bytes:
    """The AUTH frame answering the node's HELLO answer (checked: the node proved the token)."""
    auth = handshake.answer(decode_json(answer_meta))
    assert auth is not None, "the node asks for no token"
    return frame(Op.AUTH, request_id, auth)
