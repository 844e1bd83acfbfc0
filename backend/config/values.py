"""The values every kvpool setting is made of: sizes, on/off, bounded integers, names, secrets.

Durations are configured in seconds (``*_s``); where a wire field, a Redis expiry or an old
key counts milliseconds, :func:`s_to_ms` and :func:`ms_to_s` are the one conversion.

Secrets (the pool token, the Redis password) are read from files by one function for the
client and the node alike, :func:`read_secret_file`, which warns about a file that other
users can read; the pool token, wherever it comes from, is held to a minimum length by
:func:`check_token`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from urllib.parse import SplitResult, urlsplit

from backend.errors import ConfigError

__all__ = [
    "NAMESPACE_RE",
    "CLUSTER_RE",
    "MIN_TOKEN_CHARS",
    "GOOD_TOKEN_CHARS",
    "check_token",
    "NODE_ID_RE",
    "NODE_ID_RULE",
    "check_node_id",
    "default_node_id",
    "format_seconds",
    "format_size",
    "ms_to_s",
    "parse_bool",
    "parse_int",
    "parse_seconds",
    "parse_size",
    "read_secret_file",
    "s_to_ms",
    "split_url",
]

logger = logging.getLogger("backend.config")

# A pool token shorter than this is refused: a few characters can be guessed, and a token is
# never rotated by itself. Below GOOD_TOKEN_CHARS it is accepted with a warning.
MIN_TOKEN_CHARS = 16
GOOD_TOKEN_CHARS = 32
MAKE_TOKEN = "openssl rand -hex 32"  # 64 hex characters: 256 random bits

NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CLUSTER_RE = re.compile(r"^[A-Za-z0-9_.-]{0,64}$")
# A node id names Redis keys, index fields (whose values use '|' as a separator), metrics
# labels, log lines and the NVMe directory's node_id file: a short name, nothing to escape.
NODE_ID_MAX_CHARS = 128
NODE_ID_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{NODE_ID_MAX_CHARS - 1}}}")
NODE_ID_RULE = f"1-{NODE_ID_MAX_CHARS} characters of A-Z a-z 0-9 _ . -, the first a letter or digit"
_NOT_IN_NODE_ID = re.compile(r"[^A-Za-z0-9_.-]")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1000,
    "KI": 1024,
    "KIB": 1024,
    "M": 1024**2,
    "MB": 1000**2,
    "MI": 1024**2,
    "MIB": 1024**2,
    "G": 1024**3,
    "GB": 1000**3,
    "GI": 1024**3,
    "GIB": 1024**3,
    "T": 1024**4,
    "TB": 1000**4,
    "TI": 1024**4,
    "TIB": 1024**4,
}


def check_node_id(node_id: str, source: str) -> str:
    """``node_id`` if it follows the node id rule (``NODE_ID_RULE``); else ConfigError naming ``source``."""
    if not NODE_ID_RE.fullmatch(node_id):
        raise ConfigError(source, f"{node_id!r} is not a valid node id: a node id is {NODE_ID_RULE}")
    return node_id


def default_node_id(hostname: str, suffix: str) -> str:
    """``HOSTNAME-SUFFIX`` made to follow the node id rule: other characters become '-', the
    hostname is cut to fit, and a hostname that starts with no letter or digit gets an 'n' first."""
    host = _NOT_IN_NODE_ID.sub("-", hostname)
    if not host[:1].isalnum():  # ASCII by now
        host = "n" + host
    return check_node_id(f"{host[: NODE_ID_MAX_CHARS - len(suffix) - 1]}-{suffix}", "node id")


def split_url(url: str, problem: Callable[[str], ConfigError]) -> SplitResult:
    """``urlsplit(url)``, with what it refuses (an unclosed ``[``, a port out of range) raised
    as ``problem(reason)``: the caller's ConfigError, naming its key and the URL as it shows it."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (parsed lazily: a bad port raises here)
    except ValueError as exc:
        if "Port" in str(exc):
            raise problem("the port is not a number in 0-65535") from None
        if "IPv6" in str(exc):
            raise problem("an unclosed '[' or a malformed IPv6 host (write it as [ADDRESS]:PORT)") from None
        raise problem(str(exc)) from None
    return parts


def parse_size(text: str, *, name: str = "size") -> int:
    """Parse ``"4GiB"``, ``"512MiB"``, ``"1.5G"`` or ``"1048576"`` into bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(name, f"{text!r} is not a size (examples: 4GiB, 512MiB, 1048576)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").upper()])


def format_size(num_bytes: float) -> str:
    """Render a byte count for people: ``4.0 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} TiB"


