"""vLLM's KV event wire, as vLLM's releases write it (``vllm/distributed/kv_events.py`` of each wheel).

A message is three ZMQ frames: topic, an 8-byte big-endian sequence number, and a msgpack
``KVEventBatch``. The batch is an array ``[ts, events, data_parallel_rank]`` in every release;
its events changed, and so did the frames of a replay. One form per layout, named for the
release its bytes were checked against (docs/versions.md):

- ``vllm-0.33`` (the default; vLLM 0.26.0 to 0.34.0, the newest checked): each event a tagged
  map (``{"type": "BlockStored", ...}``) of 0.33's fields; a replayed batch carries its topic;
- ``vllm-0.25`` (vLLM 0.24.0 to 0.25.1): tagged maps of those releases' fields; no topic in a replay;
- ``vllm-0.23`` (vLLM 0.22.0 to 0.23.0): arrays all the way down (``["BlockStored", ...]``); no topic in
  a replay. Earlier releases' events have fewer fields (no ``kv_cache_spec_kind``): no form writes them.

A form writes its release's bytes for the same values (tests/data/vllm_events holds each
release's own): msgspec writes a struct by its declaration (a map header's width follows the
number of fields, an array keeps its trailing defaults), so each form has structs with exactly
its release's fields. The pool builds the newest structs (``BlockStored`` ...); an older form
leaves out the fields its release lacks, none of which the pool sets.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "DEFAULT_FORM",
    "WIRE_FORMS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "END_SEQ",
    "KVEventBatch",
    "Wire",
    "WireForm",
    "seq_bytes",
    "wire_form",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame, as vLLM ends one


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


# The newest release's structs (vLLM 0.33.0, the same in 0.34.0): what the pool builds.
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
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# vLLM 0.22.0 to 0.25.1: the fields before 0.26's locality.
class _BlockStored025(_Event, tag="BlockStored"):
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


class _BlockRemoved025(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _Batch025(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_BlockStored025 | _BlockRemoved025 | AllBlocksCleared]
    data_parallel_rank: int | None = None


# vLLM 0.23.0 and before: the same fields, each event an array too.
class _BlockStored023(_BlockStored025, array_like=True, tag="BlockStored"):
    pass


class _BlockRemoved023(_BlockRemoved025, array_like=True, tag="BlockRemoved"):
    pass


class _AllBlocksCleared023(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _Batch023(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_BlockStored023 | _BlockRemoved023 | _AllBlocksCleared023]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class WireForm:
    """One release's layout: its batch struct, its event structs (in the order of ``Event``), its replay frames."""

    name: str
    releases: str
    batch: type[msgspec.Struct]
    events: tuple[type[msgspec.Struct], type[msgspec.Struct], type[msgspec.Struct]]
    replay_topic: bool  # a replayed batch is (topic, seq, payload), as vLLM 0.26.0 and later send it


_NEWEST = (BlockStored, BlockRemoved, AllBlocksCleared)
WIRE_FORMS: dict[str, WireForm] = {
    form.name: form
    for form in (
        WireForm("vllm-0.33", "vLLM 0.26.0 to 0.34.0, the newest checked", KVEventBatch, _NEWEST, True),
        WireForm(
            "vllm-0.25",
            "vLLM 0.24.0 to 0.25.1",
            _Batch025,
            (_BlockStored025, _BlockRemoved025, AllBlocksCleared),
            False,
        ),
        WireForm(
            "vllm-0.23",
            "vLLM 0.22.0 to 0.23.0",
            _Batch023,
            (_BlockStored023, _BlockRemoved023, _AllBlocksCleared023),
            False,
        ),
    )
}
DEFAULT_FORM = "vllm-0.33"
_RENAMED = {"map": "vllm-0.33", "array": "vllm-0.23"}  # the names the forms had before they were named by release


def wire_form(name: str) -> WireForm:
    """The form called ``name``; a ``ValueError`` saying which form was meant otherwise."""
    form = WIRE_FORMS.get(name)
    if form is not None:
        return form
    meant = _RENAMED.get(name) or next(iter(difflib.get_close_matches(name, WIRE_FORMS, n=1)), None)
    hint = f"did you mean {meant}? " if meant else ""
    forms = ", ".join(f"{f.name} ({f.releases})" for f in WIRE_FORMS.values())
    raise ValueError(f"{name!r} is not a form: {hint}the forms, by the vLLM releases that read them: {forms}")


class Wire:
    """Encodes batches in one form and decodes them (a consumer's round trip; the replay of a snapshot), and
    frames a replay as that form's releases do."""

    def __init__(self, form: str = DEFAULT_FORM) -> None:
        self.form = wire_form(form)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(self.form.batch)
        self._to_form = dict(zip(_NEWEST, self.form.events, strict=True))
        self._from_form = dict(zip(self.form.events, _NEWEST, strict=True))

    def encode(self, batch: KVEventBatch) -> bytes:
        if self.form.batch is KVEventBatch:
            return self._encoder.encode(batch)
        events = [_convert(e, self._to_form[type(e)]) for e in batch.events]
        return self._encoder.encode(self.form.batch(batch.ts, events, batch.data_parallel_rank))  # type: ignore[call-arg]

    def decode(self, payload: bytes) -> KVEventBatch:
        batch = self._decoder.decode(payload)
        if self.form.batch is KVEventBatch:
            return batch  # type: ignore[no-any-return]
        events: list[Event] = [_convert(e, self._from_form[type(e)]) for e in batch.events]
        return KVEventBatch(batch.ts, events, batch.data_parallel_rank)

    def replay_frames(self, topic: bytes, seq: int, payload: bytes) -> tuple[bytes, ...]:
        """A replayed batch's frames after the ROUTER's (client id, empty)."""
        return (topic, seq_bytes(seq), payload) if self.form.replay_topic else (seq_bytes(seq), payload)

    def replay_end(self) -> tuple[bytes, ...]:
        """A replay's last frames after the ROUTER's (client id, empty)."""
        return (b"", END_SEQ, b"") if self.form.replay_topic else (END_SEQ, b"")


def _convert(event: Any, to: type[Any]) -> Any:
    """``event`` as the struct ``to`` of the same event: the fields both have (the rest keep their defaults)."""
    fields = set(to.__struct_fields__)
    return to(**{name: getattr(event, name) for name in event.__struct_fields__ if name in fields})
