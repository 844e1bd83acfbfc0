"""Keys (and values) renamed to say what they mean: the old names keep working for a release.

A duration is configured in seconds under a name that says what it bounds
(``progress_timeout_s``, ``handshake_timeout_s``). The old key (``timeout_ms``,
``--handshake-timeout-ms``) is still read: its milliseconds become the new keys' seconds
(:func:`backend.config.values.ms_to_s`), and one deprecation line, naming both keys and
never a value, is logged once per process. An old key may stand for more than one new
one (``timeout_ms`` bounded both connecting and progress). Given beside a new key with a
different value, it is a ConfigError naming both; with the same value it is only
deprecated. ``to_url()`` and ``--help`` show only the new names.

A value may be renamed too (:func:`renamed_value`): ``--eviction prefix-freq`` became
``--eviction prefix`` (and the old ``prefix`` rule ``prefix-recency``). The old value is
taken as the new one, with one deprecation line per process naming both.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from backend.config.values import format_seconds, ms_to_s, parse_int
from backend.errors import ConfigError

__all__ = ["Renamed", "renamed_value", "take_renamed"]

logger = logging.getLogger("backend.config")

MAX_OLD_MS = 2**31 - 1  # what the old keys took at most (the node's flags; the URL's were lower, checked anew)
_warned: set[str] = set()  # old keys already warned about in this process (configs are rebuilt often)
_warned_values: set[tuple[str, str]] = set()  # (option, old value) already warned about


@dataclasses.dataclass(frozen=True)
class Renamed:
    """An old key counting milliseconds and the new key(s), in seconds, that it sets."""

    old: str
    new: tuple[str, ...]


def take_renamed(
    options: Mapping[str, Any],
    renamed: Sequence[Renamed],
    parse_new: Callable[[str, Any], float],
    spell: Callable[[str], str] = str,
) -> dict[str, Any]:
    """``options`` with each old key replaced by its new keys (values in seconds, as text).

    ``parse_new(key, value)`` parses a new key's value, to compare it with the old one's;
    ``spell`` writes a key as its source names it (``--handshake-timeout-ms``, ``KVPOOL_TIMEOUT_MS``).
    An old key whose value is None is taken as not given.
    """
    taken = {key: value for key, value in options.items() if not any(key == r.old for r in renamed)}
    for rename in renamed:
        raw = options.get(rename.old)
        if raw is None:
            continue
        seconds = ms_to_s(parse_int(spell(rename.old), str(raw), 1, MAX_OLD_MS))
        for new in rename.new:
            given = taken.get(new)
            if given is not None and parse_new(spell(new), given) != seconds:
                raise ConfigError(
                    spell(rename.old),
                    f"{spell(rename.old)}={raw} and {spell(new)}={given} disagree: give only {spell(new)} "
                    f"(seconds; {spell(rename.old)} is its deprecated name in milliseconds)",
                )
            taken[new] = format_seconds(seconds)
        _warn_once(spell(rename.old), [spell(new) for new in rename.new])
    return taken


def renamed_value(key: str, value: str, renamed: Mapping[str, str]) -> str:
    """``value`` of the option ``key`` (as its source spells it), or the new name of a renamed value, warned
    about once per process."""
    new = renamed.get(value)
    if new is None:
        return value
    if (key, value) not in _warned_values:
        _warned_values.add((key, value))
        logger.warning(
            "%s %s is deprecated: it is now called %s (give %s %s; the old name still works for now)",
            key,
            value,
            new,
            key,
            new,
        )
    return new


def _warn_once(old: str, new: list[str]) -> None:
    if old in _warned:
        return
    _warned.add(old)
    logger.warning(
        "%s is deprecated: give %s instead, in seconds (the old name in milliseconds still works for now)",
        old,
        " and ".join(new),
    )
