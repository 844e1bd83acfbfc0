"""Which router block a pool key stands for.

LMCache's in-process keys are ``MODEL@WORLD_SIZE@WORKER_ID@CHUNK_HASH@DTYPE[@TAG%VALUE...]``
(the chunk hash in hex); its multiprocess keys ``mp:SALT@MODEL@0xKVRANK@GROUP@HASH``
(``backend/lmcache/l2/keys.py``). A block is a model's chunk hash, as an unsigned 64-bit
integer (its low 64 bits): the ranks of one chunk (each worker stores its own key) are one
block to a router. Tags and the salt are the block's extra keys. Keys of any other shape are
not LMCache's and stand for no block.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockRef", "block_of"]

U64 = (1 << 64) - 1


@dataclass(frozen=True)
class BlockRef:
    model: str
    block_hash: int  # u64
    extra: tuple[str, ...] | None  # tags (TAG%VALUE) or the salt; None if there are none


def block_of(key: str) -> BlockRef | None:
    """The block ``key`` stands for; None for a key that is not LMCache's."""
    if key.startswith("mp:"):
        parts = key[3:].split("@")
        if len(parts) != 5 or not parts[2].startswith("0x"):
            return None
        salt, model, _, _, chunk_hash = parts
        extra: tuple[str, ...] | None = (salt,) if salt else None
    else:
        parts = key.split("@")
        if len(parts) < 5:
            return None
        model, chunk_hash = parts[0], parts[3]
        extra = tuple(parts[5:]) or None
    try:
        value = int(chunk_hash, 16)
    except ValueError:
        return None
    return BlockRef(model, value & U64, extra)
