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
3. The client receives the batch chunk after chunk (for NCCL through a ring of GPU
   staging slots, ``nccl_channel.pipeline``) straight into the sink's buffers (LMCache's
   memory objects) and verifies each chunk's checksum as it lands: a wrong byte is
   never returned. Each key comes back typed (``nccl_channel.outcome``): landed, or
   not brought and why.

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

The parts, one module each: ``link`` (the transport contract), ``transport_cpu``,
``transport_nccl``, ``pairs`` (the pair cache both ends share), ``client``, ``node``,
``outcome`` (what a get returns per key). ``PoolClient`` builds the client end from its
config (``backend.client.channel.open_channel``); the node builds its server.
This module picks a transport by name and keeps every name importable from here.
"""

from __future__ import annotations

from backend.errors import NcclError
from nccl_channel.client import BACKOFF_S as BACKOFF_S
from nccl_channel.client import NcclChannel
from nccl_channel.link import MIN_TRANSFER_BYTES_PER_S as MIN_TRANSFER_BYTES_PER_S
from nccl_channel.link import Buffer as Buffer
from nccl_channel.link import Link, Transport, transfer_timeout
from nccl_channel.node import ChannelServer
from nccl_channel.pairs import MAX_PAIRS as MAX_PAIRS
from nccl_channel.pairs import PAIR_TIMEOUT_S as PAIR_TIMEOUT_S
from nccl_channel.pairs import TEARDOWN_TIMEOUT_S as TEARDOWN_TIMEOUT_S
from nccl_channel.pairs import Peer as Peer
from nccl_channel.pairs import Sink as Sink
from nccl_channel.transport_cpu import CpuLink as CpuLink
from nccl_channel.transport_cpu import CpuTransport
from nccl_channel.transport_nccl import NcclLink as NcclLink
from nccl_channel.transport_nccl import NcclTransport

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


def make_transport(kind: str, device: str | None = None) -> Transport:
    """The transport named ``kind`` ("nccl" or "cpu"); NcclError if it cannot run here.

    ``device``: the CUDA device of an NCCL transport; None is this process's current one (an engine's).
    """
    if kind == "cpu":
        return CpuTransport()
    if kind == "nccl":
        from nccl_channel import available

        status = available()
        if not status.ok:
            raise NcclError(f"the NCCL channel cannot run here: {status.reason}")
        import torch

        count = torch.cuda.device_count()
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}"
        try:
            target = torch.device(device)
        except RuntimeError:
            target = torch.device("cpu")
        if target.type != "cuda" or (target.index or 0) >= count:
            raise NcclError(f"device {device!r} is not a visible CUDA device (this process sees {count})")
        return NcclTransport(device)
    raise NcclError(f"unknown channel transport {kind!r}; known: nccl, cpu")
