"""LMCache memory objects as pool chunks and back, one rule for both modes.

A memory object of one shape group is stored with its layout (dtype, shape, memory
format), so any reader can rebuild it. An object of several groups (a hybrid model:
e.g. full-attention and sliding-window layers, or an MLA cache beside its index) is
stored as its bytes, ``uint8`` of shape ``[nbytes]``, with its memory format: the
protocol's one dtype and shape per chunk cannot describe several groups, and LMCache's
own connectors do the same when they save no chunk meta. Reading back:

- the L2 adapter (multiprocess mode) receives into the memory object LMCache hands
  it, whose groups LMCache already knows; a size that differs is a miss;
- the in-process connector allocates a memory object of the engine's own groups
  (``RemoteConnector.meta_shapes``/``meta_dtypes``, from LMCache's metadata) for as
  many tokens as the bytes hold, as LMCache does for a chunk it reads without meta;
  bytes that are not a whole number of the engine's tokens are a miss.

In-process keys carry the model, world size, worker id and dtype, but not the rest of the
layout (KV shape, chunk size, MLA, KV-cache groups): the connector stores each chunk with
its engine's layout fingerprint (``backend.lmcache.layout``), and its sink reads only chunks
of that fingerprint, so an engine never rebuilds another layout's bytes as its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from backend.client import Chunk
from backend.counters import MissCause
from backend.errors import KVPoolError
from backend.lmcache.boundary import MissBoundary
from backend.lmcache.layout import EngineFingerprint
from backend.protocol import ItemMeta
from backend.protocol.meta import NO_FINGERPRINT
from backend.protocol.tokens import ChunkTokens

__all__ = ["LMCacheSink", "to_chunk", "rebuild_layout", "PLAIN_DTYPE"]

PLAIN_DTYPE = "uint8"  # with a one-dimensional shape: bytes whose groups the reader knows
ALLOCATE_TIMEOUT_S = 1.0  # LMCache's allocator blocks while its buffer is full: bound it
ALLOCATE_RETRY_S = 0.002
TOKEN_DIM = 2  # LMCache's chunk shapes are [kv, layers, tokens, hidden]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise KVPoolError(f"stored dtype {name!r} is not a torch dtype")
    return dtype


def _groups(obj: MemoryObj) -> tuple[list[torch.Size], list[torch.dtype]]:
    shapes = getattr(obj.meta, "shapes", None) or [obj.get_shape()]
    dtypes = getattr(obj.meta, "dtypes", None) or [obj.get_dtype()]
    return list(shapes), list(dtypes)


def to_chunk(key: str, obj: MemoryObj, fingerprint: int = NO_FINGERPRINT, tokens: ChunkTokens | None = None) -> Chunk:
    """The pool chunk of a memory object: its bytes, with its layout when it has one shape group, stored with
    the writer's layout ``fingerprint``, and its ``tokens`` for the nodes' event rings (None: none)."""
    data = memoryview(obj.byte_array).cast("B")
    fmt = int(obj.get_memory_format().value)
    shapes, dtypes = _groups(obj)
    if len(shapes) == 1:
        shape = tuple(int(d) for d in shapes[0])
        dtype = dtype_name(dtypes[0])
        return Chunk(key, data, dtype=dtype, shape=shape, fmt=fmt, fingerprint=fingerprint, tokens=tokens)
    return Chunk(key, data, dtype=PLAIN_DTYPE, shape=(len(data),), fmt=fmt, fingerprint=fingerprint, tokens=tokens)


def is_plain(meta: ItemMeta) -> bool:
    """Stored as bytes whose groups the reader knows (see the module docstring)."""
    return meta.dtype == PLAIN_DTYPE and meta.shape == (meta.nbytes,)


def rebuild_layout(
    meta: ItemMeta, engine_shapes: Sequence[torch.Size], engine_dtypes: Sequence[torch.dtype]
) -> tuple[list[torch.Size], list[torch.dtype]]:
    """The groups a stored chunk becomes in this engine: its own layout, or the engine's for plain bytes."""
    if not is_plain(meta):
        return [torch.Size(meta.shape)], [torch_dtype(meta.dtype)]
    token_bytes = sum(s.numel() // s[TOKEN_DIM] * d.itemsize for s, d in zip(engine_shapes, engine_dtypes))
    tokens, left = divmod(meta.nbytes, token_bytes) if token_bytes else (0, meta.nbytes)
    if left or not 0 < tokens <= max((s[TOKEN_DIM] for s in engine_shapes), default=0):
        raise KVPoolError(
            f"{meta.key!r} holds {meta.nbytes} bytes, which is no whole number of tokens "
            f"({token_bytes} bytes each) of this engine's {len(engine_shapes)} groups"
        )
    shapes = [torch.Size([*s[:TOKEN_DIM], tokens, *s[TOKEN_DIM + 1 :]]) for s in engine_shapes]
    return shapes, list(engine_dtypes)


class LMCacheSink:
    """Receives chunks straight into memory objects from LMCache's own allocator (in-process mode), only
    chunks stored with the engine's layout fingerprint (``layout``; None: chunks stored without one)."""

    def __init__(
        self,
        local_cpu_backend: Any,
        engine_shapes: Sequence[torch.Size],
        engine_dtypes: Sequence[torch.dtype],
        misses: MissBoundary,
        layout: EngineFingerprint | None = None,
    ) -> None:
        self.local_cpu_backend = local_cpu_backend
        self.engine_shapes = list(engine_shapes)
        self.engine_dtypes = list(engine_dtypes)
        self.misses = misses
        self.layout = layout

    @property
    def fingerprint(self) -> int:
        """The layout fingerprint a read into this sink asks for (``backend.client.chunks.sink_fingerprint``)."""
        return self.layout.value if self.layout is not None else NO_FINGERPRINT

    async def allocate(self, meta: ItemMeta) -> tuple[MemoryObj, Any] | None:
        """A memory object for the chunk, or None: that key alone reads as a miss.

        Never raises for one chunk's layout: a raise would fail the whole read from
        that node (every key of the batch, and the node read last for a while).
        """
        try:
            shapes, dtypes = rebuild_layout(meta, self.engine_shapes, self.engine_dtypes)
        except KVPoolError as exc:
            self.misses.miss(MissCause.SIZE, "%s; reading as a miss", exc)
            return None
        fmt = MemoryFormat(meta.fmt)
        # One group is passed as LMCache's single shape and dtype, several as its lists.
        shape_arg: Any = shapes[0] if len(shapes) == 1 else shapes
        dtype_arg: Any = dtypes[0] if len(dtypes) == 1 else dtypes
        deadline = time.monotonic() + ALLOCATE_TIMEOUT_S
        while True:
            obj = self.local_cpu_backend.allocate(shape_arg, dtype_arg, fmt, busy_loop=False)
            if obj is not None:
                view = obj.byte_array
                if len(view) != meta.nbytes:
                    obj.ref_count_down()
                    self.misses.miss(
                        MissCause.SIZE,
                        "LMCache allocated %d bytes for %r, which holds %d; reading as a miss",
                        len(view),
                        meta.key,
                        meta.nbytes,
                    )
                    return None
                return obj, view
            if time.monotonic() >= deadline:
                self.misses.miss(
                    MissCause.ALLOCATE,
                    "LMCache's local buffer stayed full for %.1f s; reading as a miss (raise max_local_cpu_size)",
                    ALLOCATE_TIMEOUT_S,
                )
                return None
            await asyncio.sleep(ALLOCATE_RETRY_S)

    def release(self, handle: MemoryObj) -> None:
        handle.ref_count_down()
