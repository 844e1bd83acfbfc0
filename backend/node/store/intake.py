"""A put's chunks coming into DRAM: room is reserved as their bytes arrive, never far ahead of them.

A chunk's bytes are received straight into the buffer it will live in, so its room (a
DRAM reservation, and the buffer: an arena region or private memory) is taken before
they come. That room is held for bytes that have not arrived, and a client that declares
large chunks and then stalls would hold it for ``frame_timeout_s``, evicting the cache to
make it and refusing other clients' puts meanwhile. So what a put holds ahead of its bytes
is bounded (:class:`AheadBounds`):

* **Per connection**: a request's chunks come in windows of at most ``connection_bytes``
  (1/8 of DRAM, between 4 and 128 MiB): the window's room is taken, then its bytes
  received, and only then the next window's room. A chunk larger than that comes in parts
  of that size, each part's room taken as the one before it has arrived, into private
  memory whose pages the kernel gives only as bytes land (an arena region would be taken
  whole, before its bytes).
* **Per client host**: the puts of one host's connections together hold at most
  ``host_bytes`` ahead (1/4 of DRAM, between ``connection_bytes`` and 512 MiB). A put from a
  host at its bound waits until the host's other puts receive their bytes (or its deadline:
  busy). Only puts receiving bytes hold it, so the wait never depends on anything but their
  progress, and one host never waits on another's.

There is no node-wide bound on room ahead: it would let the stalled uploads of one host
refuse every other host's puts, which is what the bounds are for. Many hosts holding the
token can together hold ``host_bytes`` each.

A stage's bytes (PUT_STAGED) are all in the client's shared memory already: nothing is
held ahead of them, so they come in windows of ``STAGED_WINDOW_BYTES`` and are not counted.

Waiting follows one rule: a request waits (for DRAM, or its host's room ahead) holding no
reservation another waiter may need, else two could wait for each other. A request
with a window of reserved chunks receives it before it waits; the later parts of a large
chunk (holding the earlier parts' room) may wait for their host's room ahead, which only
puts receiving bytes hold, but not for DRAM; and a request lets its own uncommitted chunks
move before it waits (``DramRoom.settle``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from backend.errors import BusyError, CapacityError
from backend.node.memory.buffers import ChunkBuffer
from backend.node.store.dram import StoredChunk
from backend.node.store.quotas import TenantQuotas
from backend.node.store.room import DramRoom
from backend.protocol import ItemMeta
from backend.protocol.frame import checksum_stream
from backend.protocol.puts import PUT_BUSY, PUT_INTEGRITY, PUT_NO_ROOM, PUT_STORED

__all__ = ["AheadBounds", "ChunkSource", "Intake", "Received", "RoomAhead", "STAGED_WINDOW_BYTES", "take_request"]

MiB = 1024 * 1024
CONNECTION_SHARE = 8  # a connection holds at most 1/8 of DRAM ahead of its bytes ...
CONNECTION_MIN_BYTES = 4 * MiB  # ... but never less than this (a tiny tier still takes chunks whole) ...
CONNECTION_MAX_BYTES = 128 * MiB  # ... nor more (a 256-token chunk of a 70B model is 80 MiB: whole)
HOST_SHARE = 4  # a client host's connections together: at most 1/4 of DRAM ...
HOST_MAX_BYTES = 512 * MiB  # ... and at most this
STAGED_WINDOW_BYTES = 64 * MiB  # a staged put's chunks are copied this many bytes at a time

Received = list[tuple[int, ItemMeta, StoredChunk | None]]  # per item: PUT outcome, item, chunk inserted


@dataclasses.dataclass(frozen=True)
class AheadBounds:
    """How much room puts may hold ahead of their bytes: per connection, and per client host."""

    connection_bytes: int
    host_bytes: int

    @classmethod
    def for_dram(cls, dram_bytes: int) -> AheadBounds:
        connection = min(max(dram_bytes // CONNECTION_SHARE, CONNECTION_MIN_BYTES), CONNECTION_MAX_BYTES, dram_bytes)
        return cls(connection, max(min(dram_bytes // HOST_SHARE, HOST_MAX_BYTES), connection))


class RoomAhead:
    """The room each client host's puts hold ahead of their bytes. Event loop only."""

    def __init__(self, bounds: AheadBounds, on_freed: Callable[[], None]) -> None:
        self.bounds = bounds
        self._held: Counter[str] = Counter()
        self._on_freed = on_freed  # wakes the puts waiting for room

    def held(self, host: str) -> int:
        return self._held[host]

    def take(self, host: str, nbytes: int) -> bool:
        """Hold ``nbytes`` more for ``host`` if its bound allows; whether it did."""
        if self._held[host] + nbytes > self.bounds.host_bytes:
            return False
        self._held[host] += nbytes
        return True

    def give_back(self, host: str, nbytes: int) -> None:
        """The bytes arrived (or never will): ``host`` holds ``nbytes`` less ahead."""
        self._held[host] -= nbytes
        if not self._held[host]:
            del self._held[host]
        self._on_freed()


