"""A batch moved as a pipeline: chunk after chunk through a small ring of staging slots, verified as it lands.

No CUDA here, so the ordering is tested on a CPU (fake events, the CPU transport).

:func:`run_ring` drives one side of a batch. ``issue(i)`` starts chunk ``i`` (on a
GPU: its host-to-device copy and NCCL send, or its NCCL receive and device-to-host
copy, all queued on streams) and returns an event; ``land(i)`` finishes it on the
host once its event completed (a bounce buffer copied into its target). Chunk ``i``
goes into slot ``i % depth``, so before issuing it the chunk that last used the slot,
``i - depth``, must have landed: at most ``depth`` chunks are in flight, and while
chunk ``i`` crosses the link, chunk ``i + 1`` is being staged and chunk ``i - 1``
copied out.

:class:`Verifier` checks each landed chunk's checksum on a few threads (xxh3
releases the GIL), so chunk ``i`` is verified while later chunks still move.
:func:`receive_batch` is the client's whole receive: the link lands chunks into
their targets, each landing hands the chunk to the verifier, and the call returns
every verdict (and when each chunk arrived and was verified) once all are checked.
A failure anywhere raises after the verifications already started have finished, so
the caller can release the targets and read the keys over TCP.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from backend.protocol import checksum

__all__ = ["Event", "run_ring", "Verifier", "BatchReport", "receive_batch", "RING_DEPTH", "VERIFY_THREADS"]

RING_DEPTH = 3  # staging slots per side: one staged, one crossing the link, one copied out
VERIFY_THREADS = 4


class Event(Protocol):
    """Something that completes: a CUDA event, or a stand-in on a CPU."""

    def query(self) -> bool: ...


class Landed(Protocol):
    """What a link calls as each chunk of a pipelined receive lands in its target."""

    def __call__(self, index: int) -> None: ...


class ReceivingLink(Protocol):
    """The one call :func:`receive_batch` needs of a link (``nccl_channel.link.Link.recv_into``)."""

    def recv_into(
        self, sizes: Sequence[int], targets: Sequence[memoryview | None], timeout_s: float, landed: Landed
    ) -> None: ...


def run_ring(
    count: int,
    depth: int,
    issue: Callable[[int], Event],
    land: Callable[[int], None],
    wait: Callable[[Event, int], None],
) -> None:
    """Issue ``count`` chunks through ``depth`` slots; each lands (in order) before its slot is issued again.

    ``wait(event, i)`` blocks until chunk ``i``'s event completes (bounded by the caller's
    deadline; it raises past it). Every chunk issued has landed when this returns.
    """
    if depth < 1:
        raise ValueError(f"a ring needs at least one slot, got {depth}")
    events: dict[int, Event] = {}
    for index in range(count):
        if index >= depth:
            _land(index - depth, events, land, wait)
        events[index] = issue(index)
    for index in range(max(count - depth, 0), count):
        _land(index, events, land, wait)


def _land(
    index: int, events: dict[int, Event], land: Callable[[int], None], wait: Callable[[Event, int], None]
) -> None:
    wait(events.pop(index), index)
    land(index)


def _verify_chunk(view: memoryview, expected: int) -> bool:
    """Whether the bytes that landed are the ones the node recorded at put time."""
    return checksum(view) == expected


@dataclasses.dataclass(frozen=True)
class BatchReport:
    """A pipelined receive: one verdict per chunk, and when each landed and was verified (monotonic s)."""

    verdicts: list[bool]
    arrived_s: list[float]
    verified_s: list[float]


class Verifier:
    """Checksums chunks on ``threads`` worker threads as they land; one per channel, shared by its pairs."""

    def __init__(self, threads: int = VERIFY_THREADS) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvpool-verify")

    def submit(self, view: memoryview, expected: int) -> concurrent.futures.Future[tuple[bool, float]]:
        return self._pool.submit(_timed_verify, view, expected)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _timed_verify(view: memoryview, expected: int) -> tuple[bool, float]:
    return _verify_chunk(view, expected), time.monotonic()


def receive_batch(
    link: ReceivingLink,
    sizes: Sequence[int],
    targets: Sequence[memoryview | None],
    expected: Sequence[int],
    timeout_s: float,
    verifier: Verifier,
) -> BatchReport:
    """Receive a batch into ``targets`` (None: receive and drop), verifying each chunk as it lands.

    A chunk with no target is reported good (nobody reads it). Raises what the link or a
    verification raised, once no verification is running any more.
    """
    if not len(sizes) == len(targets) == len(expected):
        raise ValueError(f"{len(sizes)} sizes, {len(targets)} targets and {len(expected)} checksums differ")
    arrived = [0.0] * len(sizes)
    checks: dict[int, concurrent.futures.Future[tuple[bool, float]]] = {}

    def landed(index: int) -> None:
        arrived[index] = time.monotonic()
        target = targets[index]
        if target is not None:
            checks[index] = verifier.submit(target, expected[index])

    try:
        link.recv_into(sizes, targets, timeout_s, landed)
    finally:
        concurrent.futures.wait(list(checks.values()))  # none may read a target once the caller releases it
    verdicts, verified = [True] * len(sizes), list(arrived)
    for index, check in checks.items():
        verdicts[index], verified[index] = check.result()  # a verification that raised raises here
    return BatchReport(verdicts, arrived, verified)
