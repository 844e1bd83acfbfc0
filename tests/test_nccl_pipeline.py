"""The pipelined batch on a CPU: the ring's ordering with fake events, and the client's receive over
the real CPU link (a socket pair), where a chunk is verified while later chunks still travel.

The GPU side of the same code (staging copies, per-chunk CUDA events) runs in
tests/test_nccl_gpu.py and bench/nccl/bandwidth.py --path; the ordering it relies on is this.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from backend.errors import NcclError
from backend.protocol import checksum
from nccl_channel import pipeline
from nccl_channel.pipeline import Verifier, receive_batch, run_ring
from nccl_channel.transport_cpu import _BATCH_HEAD, CpuLink

TIMEOUT_S = 5.0


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_the_ring_keeps_at_most_depth_chunks_in_flight_and_lands_them_in_order():
    log: list[tuple[str, int]] = []
    events: dict[int, FakeEvent] = {}

    def issue(index: int) -> FakeEvent:
        in_flight = [i for i in events if ("land", i) not in log]
        assert len(in_flight) < 3, f"chunk {index} issued with {in_flight} still in flight"
        log.append(("issue", index))
        events[index] = FakeEvent()
        return events[index]

    def wait(event: FakeEvent, index: int) -> None:
        assert event is events[index]
        event.done = True  # the device finished it
        log.append(("wait", index))

    run_ring(8, 3, issue, lambda index: log.append(("land", index)), wait)
    assert [i for kind, i in log if kind == "land"] == list(range(8))
    for index in range(3, 8):  # slot index % 3 is reused only once its previous chunk landed
        assert log.index(("land", index - 3)) < log.index(("issue", index))
    assert log[:3] == [("issue", 0), ("issue", 1), ("issue", 2)]  # three chunks move before the first lands
    assert all(events[i].done for i in range(8))


def test_a_wait_that_fails_stops_the_ring_before_anything_else_is_issued():
    issued: list[int] = []

    def wait(event: FakeEvent, index: int) -> None:
        if index == 2:
            raise NcclError("receive of chunk 2 of 8 timed out after 5.0 s")
        event.done = True

    with pytest.raises(NcclError, match="chunk 2 of 8 timed out"):
        run_ring(8, 2, lambda i: issued.append(i) or FakeEvent(), lambda i: None, wait)
    assert issued == [0, 1, 2, 3]  # chunk 4 would reuse chunk 2's slot: never issued


def test_fewer_chunks_than_slots_and_no_chunks_at_all():
    landed: list[int] = []
    run_ring(2, 4, lambda i: FakeEvent(), landed.append, lambda e, i: None)
    run_ring(0, 4, lambda i: FakeEvent(), landed.append, lambda e, i: None)
    assert landed == [0, 1]
    with pytest.raises(ValueError, match="at least one slot"):
        run_ring(1, 0, lambda i: FakeEvent(), landed.append, lambda e, i: None)


# -- the client's receive over the CPU link ------------------------------------------------------
def _pair() -> tuple[socket.socket, CpuLink]:
    """A TCP connection on loopback, as the CPU transport makes: the node's socket and the client's link."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname()[:2], timeout=TIMEOUT_S)
        receiver, _ = listener.accept()
    return sender, CpuLink(receiver)


