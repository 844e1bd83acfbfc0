"""The KV layout fingerprint of an LMCache engine: only an engine of the same layout reads a chunk back.

LMCache's in-process key (``MODEL@WORLD_SIZE@WORKER_ID@CHUNK_HASH@DTYPE``) leaves out most of
what decides how a chunk's bytes are laid out: two engines that serve the same model name
at the same TP size and dtype, but differ in layers, KV heads or head size (another
revision, a quantised KV cache of the same dtype name), in MLA, in chunk size (a 128-token
prompt is one partial chunk of a 256-token engine and one full chunk of a 128-token engine,
under the same hash) or in KV-cache groups, make the same key for different bytes. The
connector therefore stores, with each chunk, an xxh3-64 of a canonical description of the
engine's layout (:class:`KVLayout`), and reads only chunks stored with its own
(docs/design.md, "layout fingerprint"; docs/protocol.md, "Layout fingerprints").

The canonical form is text, one ``name=value`` line per fact after a version line, so it is
the same in every process, Python version and kvpool release that keeps the version line::

    kvpool-layout/1
    model=Qwen/Qwen3-8B
    world_size=2
    worker_id=0
    kv_dtype=bfloat16
    kv_shape=36,2,256,8,128
    chunk_size=256
    mla=0
    layerwise=0
    groups=bfloat16:2,36,256,1024

``world_size`` is the one LMCache puts in its keys: 1 for an MLA engine that saves only
from its first rank (``save_only_first_rank``, LMCache's default with MLA), whose chunks
LMCache shares across TP sizes. ``groups`` is each KV-cache group's dtype and full-chunk
shape (``LMCacheMetadata.get_dtypes``/``get_shapes``), ``;``-separated: a hybrid model
registers its groups after the connector is built, so the fingerprint is taken per call
until they are known (:class:`EngineFingerprint`).

The multiprocess-mode L2 adapter knows less: no engine metadata or config, only the
``ObjectKey`` (model, packed KV rank, object group, salt, hash) and the memory object it
stores or loads into, whose groups (dtype and shape each) and memory format LMCache's L1
allocated from the layout the engine registered for that object group. Its description
(:class:`ObjectLayout`) is therefore those, under its own version line, so it can never
equal an engine's::

    kvpool-l2-layout/1
    fmt=KV_2LTD
    groups=bfloat16:2,2,16,1024

It leaves out what the key already holds: the pool name of an object key carries its
model, KV rank and object group verbatim (``backend.lmcache.l2.keys``, an injective
mapping), so two adapters that ask for one name agree on them already; and keys of one
layout share one fingerprint, so a load of many ranks and groups is one read per layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import xxhash

from backend.protocol.meta import ANY_FINGERPRINT, NO_FINGERPRINT

__all__ = [
    "KVLayout",
    "CANONICAL_VERSION",
    "L2_CANONICAL_VERSION",
    "fingerprint_of",
    "engine_layout",
    "EngineFingerprint",
    "ObjectLayout",
    "object_layout",
    "object_fingerprint",
]

CANONICAL_VERSION = "kvpool-layout/1"
L2_CANONICAL_VERSION = "kvpool-l2-layout/1"  # the L2 adapter's: another description (module docstring)


def fingerprint_of(canonical: str) -> int:
    """The fingerprint of a canonical description: its xxh3-64, never one of the two reserved values."""
    value = int(xxhash.xxh3_64_intdigest(canonical.encode("utf-8")))
    if value in (NO_FINGERPRINT, ANY_FINGERPRINT):  # 2 of 2**64: kept apart from "none" and "any"
        value = 1
    return value


def _dims(shape: Any) -> str:
    return ",".join(str(int(d)) for d in shape)


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What decides how an engine's KV chunks are laid out (see the module docstring for each field)."""

    model: str
    world_size: int
    worker_id: int
    kv_dtype: str
    kv_shape: tuple[int, ...]
    chunk_size: int
    mla: bool
    layerwise: bool
    groups: tuple[tuple[str, tuple[int, ...]], ...]  # per KV-cache group: dtype, full-chunk shape

    def canonical(self) -> str:
        """The canonical description the fingerprint is taken of."""
        groups = _groups_text(self.groups)
        lines = [
            CANONICAL_VERSION,
            f"model={self.model}",
            f"world_size={self.world_size}",
            f"worker_id={self.worker_id}",
            f"kv_dtype={self.kv_dtype}",
            f"kv_shape={_dims(self.kv_shape)}",
            f"chunk_size={self.chunk_size}",
            f"mla={int(self.mla)}",
            f"layerwise={int(self.layerwise)}",
            f"groups={groups}",
        ]
        return "\n".join(lines) + "\n"

    @property
    def fingerprint(self) -> int:
        return fingerprint_of(self.canonical())


