"""Zero-copy frame I/O over a non-blocking TCP socket, shared by clients and nodes."""

from backend.iov import Buffer as Buffer
from backend.transport.frame_socket import BULK_BYTES as BULK_BYTES
from backend.transport.frame_socket import FrameSocket as FrameSocket
from backend.transport.frame_socket import _Receiving as _Receiving
from backend.transport.frame_socket import _TurnClock as _TurnClock
from backend.transport.frame_socket import client_tls_context as client_tls_context
from backend.transport.frame_socket import server_tls_context as server_tls_context
from backend.transport.frame_socket import tune_socket as tune_socket