def _send_gated(
    sock: socket.socket, chunks: list[bytes], before: list[threading.Event | None], stop_after: int | None = None
) -> threading.Thread:
    """A node that sends chunk ``i`` only once ``before[i]`` is set (or stops after ``stop_after`` chunks)."""

    def send_chunks() -> None:
        sock.sendall(_BATCH_HEAD.pack(len(chunks), sum(len(c) for c in chunks)))
        for index, chunk in enumerate(chunks):
            if stop_after is not None and index == stop_after:
                return
            gate = before[index]
            if gate is not None and not gate.wait(TIMEOUT_S):
                return  # the receiver never verified the chunk before: it times out
            sock.sendall(chunk)

    def run() -> None:
        try:
            send_chunks()
        except OSError:
            pass  # the receiver gave up first: what the test checks
        finally:
            sock.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_chunk_i_is_verified_while_later_chunks_are_still_on_the_link(monkeypatch):
    """The node sends chunk i+1 only after chunk i was verified: a receive that verified at the end would
    never get chunk i+1 and time out."""
    chunks = [os.urandom(256 * 1024) for _ in range(5)]
    verified = [threading.Event() for _ in chunks]
    real_verify = pipeline._verify_chunk

    def verify(view: memoryview, expected: int) -> bool:
        ok = real_verify(view, expected)
        verified[[checksum(c) for c in chunks].index(expected)].set()
        return ok

    monkeypatch.setattr(pipeline, "_verify_chunk", verify)
    sock, link = _pair()
    _send_gated(sock, chunks, [None, *verified[:-1]])
    targets = [memoryview(bytearray(len(c))) for c in chunks]
    verifier = Verifier()
    try:
        report = receive_batch(
            link, [len(c) for c in chunks], targets, [checksum(c) for c in chunks], TIMEOUT_S, verifier
        )
    finally:
        verifier.close()
        link.close()
    assert report.verdicts == [True] * 5
    assert [bytes(t) for t in targets] == chunks
    assert all(a <= v for a, v in zip(report.arrived_s, report.verified_s))
    assert all(report.verified_s[i] <= report.arrived_s[i + 1] for i in range(4))  # verified before the next came


def test_a_corrupted_chunk_fails_only_its_own_check_and_a_dropped_chunk_is_skipped():
    chunks = [os.urandom(64 * 1024) for _ in range(4)]
    sums = [checksum(c) for c in chunks]
    sent = list(chunks)
    sent[2] = bytes([sent[2][0] ^ 0xFF]) + sent[2][1:]  # one byte wrong on the way
    sock, link = _pair()
    _send_gated(sock, sent, [None] * 4)
    targets: list[memoryview | None] = [memoryview(bytearray(len(c))) for c in chunks]
    targets[1] = None  # the sink had no room for it: received and dropped
    verifier = Verifier()
    try:
        report = receive_batch(link, [len(c) for c in chunks], targets, sums, TIMEOUT_S, verifier)
    finally:
        verifier.close()
        link.close()
    assert report.verdicts == [True, True, False, True]
    assert bytes(targets[0]) == chunks[0] and bytes(targets[3]) == chunks[3]  # type: ignore[arg-type]


def test_a_peer_gone_mid_batch_raises_only_after_every_started_check_finished(monkeypatch):
    """The caller releases the sink buffers when this raises: no check may still be reading them."""
    running: list[int] = []
    finished: list[float] = []
    real_verify = pipeline._verify_chunk

    def slow_verify(view: memoryview, expected: int) -> bool:
        running.append(1)
        time.sleep(0.2)
        finished.append(time.monotonic())
        return real_verify(view, expected)

    monkeypatch.setattr(pipeline, "_verify_chunk", slow_verify)
    chunks = [os.urandom(32 * 1024) for _ in range(4)]
    sock, link = _pair()
    _send_gated(sock, chunks, [None] * 4, stop_after=2)  # the node dies after two chunks
    verifier = Verifier()
    try:
        with pytest.raises(NcclError, match="closed the channel mid-transfer"):
            receive_batch(
                link,
                [len(c) for c in chunks],
                [memoryview(bytearray(len(c))) for c in chunks],
                [checksum(c) for c in chunks],
                TIMEOUT_S,
                verifier,
            )
        raised_at = time.monotonic()
    finally:
        verifier.close()
    assert len(running) == 2 and len(finished) == 2 and max(finished) <= raised_at
    assert link.broken  # never reused: the next request pairs again


def test_sizes_targets_and_checksums_that_disagree_are_refused():
    sock, link = _pair()
    chunks = [b"abc", b"defg"]
    _send_gated(sock, chunks, [None, None])
    verifier = Verifier()
    try:
        with pytest.raises(ValueError, match="sizes"):
            receive_batch(link, [3, 4], [None], [0, 0], TIMEOUT_S, verifier)
    finally:
        verifier.close()
        link.close()
