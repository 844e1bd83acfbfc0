"""The channel: chunks asked for over a node's TCP protocol, bytes moved over a pair communicator.

Client side (:class:`NcclChannel`), for chunks on a node of its own cluster:

1. First use of a node: make the transport's unique id, publish it as a rendezvous
   offer in Redis (``nccl_channel.rendezvous``), start joining as rank 0, and send
   ``CHANNEL_GET {session, keys: []}``; the node takes the offer, answers at once and
   joins as rank 1 in the background. Both joins have the pairing deadline
   (``pair_timeout_s``, 30 s and more: a cold NCCL init takes seconds), not the
   request timeout, and no request waits on them, so a slow pairing never times out
   (and closes) the TCP connection other requests share. :meth:`NcclChannel.engaged`
   pairs in the background and reads that node over TCP until the pair is ready.
   The pair is cached per (node, epoch) and reused.
2. ``CHANNEL_GET {session, keys}``: the node answers, over TCP, which keys it found
   with their sizes and checksums, and sends their bytes over the communicator in
   one group, in key order.
3. The client receives the group into its staging buffer (GPU memory for NCCL), copies
   each chunk into the sink's buffer (LMCache's memory object) and verifies its
   checksum: a wrong byte is never returned.

Node side (:class:`ChannelServer`): joins offers meant for it and sends.

Every step is bounded; on any failure the pair is dropped, and the error
(:class:`NcclError`, or the control path's ``KVPoolError``) reaches the caller, which
falls back to TCP and reads that node over TCP for a back-off period. Pairs are
serialised: one transfer at a time per pair. A pair's link is aborted in a worker
thread, and only once no transfer thread uses it (NCCL forbids concurrent calls on
one communicator): tearing down never blocks the event loop.

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
TEARDOWN_TIMEOUT_S = 10.0  # bound on an abort or a unique id, each run in a worker thread
BACKOFF_S = 30.0  # after a channel failure, the client reads that node over TCP this long
PAIR_TIMEOUT_S = 30.0  # deadline of one pairing (both joins); a cold NCCL init can take several seconds
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


# -- CPU transport ------------------------------------------------------------------------
class CpuLink:
    """A pair over one TCP socket: a batch is a small header and the concatenated bytes."""

    def __init__(self, sock: socket.socket, progress: Callable[[int], None] | None = None) -> None:
        self.sock = sock
        self.progress = progress
        self.broken = False
        self._staging = torch.empty(0, dtype=torch.uint8)
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "(a peer already gone)"

    def _deadline_io(self, deadline: float, what: str, timeout_s: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NcclError(f"CPU channel {what} {self.peer} timed out after {timeout_s:.1f} s")
        self.sock.settimeout(remaining)

    def send(self, buffers: Sequence[Buffer], timeout_s: float) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        deadline = time.monotonic() + timeout_s
        try:
            self._deadline_io(deadline, "send to", timeout_s)
            self.sock.sendall(_BATCH_HEAD.pack(len(views), sum(len(v) for v in views)))
            for view in views:
                self._deadline_io(deadline, "send to", timeout_s)
                self.sock.sendall(view)
        except NcclError:
            self.abort()
            raise
        except TimeoutError:  # socket.timeout
            self.abort()
            raise NcclError(f"CPU channel send to {self.peer} timed out after {timeout_s:.1f} s") from None
        except OSError as exc:
            self.abort()
            raise NcclError(f"send failed: {exc or 'timed out'}") from None

    def recv(self, sizes: Sequence[int], timeout_s: float) -> list[torch.Tensor]:
        total = sum(sizes)
        deadline = time.monotonic() + timeout_s
        head = bytearray(_BATCH_HEAD.size)
        try:
            self._recv_exact(memoryview(head), deadline, timeout_s)
            count, declared = _BATCH_HEAD.unpack(head)
            if (count, declared) != (len(sizes), total):
                raise NcclError(f"peer sent {count} items / {declared} bytes, expected {len(sizes)} / {total}")
            if self._staging.numel() < total:
                self._staging = torch.empty(total, dtype=torch.uint8)
            staging = memoryview(self._staging.numpy()).cast("B")
            views, offset = [], 0
            for index, size in enumerate(sizes):
                self._recv_exact(staging[offset : offset + size], deadline, timeout_s)
                views.append(self._staging[offset : offset + size])
                offset += size
                if self.progress is not None:
                    self.progress(index)
        except NcclError:
            self.abort()
            raise
        except TimeoutError:  # socket.timeout
            self.abort()
            raise NcclError(f"CPU channel receive from {self.peer} timed out after {timeout_s:.1f} s") from None
        except OSError as exc:
            self.abort()
            raise NcclError(f"receive failed: {exc or 'timed out'}") from None
        except RuntimeError as exc:  # torch.OutOfMemoryError for the staging buffer is one
            self.abort()
            raise NcclError(f"staging {total} bytes failed: {exc}") from None
        return views

    def _recv_exact(self, view: memoryview, deadline: float, timeout_s: float) -> None:
        while view:
            self._deadline_io(deadline, "receive from", timeout_s)
            n = self.sock.recv_into(view)
            if n == 0:
                raise NcclError("the peer closed the channel mid-transfer")
            view = view[n:]

    def cancel(self) -> None:
        with contextlib.suppress(OSError):  # wakes a blocked send or recv; the socket stays open
            self.sock.shutdown(socket.SHUT_RDWR)

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
            return self._accept(listener, secret, deadline, timeout_s)
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

    def _accept(self, listener: socket.socket, secret: bytes, deadline: float, timeout_s: float) -> CpuLink:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NcclError(f"the peer did not join the CPU pair at {listener.getsockname()[:2]} "
                                f"within {timeout_s:.1f} s")  # fmt: skip
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
        try:
            staging = self._stage(sum(len(v) for v in views))
            slices, offset = [], 0
            for view in views:
                if len(view):
                    part = staging[offset : offset + len(view)]
                    part.copy_(torch.frombuffer(view, dtype=torch.uint8))
                    slices.append(part)
                offset += len(view)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one: the caller falls back to TCP
            self.comm.abort()
            raise NcclError(f"staging a batch on {self.comm.device} failed: {exc}") from None
        self.comm.send(slices, timeout_s)

    def recv(self, sizes: Sequence[int], timeout_s: float) -> list[torch.Tensor]:
        try:
            staging = self._stage(sum(sizes))
        except RuntimeError as exc:  # torch.OutOfMemoryError is one: the caller falls back to TCP
            self.comm.abort()
            raise NcclError(f"staging {sum(sizes)} bytes on {self.comm.device} failed: {exc}") from None
        views, offset = [], 0
        for size in sizes:
            views.append(staging[offset : offset + size])
            offset += size
        self.comm.recv([v for v in views if v.numel()], timeout_s)
        return views

    def cancel(self) -> None:
        self.comm.abort_requested = True  # the transfer thread's polling loop stops and aborts

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
        count = torch.cuda.device_count()
        try:
            target = torch.device(device)
        except RuntimeError:
            target = torch.device("cpu")
        if target.type != "cuda" or (target.index or 0) >= count:
            raise NcclError(f"device {device!r} is not a visible CUDA device (this process sees {count})")
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
    transfer: asyncio.Future[Any] | None = None  # the worker thread's send or recv, while one runs
    retired: bool = False


class _PairCache:
    """Pairs by key, least recently used first, shared by both ends of the channel.

    Retiring a pair removes it at once; its link is aborted in a worker thread once
    the pair's transfer thread (if any) has returned, so a communicator never sees
    two calls at a time and the event loop never waits on NCCL.
    """

    def __init__(self, max_pairs: int) -> None:
        self.max_pairs = max_pairs
        self._pairs: OrderedDict[Any, _Pair] = OrderedDict()
        self._teardowns: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._pairs)

    def live(self, key: Any) -> _Pair | None:
        """The pair of ``key`` if it exists and is not broken (marked most recently used)."""
        pair = self._pairs.get(key)
        if pair is None or pair.link.broken:
            return None
        self._pairs.move_to_end(key)
        return pair

    def add(self, key: Any, pair: _Pair) -> None:
        """Keep ``pair``; past ``max_pairs``, retire the least recently used pairs no transfer holds."""
        old = self._pairs.get(key)
        if old is not None:
            self.retire(key, old)
        self._pairs[key] = pair
        idle = [k for k, p in self._pairs.items() if not p.lock.locked() and p is not pair]
        for k in idle[: len(self._pairs) - self.max_pairs]:
            self.retire(k, self._pairs[k])

    def retire(self, key: Any, pair: _Pair) -> None:
        """Drop ``pair`` now; abort its link off the event loop once its transfer thread returned."""
        if self._pairs.get(key) is pair:
            del self._pairs[key]
        if pair.retired:
            return
        pair.retired = True
        if pair.transfer is not None and not pair.transfer.done():
            pair.link.cancel()
        task = asyncio.ensure_future(_abort_after(pair.link, pair.transfer))
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    async def close(self) -> None:
        """Retire every pair and wait (bounded) for their aborts."""
        for key, pair in list(self._pairs.items()):
            self.retire(key, pair)
        if self._teardowns:
            await asyncio.wait(list(self._teardowns), timeout=2 * TEARDOWN_TIMEOUT_S)


async def _abort_after(link: Link, transfer: asyncio.Future[Any] | None) -> None:
    if transfer is not None:
        await asyncio.wait([transfer])  # bounded: the thread's own transfer timeout; cancel() shortens it
        if not transfer.cancelled():
            transfer.exception()  # already reported by the transfer's caller
    try:
        await _in_thread(link.abort, "aborting a pair")
    except NcclError as exc:
        logger.warning("channel: %s", exc)


async def _in_thread(call: Callable[[], T], what: str) -> T:
    """Run a blocking NCCL call in a worker thread, bounded by TEARDOWN_TIMEOUT_S."""
    try:
        async with asyncio.timeout(TEARDOWN_TIMEOUT_S):
            return await asyncio.to_thread(call)
    except TimeoutError:
        raise NcclError(f"{what} timed out after {TEARDOWN_TIMEOUT_S:.0f} s (left to its thread)") from None


class NcclChannel:
    """The client end: pairs with nodes lazily, receives chunks over them.

    ``request(node, meta)`` sends one CHANNEL_GET over the node's TCP protocol and
    returns the response meta (``PoolClient.channel_request``).
    """

    def __init__(self, transport: Transport, rendezvous: Rendezvous, endpoint_id: str, cluster: str,
                 request: Request, timeout_s: float, max_pairs: int = MAX_PAIRS,
                 backoff_s: float = BACKOFF_S, pair_timeout_s: float = PAIR_TIMEOUT_S) -> None:  # fmt: skip
        self.transport = transport
        self.rendezvous = rendezvous
        self.endpoint_id = endpoint_id
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.pair_timeout_s = pair_timeout_s
        self.counters: Counter[str] = Counter()
        self._request = request
        self._pairs = _PairCache(max_pairs)
        self._creating: dict[tuple[str, int], asyncio.Lock] = {}
        self._pairing: dict[tuple[str, int], asyncio.Task[None]] = {}  # background pairings under way
        self._backoff_until: dict[str, float] = {}  # node id -> monotonic time the channel may try it again
        self._closed = False

    @property
    def kind(self) -> str:
        return self.transport.kind

    def serves(self, node: Any) -> bool:
        """Whether ``node`` is reachable over this channel: same cluster, same transport, not backing off."""
        return (
            bool(self.cluster)
            and node.cluster == self.cluster
            and getattr(node, "channel", "") == self.kind
            and time.monotonic() >= self._backoff_until.get(node.node_id, 0.0)
        )

    def engaged(self, node: Any) -> bool:
        """Whether to read ``node`` over the channel now: it is served and its pair is ready.

        A served node without a pair starts pairing in the background (bounded by
        ``pair_timeout_s``) and answers False, so reads go over TCP until the pair is
        ready instead of waiting for a cold NCCL init. Call it on the event loop.
        """
        if not self.serves(node):
            return False
        ident = (node.node_id, node.epoch)
        if self._pairs.live(ident) is not None:
            return True
        if ident not in self._pairing and not self._closed:
            task = asyncio.ensure_future(self._pair_in_background(node))
            self._pairing[ident] = task
            task.add_done_callback(lambda _: self._pairing.pop(ident, None))
        return False

    async def _pair_in_background(self, node: Peer) -> None:
        try:
            await self._pair(node)
        except Exception as exc:  # NcclError, the control path's KVPoolError, or a transport's own bug
            self.counters["pair_failures"] += 1
            self._back_off(node)
            logger.warning("channel: pairing with node %s failed; reading it over TCP: %s", node.node_id, exc)

    def pair_count(self) -> int:
        return len(self._pairs)

    async def _pair(self, node: Peer) -> _Pair:
        ident = (node.node_id, node.epoch)
        pair = self._pairs.live(ident)
        if pair is not None:
            return pair
        async with self._creating.setdefault(ident, asyncio.Lock()):
            pair = self._pairs.live(ident)
            if pair is not None:
                return pair
            link, session = await self._connect(node)
            pair = _Pair(session, link)
            self._pairs.add(ident, pair)
            self.counters["pairs_created"] += 1
            return pair

    async def _connect(self, node: Peer) -> tuple[Link, str]:
        if self._closed:
            raise NcclError("the channel is closed")
        session = new_session()
        unique_id, state = await _in_thread(self.transport.prepare, "making a unique id")  # NCCL's first takes s
        try:
            offer = Offer(session, self.transport.kind, unique_id, self.endpoint_id, node.node_id, self.cluster)
            await self.rendezvous.publish(offer)
            joining = asyncio.ensure_future(
                asyncio.to_thread(self.transport.join, unique_id, 0, state, self.pair_timeout_s)
            )
            try:
                # Answered as soon as the node took the offer; its join runs on in the background.
                await self._request(node, encode_channel_request(session, []))
            except BaseException:
                self.transport.discard(state)  # a CPU accept fails at once instead of at its deadline
                joining.add_done_callback(_abort_joined)
                raise
            try:
                link = await asyncio.shield(joining)  # bounded by the transport's own deadline: pair_timeout_s
            except BaseException:
                joining.add_done_callback(_abort_joined)  # cancelled: a link that still lands is aborted
                raise
        finally:
            self.transport.discard(state)
        logger.info("channel: paired with node %s over %s (session %s)", node.node_id, self.kind, session)
        return link, session

    async def get(self, node: Peer, keys: Sequence[str], sink: Sink[Any]) -> list[Any]:
        """Fetch ``keys`` from ``node`` over the channel into ``sink`` buffers.

        Per key: the sink's handle, None (the node does not hold it, or the sink had
        no room), or an ``IntegrityError``. Raises NcclError / KVPoolError when the
        pair or the node failed; the pair is then aborted and dropped.
        """
        if not keys:
            return []
        try:
            pair = await self._pair(node)
        except Exception:
            self._back_off(node)
            raise
        async with pair.lock:
            try:
                reply = await self._request(node, encode_channel_request(pair.session, keys))
                found = decode_channel_response(reply, keys)
                items = [item for item in found if item is not None]
                total = sum(item.nbytes for item in items)
                staged: list[torch.Tensor] = []
                if items:
                    timeout_s = transfer_timeout(self.timeout_s, total)
                    pair.transfer = asyncio.ensure_future(
                        asyncio.to_thread(pair.link.recv, [i.nbytes for i in items], timeout_s)
                    )
                    # Shielded: cancelling this call must not leave the thread running unnoticed;
                    # retire() below aborts the link only after the thread has returned.
                    staged = await asyncio.shield(pair.transfer)
            except BaseException as exc:
                self._pairs.retire((node.node_id, node.epoch), pair)
                self.counters["pair_failures"] += 1
                if isinstance(exc, Exception):
                    self._back_off(node)
                raise
            finally:
                pair.transfer = None
            self.counters["bytes"] += total
            return await self._deliver(found, staged, sink)

    def _back_off(self, node: Peer) -> None:
        """Read ``node`` over TCP for ``backoff_s``: a failing node should not cost a timeout per batch."""
        self._backoff_until[node.node_id] = time.monotonic() + self.backoff_s
        logger.info("channel: node %s read over TCP for %.0f s after a channel failure", node.node_id, self.backoff_s)

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
        """Abort every pair (never destroy: a gone peer would hang it); bounded."""
        self._closed = True
        for task in list(self._pairing.values()):
            task.cancel()
        await asyncio.gather(*self._pairing.values(), return_exceptions=True)
        await self._pairs.close()


def _abort_joined(joining: asyncio.Future[Link]) -> None:
    """Abort a link whose join finished after its pairing was given up (never leave it open)."""
    if joining.cancelled() or joining.exception() is not None:
        return
    link = joining.result()
    asyncio.get_running_loop().run_in_executor(None, link.abort)


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
                 max_pairs: int = MAX_PAIRS, pair_timeout_s: float = PAIR_TIMEOUT_S) -> None:  # fmt: skip
        self.transport = transport
        self.rendezvous = rendezvous
        self.node_id = node_id
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.pair_timeout_s = pair_timeout_s
        self.counters: Counter[str] = Counter()
        self._pairs = _PairCache(max_pairs)
        self._joins: dict[str, asyncio.Task[None]] = {}  # session -> its join, while under way

    @property
    def kind(self) -> str:
        return self.transport.kind

    async def start_join(self, session: str) -> None:
        """Take the offer of ``session`` and join its pair in the background; NcclError if there is no offer.

        Returns once the offer is taken, so the pairing request is answered at once: the
        join itself (a cold NCCL init takes seconds) is bounded by ``pair_timeout_s``,
        not by any request's timeout.
        """
        if self._pairs.live(session) is not None or session in self._joins:
            return
        offer = await self.rendezvous.take(session, target=self.node_id, cluster=self.cluster, transport=self.kind)
        if session in self._joins:  # a concurrent request for the same session took it first
            return
        task = asyncio.ensure_future(self._join(session, offer))
        self._joins[session] = task
        task.add_done_callback(lambda done: self._joined(session, done))

    def _joined(self, session: str, task: asyncio.Task[None]) -> None:
        self._joins.pop(session, None)
        if not task.cancelled():
            task.exception()  # logged by _join; a request waiting on it gets it too

    async def _join(self, session: str, offer: Offer) -> None:
        joining = asyncio.ensure_future(
            asyncio.to_thread(self.transport.join, offer.unique_id, 1, None, self.pair_timeout_s)
        )
        try:
            link = await asyncio.shield(joining)
        except asyncio.CancelledError:
            joining.add_done_callback(_abort_joined)  # the node is stopping: a link that still lands is aborted
            raise
        except Exception as exc:
            self.counters["channel_errors"] += 1
            logger.warning("channel: node %s could not pair with %s: %s", self.node_id, offer.initiator, exc)
            raise
        self._pairs.add(session, _Pair(session, link))
        self.counters["channel_pairs"] += 1
        logger.info("channel: node %s paired with %s over %s", self.node_id, offer.initiator, self.kind)

    async def join(self, session: str) -> None:
        """Make sure the pair of ``session`` exists: wait for its join, starting it if needed. NcclError on failure."""
        if self._pairs.live(session) is not None:
            return
        if session not in self._joins:
            await self.start_join(session)
        task = self._joins.get(session)
        if task is not None:
            await asyncio.shield(task)
        if self._pairs.live(session) is None:
            raise NcclError(f"session {session} has no pair on node {self.node_id} (its join failed)")

    async def send(self, session: str, buffers: Sequence[Buffer]) -> None:
        """Send ``buffers`` as one batch over the pair of ``session``; a failure drops the pair."""
        pair = self._pairs.live(session)
        if pair is None:
            self.counters["channel_errors"] += 1
            logger.warning("channel: node %s has no pair for session %s; nothing sent", self.node_id, session)
            return
        nbytes = sum(len(memoryview(b).cast("B")) for b in buffers)
        async with pair.lock:
            pair.transfer = asyncio.ensure_future(
                asyncio.to_thread(pair.link.send, buffers, transfer_timeout(self.timeout_s, nbytes))
            )
            try:
                await asyncio.shield(pair.transfer)
            except Exception as exc:  # NcclError, or anything else a link let through: never reuse the pair
                self.counters["channel_errors"] += 1
                self._pairs.retire(session, pair)
                logger.warning("channel: send to session %s failed, pair dropped: %s", session, exc)
                return
            except BaseException:
                self._pairs.retire(session, pair)  # cancelled (node stopping): aborted once the thread returns
                raise
            finally:
                pair.transfer = None
        self.counters["channel_bytes"] += nbytes

    async def close(self) -> None:
        """Abort every pair (never destroy: a gone peer would hang it); bounded."""
        for task in list(self._joins.values()):
            task.cancel()
        await asyncio.gather(*self._joins.values(), return_exceptions=True)
        await self._pairs.close()
