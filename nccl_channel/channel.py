"""The channel: chunks asked for over a node's TCP protocol, bytes moved over a pair communicator.

Client side (:class:`NcclChannel`), for chunks on a node of its own cluster:

1. First use of a node: make the transport's unique id, publish it as a rendezvous
   offer in Redis (``nccl_channel.rendezvous``), start joining as rank 0, and send
   ``CHANNEL_GET {session, keys: []}``; the node takes the offer and joins as rank 1.
   The pair is cached per (node, epoch) and reused.
2. ``CHANNEL_GET {session, keys}``: the node answers, over TCP, which keys it found
   with their sizes and checksums, and sends their bytes over the communicator in
   one group, in key order.
3. The client receives the group into its staging buffer (GPU memory for NCCL), copies
   each chunk into the sink's buffer (LMCache's memory object) and verifies its
   checksum: a wrong byte is never returned.

Node side (:class:`ChannelServer`): joins offers meant for it and sends.

Every step is bounded; on any failure the pair is aborted and dropped, and the
error (:class:`NcclError`, or the control path's ``KVPoolError``) reaches the caller,
which falls back to TCP. Pairs are serialised: one transfer at a time per pair.

Two transports share this contract (:class:`Transport`): :class:`NcclTransport`
(libnccl, GPU to GPU) and :class:`CpuTransport` (a TCP socket between the two
processes), with which the tests exercise rendezvous, caching, batching, timeouts
and fallback on machines without a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import socket
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from backend.errors import IntegrityError, KVPoolError, NcclError
from backend.protocol import (
    ItemMeta,
    checksum,
    decode_channel_response,
    encode_channel_request,
)
from nccl_channel.rendezvous import Offer, Rendezvous, new_session

__all__ = [
    "Transport",
    "Link",
    "CpuTransport",
    "NcclTransport",
    "NcclChannel",
    "ChannelServer",
    "transfer_timeout",
    "make_transport",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
MIN_TRANSFER_BYTES_PER_S = 50 * 1024 * 1024  # a transfer's timeout grows by 20 ms per MiB
MAX_PAIRS = 64  # communicators kept per endpoint; the least recently used is closed
SECRET_BYTES = 16
_BATCH_HEAD = struct.Struct("<QQ")  # CPU transport: item count, total bytes


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

    def recv(self, sizes: Sequence[int], timeout_s: float) -> list[torch.Tensor]:
        """Receive a batch of ``sizes`` bytes into staging; the views stay valid until the next recv."""

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


# -- CPU transport ------------------------------------------------------------------------
class CpuLink:
    """A pair over one TCP socket: a batch is a small header and the concatenated bytes."""

    def __init__(self, sock: socket.socket, progress: Callable[[int], None] | None = None) -> None:
        self.sock = sock
        self.progress = progress
        self.broken = False
        self._staging = torch.empty(0, dtype=torch.uint8)

    def _deadline_io(self, deadline: float, what: str) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NcclError(f"{what} timed out", 8, "timeout")
        self.sock.settimeout(remaining)

    def send(self, buffers: Sequence[Buffer], timeout_s: float) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        deadline = time.monotonic() + timeout_s
        try:
            self._deadline_io(deadline, "send")
            self.sock.sendall(_BATCH_HEAD.pack(len(views), sum(len(v) for v in views)))
            for view in views:
                self._deadline_io(deadline, "send")
                self.sock.sendall(view)
        except NcclError:
            self.abort()
            raise
        except OSError as exc:  # socket.timeout is an OSError
            self.abort()
            raise NcclError(f"send failed: {exc or 'timed out'}") from None

    def recv(self, sizes: Sequence[int], timeout_s: float) -> list[torch.Tensor]:
        total = sum(sizes)
        deadline = time.monotonic() + timeout_s
        head = bytearray(_BATCH_HEAD.size)
        try:
            self._recv_exact(memoryview(head), deadline)
            count, declared = _BATCH_HEAD.unpack(head)
            if (count, declared) != (len(sizes), total):
                raise NcclError(f"peer sent {count} items / {declared} bytes, expected {len(sizes)} / {total}")
            if self._staging.numel() < total:
                self._staging = torch.empty(total, dtype=torch.uint8)
            staging = memoryview(self._staging.numpy()).cast("B")
            views, offset = [], 0
            for index, size in enumerate(sizes):
                self._recv_exact(staging[offset : offset + size], deadline)
                views.append(self._staging[offset : offset + size])
                offset += size
                if self.progress is not None:
                    self.progress(index)
        except NcclError:
            self.abort()
            raise
        except OSError as exc:
            self.abort()
            raise NcclError(f"receive failed: {exc or 'timed out'}") from None
        return views

    def _recv_exact(self, view: memoryview, deadline: float) -> None:
        while view:
            self._deadline_io(deadline, "receive")
            n = self.sock.recv_into(view)
            if n == 0:
                raise NcclError("the peer closed the channel mid-transfer")
            view = view[n:]

    def abort(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def close(self) -> None:
        self.abort()


class CpuTransport:
    """The channel's contract over TCP sockets: what the tests run without a GPU.

    The unique id is the address of a listener that rank 0 opens, plus a secret the
    joining side must present. ``progress`` (optional) is called with each item's
    index as it arrives: a seam for tests that act at a precise point of a transfer.
    """

    kind = "cpu"

    def __init__(self, host: str = "127.0.0.1", progress: Callable[[int], None] | None = None) -> None:
        self.host = host
        self.progress = progress

    def prepare(self) -> tuple[bytes, Any]:
        listener = socket.create_server((self.host, 0), backlog=4)
        secret = os.urandom(SECRET_BYTES)
        host, port = listener.getsockname()[:2]
        unique_id = json.dumps({"host": host, "port": port, "secret": secret.hex()}).encode()
        return unique_id, (listener, secret)

    def join(self, unique_id: bytes, rank: int, state: Any, timeout_s: float) -> Link:
        deadline = time.monotonic() + timeout_s
        if rank == 0:
            listener, secret = state
            return self._accept(listener, secret, deadline)
        try:
            address = json.loads(unique_id)
            host, port, secret = str(address["host"]), int(address["port"]), bytes.fromhex(address["secret"])
        except (ValueError, KeyError, TypeError):
            raise NcclError("CPU transport unique id is malformed") from None
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(secret)
        except OSError as exc:
            raise NcclError(f"cannot join the pair at {host}:{port}: {exc or 'timed out'}") from None
        return CpuLink(sock, self.progress)

    def _accept(self, listener: socket.socket, secret: bytes, deadline: float) -> CpuLink:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NcclError("the peer did not join the pair in time", 8, "timeout")
            listener.settimeout(remaining)
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                raise NcclError(f"the peer did not join the pair: {exc or 'timed out'}") from None
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            presented = bytearray()
            try:
                while len(presented) < SECRET_BYTES and (piece := sock.recv(SECRET_BYTES - len(presented))):
                    presented += piece
            except OSError:
                presented = bytearray()
            if hmac.compare_digest(bytes(presented), secret):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return CpuLink(sock, self.progress)
            sock.close()  # not our peer: keep waiting for it

    def discard(self, state: Any) -> None:
        listener, _ = state
        listener.close()


# -- NCCL transport -----------------------------------------------------------------------
class NcclLink:
    """A pair over a :class:`PairCommunicator`: host bytes are staged on the device, sent in one group."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self._staging = torch.empty(0, dtype=torch.uint8, device=comm.device)

    @property
    def broken(self) -> bool:
        return bool(self.comm.broken or self.comm.closed)

    def _stage(self, total: int) -> torch.Tensor:
        if self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8, device=self.comm.device)
        return self._staging

    def send(self, buffers: Sequence[Buffer], timeout_s: float) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        staging = self._stage(sum(len(v) for v in views))
        slices, offset = [], 0
        for view in views:
            if len(view):
                part = staging[offset : offset + len(view)]
                part.copy_(torch.frombuffer(view, dtype=torch.uint8))
                slices.append(part)
            offset += len(view)
        self.comm.send(slices, timeout_s)

    def recv(self, sizes: Sequence[int], timeout_s: float) -> list[torch.Tensor]:
        staging = self._stage(sum(sizes))
        views, offset = [], 0
        for size in sizes:
            views.append(staging[offset : offset + size])
            offset += size
        self.comm.recv([v for v in views if v.numel()], timeout_s)
        return views

    def abort(self) -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.close()


