"""vLLM's KV event wire format (``vllm/distributed/kv_events.py``), written from its published structs.

A message is three ZMQ frames: topic, an 8-byte big-endian sequence number, and a msgpack
``KVEventBatch``: ``{ts, events, data_parallel_rank}``, each event a struct tagged with its
class name. Current vLLM encodes structs as maps (``{"type": "BlockStored", ...}``); releases
before its switch encoded them as arrays (``array_like``: ``["BlockStored", ...]``), which
``form="array"`` keeps for consumers that still read that.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "WIRE_FORMS",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEventBatch",
    "Wire",
    "END_SEQ",
    "seq_bytes",
]

WIRE_FORMS = ("map", "array")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame, as vLLM ends one


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# The older array form: the same fields in the same order, as arrays.
class _BlockStoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _KVEventBatchArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray]
    data_parallel_rank: int | None = None


_ARRAY_OF: dict[type, type] = {
    BlockStored: _BlockStoredArray,
    BlockRemoved: _BlockRemovedArray,
    AllBlocksCleared: _AllBlocksClearedArray,
}


class Wire:
    """Encodes batches in one form, and decodes them (a test's round trip; the replay of a snapshot)."""

    def __init__(self, form: Literal["map", "array"] = "map") -> None:
        if form not in WIRE_FORMS:
            raise ValueError(f"wire form {form!r} is not one of {', '.join(WIRE_FORMS)}")
        self.form = form
        self._encoder = msgspec.msgpack.Encoder()
        batch_type = KVEventBatch if form == "map" else _KVEventBatchArray
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(batch_type)

    def encode(self, batch: KVEventBatch) -> bytes:
        if self.form == "map":
            return self._encoder.encode(batch)
        events = [_ARRAY_OF[type(e)](**msgspec.structs.asdict(e)) for e in batch.events]
        return self._encoder.encode(_KVEventBatchArray(batch.ts, events, batch.data_parallel_rank))

    def decode(self, payload: bytes) -> KVEventBatch:
        batch = self._decoder.decode(payload)
        if self.form == "map":
            return batch  # type: ignore[no-any-return]
        events: list[Event] = [
            next(base for base, arr in _ARRAY_OF.items() if isinstance(e, arr))(**msgspec.structs.asdict(e))
            for e in batch.events
        ]
        return KVEventBatch(batch.ts, events, batch.data_parallel_rank)