def _groups_text(groups: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
    return ";".join(f"{dtype}:{_dims(shape)}" for dtype, shape in groups)


@dataclasses.dataclass(frozen=True)
class ObjectLayout:
    """How an L2 memory object's bytes are laid out: its memory format, and each group's dtype and shape."""

    fmt: str
    groups: tuple[tuple[str, tuple[int, ...]], ...]

    def canonical(self) -> str:
        """The canonical description the fingerprint is taken of."""
        return f"{L2_CANONICAL_VERSION}\nfmt={self.fmt}\ngroups={_groups_text(self.groups)}\n"

    @property
    def fingerprint(self) -> int:
        return fingerprint_of(self.canonical())


def _object_groups(obj: Any) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
    """An LMCache memory object's format, and its groups' shapes and dtypes (``meta.shapes``/``meta.dtypes``;
    one group: its shape and dtype), as LMCache's own hashable values."""
    shapes = getattr(obj.meta, "shapes", None) or [obj.get_shape()]
    dtypes = getattr(obj.meta, "dtypes", None) or [obj.get_dtype()]
    return obj.get_memory_format(), tuple(shapes), tuple(dtypes)


def _layout_of(fmt: Any, shapes: tuple[Any, ...], dtypes: tuple[Any, ...]) -> ObjectLayout:
    groups = tuple((_dtype(d), tuple(int(x) for x in s)) for s, d in zip(shapes, dtypes, strict=True))
    return ObjectLayout(fmt=str(fmt.name), groups=groups)


def object_layout(obj: Any) -> ObjectLayout:
    """The layout of an LMCache memory object: its memory format by name, and each group's dtype and shape."""
    return _layout_of(*_object_groups(obj))


@functools.lru_cache(maxsize=256)  # an adapter sees a handful of layouts, each in every store and load
def _fingerprint_of_groups(fmt: Any, shapes: tuple[Any, ...], dtypes: tuple[Any, ...]) -> int:
    return _layout_of(fmt, shapes, dtypes).fingerprint


def object_fingerprint(obj: Any) -> int:
    """The layout fingerprint an L2 adapter stores an object with and reads into it with (that of
    :func:`object_layout`, kept per distinct format, shapes and dtypes)."""
    return _fingerprint_of_groups(*_object_groups(obj))


def _config_value(config: Any, name: str, default: Any) -> Any:
    value = getattr(config, name, None) if config is not None else None
    return default if value is None else value


def engine_layout(metadata: Any, config: Any) -> KVLayout:
    """The layout of the engine LMCache describes with ``metadata`` (``LMCacheMetadata``) and ``config``
    (its engine config; None: the metadata's own chunk size, no layerwise, LMCache's MLA default)."""
    mla = bool(getattr(metadata, "use_mla", False))
    save_only_first_rank = mla
    if config is not None and hasattr(config, "get_extra_config_value"):
        save_only_first_rank = bool(config.get_extra_config_value("save_only_first_rank", mla)) and mla
    shapes = metadata.get_shapes()
    dtypes = metadata.get_dtypes()
    return KVLayout(
        model=str(metadata.model_name),
        world_size=1 if save_only_first_rank else int(metadata.world_size),
        worker_id=int(metadata.worker_id),
        kv_dtype=_dtype(metadata.kv_dtype),
        kv_shape=tuple(int(d) for d in metadata.kv_shape),
        chunk_size=int(_config_value(config, "chunk_size", getattr(metadata, "chunk_size", 0))),
        mla=mla,
        layerwise=bool(_config_value(config, "use_layerwise", False)),
        groups=tuple((_dtype(d), tuple(int(x) for x in s)) for s, d in zip(shapes, dtypes)),
    )


class EngineFingerprint:
    """An engine's layout fingerprint, taken again until its KV-cache groups are registered, then kept."""

    def __init__(self, metadata: Any, config: Any) -> None:
        self.metadata = metadata
        self.config = config
        self._kept: int | None = None

    @property
    def value(self) -> int:
        if self._kept is not None:
            return self._kept
        value = engine_layout(self.metadata, self.config).fingerprint
        if getattr(self.metadata, "kv_layer_groups_manager", None) is not None:
            self._kept = value  # registered: the layout no longer changes
        return value