class NcclTransport:
    """Pairs over libnccl on one CUDA device (``nccl_channel.available()`` must be true)."""

    kind = "nccl"

    def __init__(self, device: str | torch.device = "cuda:0") -> None:
        from nccl_channel.library import load_library

        self.device = torch.device(device)
        self.lib = load_library()

    def prepare(self) -> tuple[bytes, Any]:
        return self.lib.unique_id().to_bytes(), None

    def join(self, unique_id: bytes, rank: int, state: Any, timeout_s: float) -> Link:
        from nccl_channel.communicator import PairCommunicator
        from nccl_channel.library import NcclUniqueId

        comm = PairCommunicator.create(self.lib, NcclUniqueId.from_bytes(unique_id), rank, 2, self.device, timeout_s)
        return NcclLink(comm)

    def discard(self, state: Any) -> None:
        pass


def make_transport(kind: str, device: str = "cuda:0") -> Transport:
    """The transport named ``kind`` ("nccl" or "cpu"); NcclError if it cannot run here."""
    if kind == "cpu":
        return CpuTransport()
    if kind == "nccl":
        from nccl_channel import available

        status = available()
        if not status.ok:
            raise NcclError(f"the NCCL channel cannot run here: {status.reason}")
        return NcclTransport(device)
    raise NcclError(f"unknown channel transport {kind!r}; known: nccl, cpu")


