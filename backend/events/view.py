"""The pool's blocks of one model as the nodes report them, and the events each change makes.

The endpoint speaks for the pool as one pseudo-pod: a block is held while any copy of it is
on any live node (replicas and the ranks of one chunk are one block). A block's first copy
makes a ``BlockStored``, its last copy's removal a ``BlockRemoved``; a node that dies or
restarts takes its copies with it. Memory: per node, the set of its keys of this model (a
reference to the key string the EVENTS answer carried); per block, one dict entry
(hash -> [copies, parent]).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from backend.events.keys import BlockRef, block_of
from backend.events.wire import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["BlockShape", "PoolView"]


@dataclass(frozen=True)
class BlockShape:
    """What every ``BlockStored`` says besides its hashes (docs/fleet.md says why each value)."""

    block_size: int
    medium: str | None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"


class PoolView:
    """Blocks of ``model`` held by the pool's live nodes; each change returns the events it makes."""

    def __init__(self, model: str, shape: BlockShape) -> None:
        self.model = model
        self.shape = shape
        self._nodes: dict[str, set[str]] = {}
        self._blocks: dict[int, list[int | None]] = {}  # hash -> [copies, parent hash]
        self._extra: dict[int, tuple[str, ...]] = {}  # only blocks that have extra keys

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> set[int]:
        return set(self._blocks)

    def _ref(self, key: str) -> BlockRef | None:
        ref = block_of(key)
        return ref if ref is not None and ref.model == self.model else None

    def stored(self, node_id: str, keys: Sequence[str]) -> list[BlockStored | BlockRemoved]:
        """``node_id`` committed ``keys``; a ``BlockStored`` for each block that was held nowhere before.

        One event per block, with no parent: a node sees the chunks of a put that it took, not the put
        (a client spreads a put's chunks over the nodes), and LMCache's keys name no parent, so the
        chain is not known here and none is claimed (docs/fleet.md).
        """
        held = self._nodes.setdefault(node_id, set())
        events: list[BlockStored | BlockRemoved] = []
        for key in keys:
            ref = self._ref(key)
            if ref is None or key in held:
                continue
            held.add(key)
            entry = self._blocks.get(ref.block_hash)
            if entry is not None:
                entry[0] = (entry[0] or 0) + 1
                continue
            self._blocks[ref.block_hash] = [1, None]
            if ref.extra is not None:
                self._extra[ref.block_hash] = ref.extra
            events.append(self._stored_event(None, [ref.block_hash], [ref.extra]))
        return events

    def _stored_event(self, parent: int | None, hashes: list[int], extras: list[tuple[str, ...] | None]) -> BlockStored:
        shape = self.shape
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=[],  # LMCache 0.5 gives a remote backend no token ids (docs/fleet.md)
            block_size=shape.block_size,
            lora_id=None,
            medium=shape.medium,
            lora_name=None,
            extra_keys=list(extras) if any(e is not None for e in extras) else None,
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
                gone.append(ref.block_hash)
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
        """What a subscriber that knows nothing needs: clear, then every block held, chains kept together."""
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [AllBlocksCleared()]
        run: list[int] = []
        extras: list[tuple[str, ...] | None] = []
        parent: int | None = None
        for block_hash, (_, block_parent) in self._blocks.items():
            if run and block_parent == run[-1]:
                run.append(block_hash)
                extras.append(self._extra.get(block_hash))
                continue
            if run:
                events.append(self._stored_event(parent, run, extras))
            parent, run, extras = block_parent, [block_hash], [self._extra.get(block_hash)]
        if run:
            events.append(self._stored_event(parent, run, extras))
        return events