def parse_bool(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"on", "true", "1", "yes"}:
        return True
    if lowered in {"off", "false", "0", "no"}:
        return False
    raise ConfigError(key, f"{text!r} is not on/off")


def parse_int(key: str, text: str, low: int, high: int) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(key, f"{text!r} is not an integer") from None
    if not low <= value <= high:
        raise ConfigError(key, f"{value} is out of range [{low}, {high}]")
    return value


def ms_to_s(ms: float) -> float:
    """A count of milliseconds (a wire field, a Redis PTTL, an old ``*_ms`` key) in seconds."""
    return ms / 1000


def s_to_ms(seconds: float) -> int:
    """Seconds as the whole milliseconds a wire field or a Redis expiry (PX) takes, rounded."""
    return round(seconds * 1000)


def parse_seconds(key: str, text: object, low: float, high: float) -> float:
    """A duration in seconds (``"2"``, ``"0.5"``) within ``[low, high]``; ConfigError naming ``key``."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise ConfigError(key, f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise ConfigError(key, f"{text} is out of range [{format_seconds(low)}, {format_seconds(high)}] seconds")
    return value


def format_seconds(seconds: float) -> str:
    """A duration as a URL or flag takes it: ``2``, ``0.5`` (no trailing ``.0``)."""
    return f"{seconds:g}" if seconds == float(f"{seconds:g}") else repr(seconds)


_warned_secrets: set[tuple[str, str]] = set()  # (what, where): configs are rebuilt, each warning is said once


def _warn_once(what: str, where: str, message: str, *args: object) -> None:
    if (what, where) not in _warned_secrets:
        _warned_secrets.add((what, where))
        logger.warning(message, *args)


def read_secret_file(path: str | Path, key: str, *, if_empty: str = "") -> str:
    """The secret held in the file at ``path``, surrounding whitespace stripped.

    ConfigError naming ``key`` (the option or flag that named the file) if it cannot be
    read or is empty (``if_empty`` is added to that message). A file that users other than its owner can read is warned about
    once per process, with the fix: readable by everyone, or by its group when it is this
    user's own file (a file of another owner that this user reads through its group, as a
    Kubernetes secret volume with ``defaultMode: 0440`` and an ``fsGroup``, is how it must be).
    """
    try:
        with open(path, encoding="utf-8") as file:
            info = os.fstat(file.fileno())
            text = file.read().strip()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(key, f"{path} is not text") from None
    if not text:
        raise ConfigError(key, f"{path} is empty{if_empty}")
    mode = stat.S_IMODE(info.st_mode)
    others = bool(mode & stat.S_IROTH)
    group = bool(mode & stat.S_IRGRP) and info.st_uid == os.getuid()
    if others or group:
        who = "every user of this host" if others else "its group"
        _warn_once(
            "readable",
            str(path),
            "%s: %s is readable by %s (mode %04o): whoever reads it holds the secret; run `chmod 600 %s`",
            key,
            path,
            who,
            mode,
            path,
        )
    return text


def check_token(token: str, key: str, source: str) -> None:
    """Refuse a pool token shorter than :data:`MIN_TOKEN_CHARS`; warn (once) about one shorter
    than :data:`GOOD_TOKEN_CHARS`. ``key`` is what a ConfigError names, ``source`` where the token came
    from (a file, a variable), for the message. An empty token is no token: the pool is open."""
    if not token:
        return
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            key,
            f"the pool token from {source} is {len(token)} characters; at least {MIN_TOKEN_CHARS} are required "
            f"(make one with `{MAKE_TOKEN}`)",
        )
    if len(token) < GOOD_TOKEN_CHARS:
        _warn_once(
            "weak",
            source,
            "%s: the pool token from %s is %d characters, a weak one; %d or more are recommended (make one with `%s`)",
            key,
            source,
            len(token),
            GOOD_TOKEN_CHARS,
            MAKE_TOKEN,
        )
