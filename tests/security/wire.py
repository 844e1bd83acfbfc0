"""The raw protocol the hostile-peer tests speak, in one place: the handshake's frames and a frame reader.

A test that talks to a node over a bare socket builds its HELLO here, so that a change
of the handshake is made once, for every such test.
"""

from __future__ import annotations

import socket

from backend.protocol import HEADER, Header, Op, decode_header, encode_header, encode_json

__all__ = ["hello_frame", "read_frame"]


def hello_frame(request_id: int = 1) -> bytes:
    """A client's first frame: HELLO."""
    meta = encode_json({"client": "test"})
    return encode_header(Op.HELLO, request_id, meta) + meta


def read_frame(sock: socket.socket) -> tuple[Header, bytes] | None:
    """The next frame's header and meta (its data is not read); None if the peer closed (or reset) first."""
    buf = b""
    try:
        while len(buf) < HEADER.size:
            piece = sock.recv(HEADER.size - len(buf))
            if not piece:
                return None
            buf += piece
        header = decode_header(buf)
        meta = b""
        while len(meta) < header.meta_len:
            piece = sock.recv(header.meta_len - len(meta))
            if not piece:
                return None
            meta += piece
    except ConnectionResetError:
        return None
    return header, meta
