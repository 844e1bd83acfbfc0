"""Did you mean: the one helper every "unknown option, flag, value or verb" error asks for the close name.

A name is compared as its source spells it, with the spelling set aside: ``--dead-node-grace-s``,
``dead_node_grace_s``, ``dead-node-grace-s`` (YAML) and ``KVPOOL_DEAD_NODE_GRACE_S`` are one name.
A name kvpool used before its first release (:data:`RENAMES`) is answered with the name that
replaced it, whatever their spellings have in common; any other with the closest known names
(:func:`difflib.get_close_matches`). Nothing reads an old name any more: it is only recognised here.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["RENAMES", "did_you_mean", "renamed_to"]

ENV_PREFIX = "kvpool_"  # as folded: KVPOOL_REPLICAS is the option replicas
MAX_SUGGESTIONS = 3
CUTOFF = 0.6  # difflib's default: "replica" finds replicas, "bogus" finds nothing
TIE = 0.1  # names this much less alike than the closest are not offered beside it
# Names of kvpool before 0.1 -> the names that replaced them (folded: lower case, "_" for "-").
RENAMES: dict[str, tuple[str, ...]] = {
    "timeout_ms": ("connect_timeout_s", "progress_timeout_s"),  # it bounded both, in milliseconds
    "pair_timeout_ms": ("pair_timeout_s",),
    "dead_node_grace_ms": ("dead_node_grace_s",),
    "handshake_timeout_ms": ("handshake_timeout_s",),
    "prefix_freq": ("prefix",),  # --eviction: the frequency-aware prefix rule
}


def _fold(name: str) -> str:
    folded = name.strip().lstrip("-").lower().replace("-", "_")
    return folded.removeprefix(ENV_PREFIX)


def renamed_to(name: str, known: Iterable[str]) -> list[str]:
    """The names of ``known`` (as they are spelled there) that replaced the old name ``name``; [] if it is none."""
    spelled = {_fold(k): k for k in known}
    return [spelled[new] for new in RENAMES.get(_fold(name), ()) if new in spelled]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"did you mean X?"`` naming what ``name`` should have been, among ``known``; ``""`` when nothing is close.

    ``known`` is spelled as the source spells it (``--dram``, ``KVPOOL_REPLICAS``): the answer is too.
    """
    known = list(known)
    new = renamed_to(name, known)
    if new:
        unit = ", in milliseconds: give seconds" if _fold(name).endswith("_ms") else ""
        return f"did you mean {' and '.join(new)}? ({name} was its name before 0.1{unit})"
    spelled = {_fold(k): k for k in known}
    close = difflib.get_close_matches(_fold(name), list(spelled), n=MAX_SUGGESTIONS, cutoff=CUTOFF)
    if not close:
        return ""
    scores = [difflib.SequenceMatcher(None, _fold(name), c).ratio() for c in close]  # best first
    best = [spelled[c] for c, score in zip(close, scores, strict=True) if score >= scores[0] - TIE]
    return f"did you mean {' or '.join(best)}?"
