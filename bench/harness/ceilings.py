"""This machine's ceilings, measured in the same run as the backends they bound.

* memcpy: ``torch`` copying one large tensor into another (bytes copied per second);
  the bound for anything that stays in this machine's memory (``fs://`` in page cache).
* TCP loopback: one Python sender thread ``sendall``-ing into one receiver thread that
  ``recv_into``-s a preallocated buffer over 127.0.0.1; the bound for a single stream
  to a server on this host, which is what every network backend here is. By default
  both ends reuse one 4 MiB buffer, which stays in the CPU's cache; with
  ``buffer_bytes`` they cycle through distinct buffers of that much memory on each
  side, as a batch of chunks does (from DRAM into DRAM).

Each is the best of a few repetitions: a ceiling is what the machine can do.
"""

from __future__ import annotations

import socket
import threading
import time

import torch

__all__ = ["memcpy_gbps", "tcp_loopback_gbps"]

TCP_CHUNK_BYTES = 4 << 20
TCP_TIMEOUT_S = 60.0


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """GB/s of ``dst.copy_(src)`` for ``nbytes``-byte tensors (best of ``repeats``)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages is not a copy
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best_s = min(best_s, time.perf_counter() - start)
    if not torch.equal(src, dst):
        raise RuntimeError("memcpy ceiling: the copy differs from its source")
    return nbytes / best_s / 1e9


def _receive(sock: socket.socket, total: int, into: memoryview, got: list[int]) -> None:
    conn, _ = sock.accept()
    with conn:
        while got[0] < total:
            offset = got[0] % len(into)  # the next bytes of the sink, round and round
            n = conn.recv_into(into[offset : offset + min(len(into) - offset, total - got[0])])
            if n == 0:
                break
            got[0] += n


def _one_stream(total: int, buffer_bytes: int) -> float:
    count = max(1, buffer_bytes // TCP_CHUNK_BYTES)
    source = torch.randint(0, 256, (count * TCP_CHUNK_BYTES,), dtype=torch.uint8).numpy()
    payloads = [memoryview(source[i * TCP_CHUNK_BYTES : (i + 1) * TCP_CHUNK_BYTES]) for i in range(count)]
    sink = memoryview(bytearray(count * TCP_CHUNK_BYTES))
    got = [0]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        receiver = threading.Thread(
            target=_receive, args=(listener, total, sink, got), name="tcp-ceiling-recv", daemon=True
        )
        receiver.start()
        with socket.create_connection(listener.getsockname(), timeout=TCP_TIMEOUT_S) as sender:
            start = time.perf_counter()
            sent = 0
            while sent < total:
                piece = payloads[(sent // TCP_CHUNK_BYTES) % count][: min(TCP_CHUNK_BYTES, total - sent)]
                sender.sendall(piece)
                sent += len(piece)
            receiver.join(TCP_TIMEOUT_S)
            elapsed = time.perf_counter() - start
    if receiver.is_alive() or got[0] != total:
        raise RuntimeError(f"TCP ceiling: received {got[0]} of {total} bytes")
    return total / elapsed / 1e9


def tcp_loopback_gbps(nbytes: int, repeats: int = 3, buffer_bytes: int = TCP_CHUNK_BYTES) -> float:
    """GB/s of one TCP stream over 127.0.0.1 moving ``nbytes`` (best of ``repeats``) through ``buffer_bytes``."""
    return max(_one_stream(nbytes, buffer_bytes) for _ in range(repeats))