class ChunkSource(Protocol):
    """Where one request's chunk bytes come from: its connection, or its client's stage."""

    @property
    def host(self) -> str:
        """The client host whose room ahead this request holds; "" when its bytes are all here already."""

    @property
    def window_bytes(self) -> int:
        """The most room held ahead of the bytes at once; with a host, larger chunks come in parts."""

    async def fill(self, window: list[tuple[ItemMeta, ChunkBuffer]]) -> list[int]:
        """Bring each window chunk's bytes into its buffer; each one's checksum."""

    async def fill_part(self, item: ItemMeta, start: int, view: memoryview, running: Any) -> None:
        """Bring the bytes of ``item`` from ``start`` into ``view``, updating the running checksum."""

    async def drop(self, nbytes: int) -> None:
        """Read past the next ``nbytes`` (a chunk refused)."""


async def take_request(
    room: DramRoom,
    quotas: TenantQuotas,
    items: Sequence[ItemMeta],
    ahead: RoomAhead,
    source: ChunkSource,
    *,
    put_id: int,
    until: float,
) -> Received:
    """A request's chunks into reserved DRAM, verified (:class:`Intake`): a PUT outcome per item. No tenant's quota
    evicts the put's own chunks for it; if the request fails, nothing of it stays."""
    intake = Intake(room, quotas, ahead, source, put_id=put_id, until=until)
    try:
        with quotas.guard(put_id, items):
            for item in items:
                await intake.take(item)
            await intake.flush()
    except BaseException:
        intake.abandon()
        await room.drop_uncommitted(intake.inserted())
        raise
    return intake.received


