"""Every scatter-gather write loop ends, whatever its buffers: empty ones included.

An empty chunk once wedged a node: ``writev(fd, [header, b""])`` wrote the header,
then returned 0 for the empty buffer left at the front, forever. The loops now go
through ``backend.iov``; these tests drive it, the NVMe writer and the socket
sender with buffer lists that hold empty buffers anywhere.
"""

from __future__ import annotations

import asyncio
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend import iov
from backend.node.store import nvme_format as nvme
from backend.node.store.nvme_format import read_header, read_payload, write_chunk
from backend.protocol import ItemMeta, checksum
from backend.transport import FrameSocket

buffer_lists = st.lists(st.binary(min_size=0, max_size=300), min_size=0, max_size=12)
# How much each write call takes: a partial write of 1..n bytes, as a kernel may do.
write_sizes = st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=50)


@given(buffer_lists, write_sizes)
def test_advance_leaves_exactly_the_unwritten_bytes_and_no_empty_buffer(buffers, sizes):
    views = iov.to_write(buffers)
    expected = b"".join(buffers)
    written = 0
    steps = 0
    while views:
        assert all(len(v) for v in views), "an empty buffer left in the list makes the next write return 0"
        n = min(sizes[steps % len(sizes)], sum(len(v) for v in views))
        iov.advance(views, n)
        written += n
        steps += 1
        assert b"".join(bytes(v) for v in views) == expected[written:]
    assert written == len(expected)
    assert steps <= len(expected)  # every call made progress


def test_advance_refuses_a_count_beyond_what_is_left():
    views = iov.to_write([b"ab", b"", b"c"])
    with pytest.raises(OSError, match="more than it was given"):
        iov.advance(views, 4)


@settings(max_examples=60, deadline=None)
@given(buffer_lists, write_sizes)
def test_nvme_write_all_writes_every_byte_through_partial_writevs(tmp_path_factory, buffers, sizes):
    path = tmp_path_factory.mktemp("w") / "out"
    calls = iter(sizes * 1000)
    real_writev = os.writev

    def partial_writev(fd: int, bufs: list[memoryview]) -> int:  # a short write, which a regular file rarely gives
        limit = next(calls)
        taken, room = [], limit
        for buf in bufs:
            if room <= 0:
                break
            taken.append(buf[:room])
            room -= len(taken[-1])
        return real_writev(fd, taken)

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        nvme.os.writev = partial_writev  # type: ignore[attr-defined]
        nvme.write_all(fd, buffers)
    finally:
        nvme.os.writev = real_writev  # type: ignore[attr-defined]
        os.close(fd)
    assert path.read_bytes() == b"".join(buffers)


def test_an_empty_chunk_is_written_and_read_back(tmp_path: Path):
    meta = ItemMeta("empty", 0, checksum(b""), "uint8", (0,), 0)
    record = write_chunk(tmp_path, meta, b"")
    assert read_header(record.path).meta == meta
    into = bytearray(0)
    read_payload(record, into)
    assert not list(tmp_path.rglob("*.tmp"))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 7, 4096, 300_000]), min_size=1, max_size=8))
def test_a_socket_send_with_empty_buffers_delivers_every_byte(sizes):
    async def run() -> bytes:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            left = socket.create_connection(listener.getsockname())
            right, _ = listener.accept()
        buffers = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
        conn = FrameSocket(left, asyncio.get_running_loop(), "test")
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # partial sendmsg calls, for real
        received = bytearray()
        total = sum(sizes)

        def drain() -> None:
            while len(received) < total:
                piece = right.recv(65536)
                assert piece
                received.extend(piece)

        reader = asyncio.get_running_loop().run_in_executor(None, drain)
        await asyncio.wait_for(conn.send(buffers), 10)
        await asyncio.wait_for(reader, 10)
        conn.close()
        right.close()
        return b"".join(buffers) == bytes(received)

    assert asyncio.run(run())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 7, 4096, 300_000]), min_size=1, max_size=8))
def test_a_socket_receive_into_buffers_with_empty_ones_fills_each_exactly(sizes):
    """``recv_many`` (the loop on the event loop, and its worker-thread twin for bulk sizes) over
    targets that include empty buffers: each is filled with exactly its own bytes, and it ends."""

    async def run() -> bool:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            left = socket.create_connection(listener.getsockname())
            right, _ = listener.accept()
        sent = [bytes([(i * 37) % 251]) * n for i, n in enumerate(sizes)]
        executor = ThreadPoolExecutor(2)
        conn = FrameSocket(right, asyncio.get_running_loop(), "test", executor)
        targets = [bytearray(n) for n in sizes]
        writer = asyncio.get_running_loop().run_in_executor(None, left.sendall, b"".join(sent))
        await asyncio.wait_for(conn.recv_many(targets), 10)
        await asyncio.wait_for(writer, 10)
        conn.close()
        left.close()
        executor.shutdown()
        return [bytes(t) for t in targets] == sent

    assert asyncio.run(run())
