"""Choose nodes for a key: weighted rendezvous (highest-random-weight) hashing.

Each node scores ``-weight / ln(u)`` where ``u`` in (0, 1) is a hash of (key, node);
the highest scores win. With weight = free capacity, nodes receive new keys in
proportion to their free space, and adding or removing a node moves only the keys
that belong to it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import xxhash

from backend.metadata import NodeInfo

__all__ = ["rank_nodes", "choose_nodes", "next_fallback"]

_MIN_WEIGHT = 1.0  # a full node still ranks, last, so a write can fall back to it
_SCALE = float(2**64)


def _unit(key: str, node_id: str) -> float:
    h = xxhash.xxh3_64_intdigest(f"{node_id}\x00{key}".encode())
    return (h + 0.5) / _SCALE  # strictly inside (0, 1)


def rank_nodes(key: str, nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """All candidate nodes for ``key``, best first (draining nodes excluded)."""
    candidates = [n for n in nodes if n.alive and not n.draining]
    return sorted(
        candidates,
        key=lambda n: -max(float(n.free_bytes), _MIN_WEIGHT) / math.log(_unit(key, n.node_id)),
        reverse=True,
    )


def choose_nodes(key: str, nodes: Sequence[NodeInfo], replicas: int) -> list[NodeInfo]:
    """The ``replicas`` best nodes for ``key``, on distinct hosts where possible."""
    ranked = rank_nodes(key, nodes)
    chosen: list[NodeInfo] = []
    hosts: set[str] = set()
    for node in ranked:
        if len(chosen) == replicas:
            break
        if node.hostname and node.hostname in hosts:
            continue
        chosen.append(node)
        hosts.add(node.hostname)
    for node in ranked:  # not enough distinct hosts: fill with distinct nodes
        if len(chosen) == replicas:
            break
        if node not in chosen:
            chosen.append(node)
    return chosen


def next_fallback(ranked: Sequence[NodeInfo], tried: Collection[str], failed: Collection[str]) -> NodeInfo | None:
    """The node to try next for a key whose copy failed, or None when every node was tried.

    ``tried`` are the node ids tried for the key so far, ``failed`` those of them that
    failed; the others hold a copy (or are storing one). Best-ranked first among the
    untried nodes: on a host that holds no copy and saw no failure (a host can fail as
    a whole), else on a host that holds no copy, else any, so replicas stay on distinct
    hosts while there are hosts to spread them over.
    """
    untried = [node for node in ranked if node.node_id not in tried]
    if not untried:
        return None
    holding = {n.hostname for n in ranked if n.node_id in tried and n.node_id not in failed and n.hostname}
    failing = {n.hostname for n in ranked if n.node_id in failed and n.hostname}
    for avoid in (holding | failing, holding):
        fresh = [node for node in untried if node.hostname and node.hostname not in avoid]
        if fresh:
            return fresh[0]
    return untried[0]