class Intake:
    """One request's chunks on their way into DRAM (``TierManager.take``): reserved, received, verified."""

    def __init__(
        self, room: DramRoom, quotas: TenantQuotas, ahead: RoomAhead, source: ChunkSource, *, put_id: int, until: float
    ) -> None:
        self.dram = room  # room in DRAM, and the buffers the bytes land in
        self.quotas = quotas
        self.ahead = ahead
        self.source = source
        self.put_id = put_id
        self.until = until  # loop time after which the request no longer waits for room
        self.received: Received = []
        self._window: list[tuple[ItemMeta, ChunkBuffer]] = []  # reserved, bytes not here yet
        self._window_bytes = 0
        self._window_growth: Counter[str] = Counter()  # tenant with a quota -> bytes its window chunks add
        # A chunk the eviction order refused cuts the request's chain there: the chunks after it (a request's
        # keys come in prefix order) are refused too, as no lookup could reach them past the missing one.
        self._cut_off = False

    def inserted(self) -> list[StoredChunk]:
        """The chunks this request put into DRAM (not visible before the index commit)."""
        return [chunk for _, _, chunk in self.received if chunk is not None]

    async def take(self, item: ItemMeta) -> None:
        """Bring ``item`` in (in the current window, or in parts), or read past it with the refusal's flag."""
        source = self.source
        room = self.dram.room_of(item.nbytes)
        cut_off = self._cut_off and not self.dram.contains(item.key)
        quota = self.quotas.quota_of(item.key)
        if (
            cut_off
            or not self.dram.admits(item.key, room)  # the eviction order keeps what it holds
            or not await self._within_quota(item, quota)  # the tenant's own chunks could not make room for it
        ):
            self._cut_off = True
            await self.flush()  # the window's bytes come before this chunk's
            await source.drop(item.nbytes)
            self.received.append((PUT_NO_ROOM, item, None))
            return
        if source.host and room > source.window_bytes:
            await self.flush()
            await self._take_in_parts(item, room)
            return
        if self._window and self._window_bytes + room > source.window_bytes:
            await self.flush()
        flag = await self._reserve(room)
        if flag != PUT_STORED:
            await source.drop(item.nbytes)
            self.received.append((flag, item, None))
            return
        self._window.append((item, self.dram.take_buffer(item.nbytes)))
        if quota is not None:
            self._window_growth[quota[0]] += self.quotas.growth(item.key, item.nbytes)
        self._window_bytes += room

    async def _within_quota(self, item: ItemMeta, quota: tuple[str, int] | None) -> bool:
        """Whether ``item`` fits its tenant's quota (``backend.node.store.quotas``), the tenant's coldest chunks (not this
        put's) evicted as needed; the window's chunks of the same tenant, not landed yet, count as held, but
        only the bytes they add (a chunk this node holds already is counted once)."""
        if quota is None:  # ``quota``: the item's tenant and quota (``TenantQuotas.quota_of``)
            return True
        return await self.quotas.make_room(item.key, item.nbytes, self._window_growth[quota[0]], self.put_id)

    async def flush(self) -> None:
        """Receive the window's bytes; each verified chunk enters DRAM."""
        window, room = self._window, self._window_bytes
        if not window:
            return
        self._window, self._window_bytes = [], 0
        self._window_growth.clear()
        try:
            digests = await self.source.fill(window)
        except BaseException:
            for item, _ in window:
                self.dram.release(self.dram.room_of(item.nbytes))
            raise
        finally:
            self._give_back(room)
        for (item, buffer), digest in zip(window, digests):
            self._landed(item, buffer, digest)

    def abandon(self) -> None:
        """The request failed before its window's bytes came: give back what the window holds."""
        for item, _ in self._window:
            self.dram.release(self.dram.room_of(item.nbytes))
        self._give_back(self._window_bytes)
        self._window, self._window_bytes = [], 0
        self._window_growth.clear()

    async def _take_in_parts(self, item: ItemMeta, room: int) -> None:
        """A chunk larger than a window: its room is taken a part at a time, as the bytes before it arrive
        (the parts' rooms add up to the chunk's, ``room``)."""
        dram, source = self.dram, self.source
        buffer = dram.take_buffer(item.nbytes, shared=False)  # private: its pages come as bytes land
        running = checksum_stream()
        reserved = received = 0
        try:
            while reserved < room:
                part = min(source.window_bytes, room - reserved)
                # Holding the earlier parts' room, a later part may not wait for DRAM.
                flag = await self._reserve(part, wait_for_dram=not reserved)
                if flag != PUT_STORED:
                    dram.release(reserved)
                    reserved = 0
                    await source.drop(item.nbytes - received)
                    self.received.append((flag, item, None))
                    return
                reserved += part
                nbytes = min(part, item.nbytes - received)
                try:
                    if nbytes:
                        await source.fill_part(item, received, buffer[received : received + nbytes], running)
                finally:
                    self._give_back(part)
                received += nbytes
        except BaseException:
            dram.release(reserved)
            raise
        self._landed(item, buffer, running.intdigest())

    def _landed(self, item: ItemMeta, buffer: ChunkBuffer, digest: int) -> None:
        """``item``'s bytes are in ``buffer`` (its room reserved): verified, it enters DRAM."""
        dram = self.dram
        if digest != item.checksum:
            dram.release(dram.room_of(item.nbytes))
            self.received.append((PUT_INTEGRITY, item, None))
        elif dram.holds(item.key, item.checksum, item.fingerprint):  # the same bytes are here already: not stored twice
            dram.release(dram.room_of(item.nbytes))
            dram.claim(item.key, self.put_id)
            self.received.append((PUT_STORED, item, None))
        elif not self.quotas.fits(item.key, item.nbytes):  # other puts of its tenant filled the quota meanwhile
            dram.release(dram.room_of(item.nbytes))
            self.received.append((PUT_NO_ROOM, item, None))
        else:
            chunk = StoredChunk(item, buffer)
            dram.insert(chunk, self.put_id)
            self.received.append((PUT_STORED, item, chunk))

    async def _reserve(self, nbytes: int, *, wait_for_dram: bool = True) -> int:
        """Hold ``nbytes`` of room (``TierManager.room_of`` a chunk, or a part of one) for bytes about to
        arrive: PUT_STORED, or the refusal's flag."""
        try:
            if self._window:  # holding a window's room, it may not wait: another waiter may wait for it
                try:
                    await self._hold(nbytes, wait_for_ahead=False, wait_for_dram=False)
                    return PUT_STORED
                except CapacityError:
                    await self.flush()  # the window lands (it may make room for others); now it may wait
            await self._hold(nbytes, wait_for_ahead=True, wait_for_dram=wait_for_dram)
        except BusyError:
            return PUT_BUSY
        except CapacityError:
            return PUT_NO_ROOM
        return PUT_STORED

    async def _hold(self, nbytes: int, *, wait_for_ahead: bool, wait_for_dram: bool) -> None:
        """Hold ``nbytes`` of the host's room ahead, then reserve them in DRAM (demoting or evicting).

        Either one spent by other puts in flight: wait until the request's deadline for some to
        come back (where allowed), holding neither meanwhile, then BusyError.
        """
        let_go = True
        while True:
            if self._take_ahead(nbytes):
                try:
                    await self.dram.reserve(nbytes, put_id=self.put_id)
                    return
                except BaseException as exc:
                    self._give_back(nbytes)
                    if not isinstance(exc, BusyError) or not wait_for_dram:
                        raise
            elif not wait_for_ahead:
                raise BusyError(f"client host {self.source.host} holds its bound of room ahead of its bytes")
            if let_go:  # what it lets go may be what another waiter needs: try again first
                self.dram.settle(self.inserted())
                let_go = False
                continue
            if not await self.dram.wait_for_room(self.until):
                raise BusyError("DRAM stayed full of puts in flight until the request's deadline")

    def _take_ahead(self, nbytes: int) -> bool:
        return not self.source.host or not nbytes or self.ahead.take(self.source.host, nbytes)

    def _give_back(self, nbytes: int) -> None:
        if self.source.host and nbytes:
            self.ahead.give_back(self.source.host, nbytes)
