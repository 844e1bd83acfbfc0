"""Zero-copy frame I/O over a non-blocking TCP socket, shared by clients and nodes (one job: frames over a socket).

- ``frame_socket``: :class:`FrameSocket`, one connection on the event loop: connect, TLS
  upgrade, receive into the caller's buffers, send memoryviews, read a frame's header and
  meta; a half-sent stream is closed, never reused;
- ``workers``: the transfers of ``BULK_BYTES`` or more that run on worker threads, a turn at
  a time, so a quiet peer holds no thread;
- ``tls``: the TLS contexts of a client and of a node's listener.
"""

from backend.iov import Buffer
from backend.transport.frame_socket import FrameSocket, tune_socket
from backend.transport.tls import client_tls_context, server_tls_context
from backend.transport.workers import BULK_BYTES, THREAD_WAIT_S

# Not API: the worker turn's parts that bench/harness/profile_get.py times, importable from here as before.
from backend.transport.workers import _Receiving as _Receiving
from backend.transport.workers import _TurnClock as _TurnClock

__all__ = [
    "FrameSocket",
    "Buffer",
    "tune_socket",
    "client_tls_context",
    "server_tls_context",
    "BULK_BYTES",
    "THREAD_WAIT_S",
]