# -- client side --------------------------------------------------------------------------
class Peer(Protocol):
    """A node as the channel needs it (``backend.metadata.NodeInfo``)."""

    node_id: str
    epoch: int


class Sink(Protocol[T]):  # type: ignore[misc]
    """Where received chunks go (``backend.client.Sink``)."""

    async def allocate(self, meta: ItemMeta) -> tuple[T, Buffer] | None: ...

    def release(self, handle: T) -> None: ...


Request = Callable[[Any, bytes], Awaitable[bytes]]


@dataclasses.dataclass
class _Pair:
    session: str
    link: Link
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class NcclChannel:
    """The client end: pairs with nodes lazily, receives chunks over them.

    ``request(node, meta)`` sends one CHANNEL_GET over the node's TCP protocol and
    returns the response meta (``PoolClient.channel_request``).
    """

    def __init__(self, transport: Transport, rendezvous: Rendezvous, endpoint_id: str, cluster: str,
                 request: Request, timeout_s: float, max_pairs: int = MAX_PAIRS) -> None:  # fmt: skip
        self.transport = transport
        self.rendezvous = rendezvous
        self.endpoint_id = endpoint_id
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.max_pairs = max_pairs
        self.counters: Counter[str] = Counter()
        self._request = request
        self._pairs: OrderedDict[tuple[str, int], _Pair] = OrderedDict()
        self._creating: dict[tuple[str, int], asyncio.Lock] = {}
        self._closed = False

    @property
    def kind(self) -> str:
        return self.transport.kind

    def serves(self, node: Any) -> bool:
        """Whether ``node`` is reachable over this channel: same cluster, same transport."""
        return bool(self.cluster) and node.cluster == self.cluster and getattr(node, "channel", "") == self.kind

    def pair_count(self) -> int:
        return len(self._pairs)

    async def _pair(self, node: Peer) -> _Pair:
        ident = (node.node_id, node.epoch)
        pair = self._pairs.get(ident)
        if pair is not None and not pair.link.broken:
            self._pairs.move_to_end(ident)
            return pair
        async with self._creating.setdefault(ident, asyncio.Lock()):
            pair = self._pairs.get(ident)
            if pair is not None and not pair.link.broken:
                return pair
            self._drop(ident)
            link, session = await self._connect(node)
            pair = self._pairs[ident] = _Pair(session, link)
            self.counters["pairs_created"] += 1
            while len(self._pairs) > self.max_pairs:
                _, oldest = self._pairs.popitem(last=False)
                oldest.link.close()
            return pair

    async def _connect(self, node: Peer) -> tuple[Link, str]:
        if self._closed:
            raise NcclError("the channel is closed")
        session = new_session()
        unique_id, state = self.transport.prepare()
        try:
            offer = Offer(session, self.transport.kind, unique_id, self.endpoint_id, node.node_id, self.cluster)
            await self.rendezvous.publish(offer)
            joining = asyncio.ensure_future(asyncio.to_thread(self.transport.join, unique_id, 0, state, self.timeout_s))
            try:
                await self._request(node, encode_channel_request(session, []))
            except BaseException:
                self.transport.discard(state)  # a CPU accept fails at once instead of at its deadline
                with contextlib.suppress(Exception):
                    (await joining).abort()
                raise
            link = await joining
        finally:
            self.transport.discard(state)
        logger.info("channel: paired with node %s over %s (session %s)", node.node_id, self.kind, session)
        return link, session

    def _drop(self, ident: tuple[str, int]) -> None:
        pair = self._pairs.pop(ident, None)
        if pair is not None:
            pair.link.abort()

    async def get(self, node: Peer, keys: Sequence[str], sink: Sink[Any]) -> list[Any]:
        """Fetch ``keys`` from ``node`` over the channel into ``sink`` buffers.

        Per key: the sink's handle, None (the node does not hold it, or the sink had
        no room), or an ``IntegrityError``. Raises NcclError / KVPoolError when the
        pair or the node failed; the pair is then aborted and dropped.
        """
        if not keys:
            return []
        ident = (node.node_id, node.epoch)
        pair = await self._pair(node)
        async with pair.lock:
            try:
                reply = await self._request(node, encode_channel_request(pair.session, keys))
                found = decode_channel_response(reply, keys)
                items = [item for item in found if item is not None]
                total = sum(item.nbytes for item in items)
                staged: list[torch.Tensor] = []
                if items:
                    staged = await asyncio.to_thread(
                        pair.link.recv, [i.nbytes for i in items], transfer_timeout(self.timeout_s, total)
                    )
            except BaseException:
                if self._pairs.get(ident) is pair:
                    self._drop(ident)
                else:
                    pair.link.abort()
                self.counters["pair_failures"] += 1
                raise
            self.counters["bytes"] += total
            return await self._deliver(found, staged, sink)

    async def _deliver(self, found: list[ItemMeta | None], staged: list[torch.Tensor], sink: Sink[Any]) -> list[Any]:
        """Copy staged chunks into sink buffers and verify each checksum."""
        results: list[Any] = [None] * len(found)
        work: list[tuple[int, ItemMeta, Any, memoryview, torch.Tensor]] = []
        pending = iter(staged)
        try:
            for index, item in enumerate(found):
                if item is None:
                    continue
                source = next(pending)
                allocated = await sink.allocate(item)
                if allocated is None:
                    continue  # no room this time: a miss for this call only
                handle, buffer = allocated
                results[index] = handle
                view = memoryview(buffer).cast("B")
                if len(view) != item.nbytes:
                    raise KVPoolError(f"sink gave {len(view)} bytes for a {item.nbytes}-byte item")
                work.append((index, item, handle, view, source))
            verdicts = await asyncio.to_thread(_copy_and_verify, [(v, s, i.checksum) for _, i, _, v, s in work])
        except BaseException:
            for handle in results:
                if handle is not None:
                    sink.release(handle)
            raise
        for (index, item, handle, _, _), ok in zip(work, verdicts):
            if not ok:
                sink.release(handle)
                self.counters["integrity_failures"] += 1
                results[index] = IntegrityError(f"checksum mismatch for {item.key!r} over the channel")
        return results

    async def close(self) -> None:
        self._closed = True
        for pair in self._pairs.values():
            pair.link.close()
        self._pairs.clear()


