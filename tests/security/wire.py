"""What the hostile-peer tests read off a bare socket: a node's frames, without a client.

(The handshake these tests would send is not here: they send none. A test that needs one
takes it from the one place that builds it for every raw-protocol test.)
"""

from __future__ import annotations

import socket

from backend.protocol.frame import HEADER, Header, decode_header

__all__ = ["read_frame"]


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
