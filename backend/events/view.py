"""The pool's blocks of one model as the nodes report them, and the events each change makes.

The endpoint speaks for the pool as one pseudo-pod: a block is held while any copy of it is
on any live node (replicas and the ranks of one chunk are one block). A block's first copy
makes a ``BlockStored``, its last copy's removal a ``BlockRemoved``; a node that dies or
restarts takes its copies with it.

A chunk put with its token record (the LMCache connector's ``event_tokens=on``) is announced
with its token ids and its parent chunk's hash, as LMCache's own ``CacheStoreEvent`` says them.
Any other store (one made without an LMCache engine in the process: a ``PoolClient`` put,
LMCache's multiprocess mode) is announced with ``token_ids=[]``: not wrong, but a router that
rebuilds hashes from tokens cannot use it (docs/fleet-events.md, "Pointing a router at kvpool").
With a block size below the chunk size (``BlockShape.block_size`` < ``chunk_size``, LMCache
#3938's split) such a chunk is announced as its ``tokens / block_size`` blocks: the last one's
hash is the chunk's own, the others' are derived from it (:func:`sub_block_hashes`), each
block's parent is the one before it, and the first one's parent is the parent chunk's hash
(the last block of the parent chunk). A chunk without tokens, or whose tokens are not a
multiple of the block size, is announced whole (one block of its tokens, or of ``chunk_size``
without them), counted in ``unsplit``.

Memory: per node, the set of its keys of this model (a reference to the key string the EVENTS
answer carried); per block, one dict entry (hash -> [copies, parent, tokens]): the parent hash
and the chunk's token count, never its token ids (a snapshot announces blocks without them).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from backend.events.keys import BlockRef, block_of
from backend.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from backend.protocol.tokens import ChunkTokens

__all__ = ["BlockShape", "PoolView", "parents_first", "sub_block_hashes"]

_SUB_BLOCK = struct.Struct("<QI")  # chunk hash (u64), block index: what a derived block hash covers
_SUB_BLOCK_LABEL = b"kvpool sub-block|"  # no derived hash is the xxh3 of a chunk's own bytes


def sub_block_hashes(chunk_hash: int, blocks: int) -> list[int]:
    """The hashes of a chunk's ``blocks`` blocks: xxh3-64 of the label, the chunk hash and the index for each
    but the last, which is the chunk's own hash. Stable (a removal and a snapshot name the same hashes), and as
    unique as the chunk hash (which covers every token before and in the chunk)."""
    derived = [xxhash.xxh3_64_intdigest(_SUB_BLOCK_LABEL + _SUB_BLOCK.pack(chunk_hash, j)) for j in range(blocks - 1)]
    return [*derived, chunk_hash]


@dataclass(frozen=True)
class BlockShape:
    """What every ``BlockStored`` says besides its hashes (docs/fleet-events.md says why each value)."""

    block_size: int
    medium: str | None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"
    chunk_size: int = 0  # LMCache's chunk_size; 0: the block size (no split)

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_size or self.block_size

    def blocks(self, tokens: int) -> int:
        """How many blocks announce a chunk of ``tokens`` token ids (0: ids unknown)."""
        if self.chunk_tokens == self.block_size or not tokens or tokens % self.block_size:
            return 1
        return tokens // self.block_size

    def size(self, tokens: int) -> int:
        """The ``block_size`` a chunk of ``tokens`` token ids (0: unknown) is announced with."""
        return tokens // self.blocks(tokens) if tokens else self.chunk_tokens


class PoolView:
    """Blocks of ``model`` held by the pool's live nodes; each change returns the events it makes."""

    def __init__(self, model: str, shape: BlockShape) -> None:
        self.model = model
        self.shape = shape
        self._nodes: dict[str, set[str]] = {}
        self._blocks: dict[int, list[int | None]] = {}  # hash -> [copies, parent hash, token count (0: unknown)]
        self._extra: dict[int, tuple[str, ...]] = {}  # only blocks that have extra keys
        self.unsplit = 0  # chunks announced whole although the block size splits them (no tokens to split)
        self._counts: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> set[int]:
        return set(self._blocks)

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def _ref(self, key: str) -> BlockRef | None:
        ref = block_of(key)
        return ref if ref is not None and ref.model == self.model else None

    def stored(
        self, node_id: str, keys: Sequence[str], tokens: Sequence[ChunkTokens | None] | None = None
    ) -> list[BlockStored | BlockRemoved]:
        """``node_id`` committed ``keys`` (with each one's tokens, where it came with them); a
        ``BlockStored`` for each block that was held nowhere before.

        A chunk without a record names no parent: a node sees the chunks of a put that it took, not
        the put (a client spreads a put's chunks over the nodes), and LMCache's keys name no parent.
        """
        held = self._nodes.setdefault(node_id, set())
        events: list[BlockStored | BlockRemoved] = []
        for i, key in enumerate(keys):
            ref = self._ref(key)
            if ref is None or key in held:
                continue
            held.add(key)
            entry = self._blocks.get(ref.block_hash)
            if entry is not None:
                entry[0] = (entry[0] or 0) + 1
                continue
            chunk = tokens[i] if tokens is not None else None
            parent, ids = (chunk.parent, list(chunk.token_ids)) if chunk is not None else (None, [])
            count = self._counts.setdefault(len(ids), len(ids))  # one int object per chunk size, not per block
            self._blocks[ref.block_hash] = [1, parent, count]
            if ref.extra is not None:
                self._extra[ref.block_hash] = ref.extra
            if self.shape.chunk_tokens != self.shape.block_size and self.shape.blocks(len(ids)) == 1:
                self.unsplit += 1
            events.append(self._stored_event(parent, [(ref.block_hash, len(ids))], [ref.extra], ids))
        return events

    def _stored_event(
        self,
        parent: int | None,
        chunks: list[tuple[int, int]],
        extras: list[tuple[str, ...] | None],
        token_ids: list[int] | None = None,
    ) -> BlockStored:
        """One ``BlockStored`` for a run of chained ``chunks`` (hash, token count) of one block size."""
        shape = self.shape
        hashes: list[int] = []
        block_extras: list[tuple[str, ...] | None] = []
        for (chunk_hash, tokens), extra in zip(chunks, extras):
            blocks = shape.blocks(tokens)
            hashes += sub_block_hashes(chunk_hash, blocks)
            block_extras += [extra] * blocks
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=token_ids or [],  # none where the chunk came without its record, and in a snapshot
            block_size=shape.size(chunks[0][1]),
            lora_id=None,
            medium=shape.medium,
            lora_name=None,
            extra_keys=block_extras if any(e is not None for e in block_extras) else None,
            group_idx=shape.group_idx,
            kv_cache_spec_kind=shape.kv_cache_spec_kind,
        )

    def removed(self, node_id: str, keys: Iterable[str]) -> list[BlockStored | BlockRemoved]:
        """``node_id`` no longer holds ``keys`` (evicted, deleted, drained, dropped, or the node is gone)."""
        held = self._nodes.get(node_id)
        if held is None:
            return []
        gone: list[int] = []
        for key in keys:
            if key not in held:
                continue
            held.discard(key)
            ref = self._ref(key)
            assert ref is not None  # only this model's keys are ever held
            entry = self._blocks[ref.block_hash]
            entry[0] = (entry[0] or 1) - 1
            if not entry[0]:
                del self._blocks[ref.block_hash]
                self._extra.pop(ref.block_hash, None)
                gone += sub_block_hashes(ref.block_hash, self.shape.blocks(entry[2] or 0))  # every block it was
        return (
            [BlockRemoved(block_hashes=gone, medium=self.shape.medium, group_idx=self.shape.group_idx)] if gone else []
        )

    def node_gone(self, node_id: str) -> list[BlockStored | BlockRemoved]:
        """Every copy ``node_id`` held is gone (it died, or restarted without them)."""
        events = self.removed(node_id, list(self._nodes.get(node_id, ())))
        self._nodes.pop(node_id, None)
        return events

    def replace(self, node_id: str, keys: Iterable[str]) -> list[BlockStored | BlockRemoved]:
        """``node_id`` holds exactly ``keys`` (a resynchronisation from its INVENTORY)."""
        now = {key for key in keys if self._ref(key) is not None}
        held = self._nodes.get(node_id, set())
        events = self.removed(node_id, list(held - now))
        events += self.stored(node_id, sorted(now - held))
        return events

    def nodes(self) -> set[str]:
        return set(self._nodes)

    def snapshot(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """What a subscriber that knows nothing needs: clear, then every block held (without token ids, which
        the endpoint does not keep), chains of one block size kept together."""
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [AllBlocksCleared()]
        run: list[tuple[int, int]] = []
        extras: list[tuple[str, ...] | None] = []
        parent: int | None = None
        for block_hash, (_, block_parent, tokens) in self._blocks.items():
            tokens = tokens or 0
            if run and block_parent == run[-1][0] and self.shape.size(tokens) == self.shape.size(run[-1][1]):
                run.append((block_hash, tokens))
                extras.append(self._extra.get(block_hash))
                continue
            if run:
                events.append(self._stored_event(parent, run, extras))
            parent, run, extras = block_parent, [(block_hash, tokens)], [self._extra.get(block_hash)]
        if run:
            events.append(self._stored_event(parent, run, extras))
        return events


def parents_first(events: Sequence[object]) -> list[object]:
    """``events`` with each run of consecutive ``BlockStored`` reordered so that a block whose parent is
    announced in the same run comes after it (a put's chunks reach the endpoint node by node); stable
    otherwise. Removals and clears keep their places."""
    out: list[object] = []
    run: list[BlockStored] = []
    for event in [*events, None]:
        if isinstance(event, BlockStored):
            run.append(event)
            continue
        out += _chain_order(run)
        run = []
        if event is not None:
            out.append(event)
    return out


def _chain_order(run: list[BlockStored]) -> list[BlockStored]:
    by_last = {event.block_hashes[-1]: i for i, event in enumerate(run)}
    placed = [False] * len(run)
    out: list[BlockStored] = []
    for i in range(len(run)):
        chain: list[int] = []
        while not placed[i]:  # up the parents not placed yet, then place them oldest first
            placed[i] = True
            chain.append(i)
            parent = run[i].parent_block_hash
            j = by_last.get(parent) if parent is not None else None
            if j is None:
                break
            i = j
        out += [run[k] for k in reversed(chain)]
    return out
