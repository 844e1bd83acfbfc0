"""A consumer of vLLM's KV events, written from vLLM's published format and publisher (``vllm/distributed/kv_events.py``).

Independent of ``backend/events``: its own msgspec structs, a SUB socket for the stream and a
DEALER for replays (each with or without CURVE keys), and a mirror that rebuilds the set of
blocks held from the stream, as a router's index would. The conventions are vLLM's
``ZmqEventPublisher``'s: stream frames (topic, 8-byte big-endian sequence, payload); a replay is
asked with the start sequence as 8 bytes and answered batch by batch, ended by the sequence -1.

Two layouts: the batch an array and each event a tagged map (vLLM 0.24.0 and later), or arrays
all the way down (``array=True``: vLLM 0.23.0 and before). Replayed frames carry the topic from
vLLM 0.26.0 on (``replay_topic``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import zmq
import zmq.asyncio

END = -1


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


MAP_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ARRAY_DECODER = msgspec.msgpack.Decoder(ArrayKVEventBatch)


class Mirror:
    """The blocks a stream says are held: what a router would index."""

    def __init__(self) -> None:
        self.blocks: set[bytes | int] = set()
        self.last_seq = END
        self.stored_events: list[BlockStored] = []
        self.removed: list[list[bytes | int]] = []  # each BlockRemoved's hashes, in order

    def apply(self, batch: KVEventBatch | ArrayKVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks.update(event.block_hashes)
                self.stored_events.append(event)
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
                self.removed.append(list(event.block_hashes))
            else:
                self.blocks.clear()


class Subscriber:
    """A SUB socket on the endpoint (and a DEALER for replays), with or without the pool's CURVE keys."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        publish: str,
        replay: str | None,
        topic: bytes,
        keys: tuple[bytes, bytes, bytes] | None,  # (server public, client public, client secret)
        array: bool = False,
        replay_topic: bool | None = None,  # default: as the releases of the layout (not array) send them
    ) -> None:
        self.decoder = ARRAY_DECODER if array else MAP_DECODER
        self.replay_topic = not array if replay_topic is None else replay_topic
        self.topic = topic
        self.mirror = Mirror()
        self.seqs: list[int] = []
        self.sub = self._socket(ctx, zmq.SUB, keys)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(publish)
        self.replay_socket = None
        if replay is not None:
            self.replay_socket = self._socket(ctx, zmq.DEALER, keys)
            self.replay_socket.connect(replay)
        self.pending: list[tuple[int, Any]] = []  # stream messages received before a replay's end

    @staticmethod
    def _socket(ctx: zmq.asyncio.Context, kind: int, keys: tuple[bytes, bytes, bytes] | None) -> zmq.asyncio.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
        return sock

    async def drain(self, timeout_s: float = 0.05) -> int:
        """Apply every stream message that arrives within ``timeout_s`` of the last; how many."""
        count = 0
        while await self.sub.poll(int(timeout_s * 1000)):
            _topic, seq, payload = await self.sub.recv_multipart()
            number = int.from_bytes(seq, "big")
            if number <= self.mirror.last_seq:
                continue  # replayed already
            self.seqs.append(number)
            self.mirror.apply(self.decoder.decode(payload))
            self.mirror.last_seq = number
            count += 1
        return count

    async def replay(self, start: int, timeout_s: float = 5.0) -> list[int]:
        """Ask for batches from ``start``; apply what comes back (a snapshot or kept batches); their sequences."""
        assert self.replay_socket is not None
        await self.replay_socket.send_multipart((b"", start.to_bytes(8, "big")))
        got: list[int] = []
        while True:
            frames = await asyncio.wait_for(self.replay_socket.recv_multipart(), timeout_s)
            if self.replay_topic:
                _, topic, seq, payload = frames
                assert topic in (self.topic, b""), f"a replayed batch of topic {topic!r}"  # b"": the end
            else:
                _, seq, payload = frames
            number = int.from_bytes(seq, "big", signed=True)
            if number == END:
                return got
            got.append(number)
            self.mirror.apply(self.decoder.decode(payload))
            self.mirror.last_seq = number

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay_socket is not None:
            self.replay_socket.close(linger=0)
