"""What an op may touch of the connection its request came on: the :class:`Peer`.

The op table (``ops.py``) and the put path (``puts.py``) see a connection only
through this: its client's host, whether it is closed, the request's data section,
the client's stages it may map, and the answer. They never see the session, its
frame loop or its socket, so the session (``session.py``) depends on the table and
not the other way round. A :class:`Peer` is also the owner of the leases taken on
it: they end when the connection closes.

Each request is answered in two steps. Its handler runs in stream order (the next
request is not received before it returns), so a handler whose frame carries data
(PUT_BATCH) receives it there; it hands the rest of its work to
:meth:`Peer.answer`, which runs beside the next requests' receive, up to a limit
per connection, and sends the reply (or the error) when it is done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from backend.protocol.frame import Header
from backend.shm import ArenaView
from backend.transport import Buffer

__all__ = ["Answer", "Peer", "Reply", "Request", "host_of"]

Reply = tuple[bytes, list[Buffer]]  # a reply's meta section and data buffers
Answer = Callable[[], Awaitable[Reply]]  # a request's work, started once it has a place among those in flight


@dataclasses.dataclass(frozen=True)
class Request:
    """One request frame as its handler gets it: the header, the meta section, and when it came."""

    header: Header
    meta: bytearray
    started: float  # time.perf_counter() once its header arrived: its service time counts from here

    @property
    def op(self) -> int:
        return self.header.base_op

    @property
    def data_len(self) -> int:
        """The bytes of its data section, still on the connection when its handler runs."""
        return self.header.data_len


class Peer(Protocol):
    """What an op may touch of its connection (``Session`` is the one the node serves)."""

    @property
    def host(self) -> str:
        """The client's host: room held ahead of a put's bytes is bounded per host."""
        ...

    @property
    def closed(self) -> bool:
        """Whether the connection closed (what it held has been let go already)."""
        ...

    async def recv_data(self, targets: Sequence[Buffer | int], digest: Callable[[Any], int] | None = None) -> list[int]:
        """Receive the next bytes of the request's data section (``FrameSocket.recv_many``)."""
        ...

    @property
    def tenant(self) -> str | None:
        """The tenant whose token the connection proved: it may touch only that tenant's keys. None: the pool
        token (or a node without one), every key."""
        ...

    def stage(self, name: str, token: str) -> ArenaView:
        """The client's stage ``name`` (whose header carries ``token``), mapped read-only for this connection."""
        ...

    async def answer(self, request: Request, work: Answer) -> None:
        """Answer ``request`` with ``work``'s reply, beside the next requests (waits for a place among them)."""
        ...

    def __hash__(self) -> int:  # the owner of the leases taken on it (leases.py)
        ...


def host_of(address: str) -> str:
    """``"ADDRESS:PORT"`` -> ``"ADDRESS"``: the host a connection comes from."""
    return address.rpartition(":")[0] or address