def _copy_and_verify(work: Sequence[tuple[memoryview, torch.Tensor, int]]) -> list[bool]:
    verdicts = []
    for view, source, expected in work:
        if len(view):
            torch.frombuffer(view, dtype=torch.uint8).copy_(source)
        verdicts.append(checksum(view) == expected)
    return verdicts


# -- node side ----------------------------------------------------------------------------
class ChannelServer:
    """The node end: joins offers meant for this node and sends chunks over the pairs."""

    def __init__(self, transport: Transport, rendezvous: Rendezvous, node_id: str, cluster: str, timeout_s: float,
                 max_pairs: int = MAX_PAIRS) -> None:  # fmt: skip
        self.transport = transport
        self.rendezvous = rendezvous
        self.node_id = node_id
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.max_pairs = max_pairs
        self.counters: Counter[str] = Counter()
        self._pairs: OrderedDict[str, _Pair] = OrderedDict()
        self._joining: dict[str, asyncio.Lock] = {}

    @property
    def kind(self) -> str:
        return self.transport.kind

    async def join(self, session: str) -> None:
        """Make sure the pair of ``session`` exists, joining its offer if new. Bounded; NcclError on failure."""
        pair = self._pairs.get(session)
        if pair is not None and not pair.link.broken:
            self._pairs.move_to_end(session)
            return
        lock = self._joining.setdefault(session, asyncio.Lock())
        try:
            async with lock:
                if session in self._pairs and not self._pairs[session].link.broken:
                    return
                self._drop(session)
                offer = await self.rendezvous.take(session, target=self.node_id, cluster=self.cluster,
                                                   transport=self.kind)  # fmt: skip
                link = await asyncio.to_thread(self.transport.join, offer.unique_id, 1, None, self.timeout_s)
                self._pairs[session] = _Pair(session, link)
                self.counters["channel_pairs"] += 1
                while len(self._pairs) > self.max_pairs:
                    _, oldest = self._pairs.popitem(last=False)
                    oldest.link.close()
                logger.info("channel: node %s paired with %s over %s", self.node_id, offer.initiator, self.kind)
        finally:
            self._joining.pop(session, None)

    def _drop(self, session: str) -> None:
        pair = self._pairs.pop(session, None)
        if pair is not None:
            pair.link.abort()

    async def send(self, session: str, buffers: Sequence[Buffer]) -> None:
        """Send ``buffers`` as one batch over the pair of ``session``; a failure drops the pair."""
        pair = self._pairs.get(session)
        if pair is None:
            self.counters["channel_errors"] += 1
            logger.warning("channel: node %s has no pair for session %s; nothing sent", self.node_id, session)
            return
        nbytes = sum(len(memoryview(b).cast("B")) for b in buffers)
        async with pair.lock:
            try:
                await asyncio.to_thread(pair.link.send, buffers, transfer_timeout(self.timeout_s, nbytes))
            except NcclError as exc:
                self.counters["channel_errors"] += 1
                if self._pairs.get(session) is pair:
                    self._drop(session)
                logger.warning("channel: send to session %s failed, pair dropped: %s", session, exc)
                return
        self.counters["channel_bytes"] += nbytes

    def close(self) -> None:
        for pair in self._pairs.values():
            pair.link.close()
        self._pairs.clear()
