"""What the channel asks of a transport: links that move batches, each call bounded.

Two transports keep this contract: ``transport_nccl`` (libnccl, GPU to GPU) and
``transport_cpu`` (a TCP socket between the two processes, what the tests run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["Buffer", "Link", "Transport", "transfer_timeout", "MIN_TRANSFER_BYTES_PER_S"]

Buffer = bytes | bytearray | memoryview
MIN_TRANSFER_BYTES_PER_S = 50 * 1024 * 1024  # a transfer's timeout grows by 20 ms per MiB


def transfer_timeout(base_s: float, nbytes: int) -> float:
    """The bound on one transfer: the pool's timeout plus time for the bytes at a floor rate."""
    return base_s + nbytes / MIN_TRANSFER_BYTES_PER_S


class Link(Protocol):
    """One side of a pair communicator. Blocking calls, each bounded by its timeout."""

    @property
    def broken(self) -> bool:
        """True once aborted or failed: the pair must be made again."""

    def send(self, buffers: Sequence[Buffer], timeout_s: float) -> None:
        """Send host buffers to the peer, as one batch (one NCCL group)."""

    def recv_into(
        self,
        sizes: Sequence[int],
        targets: Sequence[memoryview | None],
        timeout_s: float,
        landed: Callable[[int], None],
    ) -> None:
        """Receive a batch straight into host ``targets`` (None: receive and drop), chunk after chunk.

        ``landed(i)`` is called, in order, as soon as chunk ``i`` is in its target, while
        later chunks still move (``nccl_channel.pipeline``).
        """

    def cancel(self) -> None:
        """Make an in-flight send or recv stop soon with NcclError; safe from any thread."""

    def abort(self) -> None:
        """Tear down now, without waiting for the peer; later calls raise NcclError."""

    def close(self) -> None:
        """Release the link (abort if it broke)."""


class Transport(Protocol):
    """Makes links: rank 0 prepares a unique id and joins; rank 1 joins with that id."""

    kind: str

    def prepare(self) -> tuple[bytes, Any]:
        """A fresh unique id to publish, and local state ``join`` needs for rank 0."""

    def join(self, unique_id: bytes, rank: int, state: Any, timeout_s: float) -> Link:
        """Build this side of the pair (blocking, bounded)."""

    def discard(self, state: Any) -> None:
        """Release what ``prepare`` made (rank 0), whether or not ``join`` ran."""

    def register_host(self, memory: memoryview) -> None:
        """Host memory chunks will be sent from (a node's arena): make copies from it fast, if the transport can."""
