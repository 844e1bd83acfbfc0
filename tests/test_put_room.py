"""A put under memory pressure, with real node processes: it says exactly which chunks are
stored, waits for room while DRAM is full of puts in flight, and only then is refused as busy."""

from __future__ import annotations

import asyncio
import random
import socket
import time
import uuid

import pytest

from backend.client import Chunk, PoolClient, SyncPoolClient
from backend.config import PoolConfig
from backend.errors import BusyError, CapacityError, PutOutcome
from backend.launch.nodes import NodeProcess
from backend.protocol import ItemMeta, Op, checksum
from backend.protocol.frame import encode_header
from backend.protocol.puts import PutBatch

MiB = 1024 * 1024


def _chunks(prefix: str, count: int, size: int) -> list[Chunk]:
    rng = random.Random(prefix)
    return [Chunk(f"{prefix}@{i}", rng.randbytes(size)) for i in range(count)]


class PutInFlight:
    """A put of one chunk (raw frames) whose bytes have all come but the last: it holds its DRAM until it
    lands or aborts. (Room is reserved as bytes arrive, so a put holds DRAM for the bytes it sent.) It
    comes from another client host (127.0.0.2), so the puts it holds back wait for DRAM, not for their
    host's room ahead of its bytes."""

    def __init__(self, node: NodeProcess, nbytes: int) -> None:
        self.payload = bytes(nbytes)
        item = ItemMeta(f"in-flight-{uuid.uuid4().hex}", nbytes, checksum(self.payload), "uint8", (nbytes,), 0)
        meta = PutBatch.encode_items([item])
        self.sock = socket.create_connection((node.host, node.port), source_address=("127.0.0.2", 0))
        self.sock.sendall(encode_header(Op.PUT_BATCH, 1, meta, nbytes) + meta + self.payload[:-1])
        time.sleep(0.5)  # the node has received all but the last byte, into the chunk's reserved room

    def land(self) -> None:
        """Send the last byte and wait for the answer: the chunk is stored."""
        self.sock.sendall(self.payload[-1:])
        self.sock.recv(1)
        self.sock.close()

    def abort(self) -> None:
        """Close the connection mid-frame: the node gives the reservation back."""
        self.sock.close()


def _lock_then_put(url: str, prefix: str) -> tuple[list[Chunk], BaseException | None, list[bool], int]:
    """On a 64 MiB node: lock 6 x 8 MiB, then put 4 x 8 MiB (striped over 4 connections); the
    put's error, what reads back, and the bytes this client put through its stage."""
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        held = _chunks(f"{prefix}-held", 6, 8 * MiB)
        client.put(held)
        assert all(lock is not None for lock in client.lock([c.key for c in held], ttl_ms=60_000))
        chunks = _chunks(prefix, 4, 8 * MiB)
        error: BaseException | None = None
        try:
            client.put(chunks)
        except CapacityError as exc:
            error = exc
        got = client.get([c.key for c in chunks])
        readback = [g is not None and bytes(g.data) == c.data for c, g in zip(chunks, got)]
        assert all(g is None or bytes(g.data) == c.data for c, g in zip(chunks, got))  # never a wrong byte
        return chunks, error, readback, client.counters.get("staged_put_bytes", 0)


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "staged"])
def test_a_striped_put_never_evicts_its_own_chunks_and_its_error_says_exactly_which_are_stored(
    node_factory, pool_url, shm
):
    node_factory(dram="64MiB", shm=shm)
    url = pool_url + "?connections_per_node=4" + ("" if shm else "&shm=off")
    chunks, error, readback, staged_bytes = _lock_then_put(url, "striped")
    assert (staged_bytes > 0) == shm  # the stage carried the staged case
    # Room for two: the other two are refused, not stored and then evicted by another stripe.
    assert isinstance(error, CapacityError) and not isinstance(error, BusyError)
    assert str(error) == "2 of 4 chunks were not stored: 2 no room"
    stored = [error.outcomes[c.key] is PutOutcome.STORED for c in chunks]
    assert stored == readback  # the report is what a reader finds
    assert sum(stored) == 2
    assert {error.outcomes[c.key] for c in chunks} == {PutOutcome.STORED, PutOutcome.NO_ROOM}


async def _burst(url: str, puts: int, size: int) -> list[BaseException | None]:
    """``puts`` concurrent puts of one chunk each, from four clients; each one's error or None."""
    clients = [PoolClient(PoolConfig.from_url(url)) for _ in range(4)]
    try:

        async def put(n: int) -> BaseException | None:
            try:
                await clients[n % 4].put(_chunks(f"burst{n}", 1, size))
            except CapacityError as exc:
                return exc
            return None

        return list(await asyncio.gather(*(put(n) for n in range(puts))))
    finally:
        for client in clients:
            await client.close()


def _counters(url: str) -> dict[str, int]:
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        (node,) = client.nodes()
        return dict(client.node_stats(node)["counters"])


async def _burst_while(url: str, in_flight: PutInFlight, hold_s: float, end: str) -> list[BaseException | None]:
    """A burst of 16 one-chunk puts of 1 MiB that starts while ``in_flight`` holds all of DRAM;
    after ``hold_s`` it lands or aborts (``end``)."""
    burst = asyncio.ensure_future(_burst(url, puts=16, size=MiB))
    await asyncio.sleep(hold_s)
    if end:
        await asyncio.to_thread(getattr(in_flight, end))
    return await burst


@pytest.mark.parametrize("end", ["land", "abort"])
def test_a_burst_of_puts_waits_for_the_room_a_put_in_flight_holds_and_none_is_refused(node_factory, pool_url, end):
    node = node_factory(dram="8MiB")
    url = pool_url + "?progress_timeout_s=20"  # each put may wait 10 s for room, longer than the node's old 5 s
    in_flight = PutInFlight(node, 8 * MiB)  # all of DRAM
    burst = asyncio.run(_burst_while(url, in_flight, hold_s=6.0, end=end))
    assert burst == [None] * 16
    counters = _counters(url)
    assert counters.get("put_rejected_busy", 0) == 0 and counters.get("put_rejected_capacity", 0) == 0
    assert counters["puts"] == 16 + (end == "land")


def test_a_put_that_finds_no_room_before_its_deadline_is_refused_as_busy_and_counted(node_factory, pool_url):
    node = node_factory(dram="8MiB")
    # Each put may wait 1.5 s for room, half the timeout: the other half is the node's answer's margin
    # on a loaded machine (at 1000 ms, 0.5 s of margin was not always enough for 16 refusals).
    url = pool_url + "?progress_timeout_s=3"
    in_flight = PutInFlight(node, 8 * MiB)
    try:
        started = time.monotonic()
        burst = asyncio.run(_burst_while(url, in_flight, hold_s=0.0, end=""))
        assert time.monotonic() - started < 6.0  # refused at the deadline (a client timeout is no BusyError)
    finally:
        in_flight.land()
    assert all(isinstance(error, BusyError) for error in burst)
    assert all(str(error) == "1 of 1 chunks were not stored: 1 busy" for error in burst)
    assert all(list(error.outcomes.values()) == [PutOutcome.BUSY] for error in burst if error is not None)
    assert _counters(url)["put_rejected_busy"] == 16
    with SyncPoolClient(PoolConfig.from_url(url)) as client:  # once the put in flight landed there is room
        client.put(_chunks("after", 1, MiB))
