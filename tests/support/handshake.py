"""The handshake for tests that speak the raw protocol over a plain socket (a hostile or minimal peer).

``hello_frame`` makes the HELLO a kvpool client sends to ``node`` (anything with ``node_id``,
``host``, ``port`` and ``namespace``: a ``NodeProcess``); ``auth_frame`` answers the node's HELLO
as a client does (``backend.handshake.ClientHello``), and ``check_auth_answer`` checks the
node's proof in the answer to that AUTH.
"""

from __future__ import annotations

from typing import Any, Protocol

from backend.handshake import ClientHello, handshake_key
from backend.protocol import Op
from backend.protocol.frame import encode_header
from backend.protocol.meta import decode_json, encode_json

__all__ = ["Dialled", "hello_frame", "auth_frame", "check_auth_answer", "frame"]


class Dialled(Protocol):
    node_id: str
    host: str
    port: int

    @property
    def namespace(self) -> str: ...


def frame(op: int, request_id: int, body: dict[str, Any]) -> bytes:
    """A whole frame whose meta is ``body`` as JSON (HELLO, AUTH, PING, STAT)."""
    meta = encode_json(body)
    return encode_header(op, request_id, meta) + meta


def hello_frame(node: Dialled, token: str, request_id: int = 1) -> tuple[ClientHello, bytes]:
    """The handshake's client side, and its HELLO frame to ``node`` as the registry names it."""
    key = handshake_key(token, node.namespace) if token else None
    handshake = ClientHello(node.node_id, f"{node.host}:{node.port}", key)
    return handshake, frame(Op.HELLO, request_id, handshake.request())


def auth_frame(handshake: ClientHello, answer_meta: bytes | bytearray, request_id: int = 2) -> bytes:
    """The AUTH frame answering the node's HELLO answer (checked: the node is the one meant)."""
    auth = handshake.answer(decode_json(answer_meta))
    assert auth is not None, "the node asks for no token"
    return frame(Op.AUTH, request_id, auth)


def check_auth_answer(handshake: ClientHello, answer_meta: bytes | bytearray) -> None:
    """The node accepted the AUTH and proved the token back (AuthError otherwise)."""
    answer = decode_json(answer_meta)
    assert answer.get("ok") is True, answer
    handshake.check(answer)
