"""How a node option's raw value (a flag's text, a YAML value, a variable) becomes its value.

Each parser takes the option as its source spells it (``--dram``, ``dram (in FILE)``) and the
raw value, and raises ConfigError naming that spelling.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend.config.suggest import did_you_mean
from backend.config.values import check_node_id, parse_int, parse_seconds, parse_size
from backend.errors import ConfigError
from backend.redis_topology import RedisTarget

__all__ = [
    "DEFAULT_SHM_DIR",
    "choice",
    "int_in",
    "named",
    "node_id_value",
    "optional",
    "parse_advertise",
    "path_value",
    "redis_value",
    "seconds_value",
    "shm_dir_value",
    "size_value",
    "switch",
    "text_value",
]

DEFAULT_SHM_DIR = "/dev/shm"
MAX_NODE_S = (2**31 - 1) / 1000  # about 24 days: as many milliseconds as an int32 holds
MIN_NODE_S = 0.001
_ON = ("on", "true", "yes", "1")
_OFF = ("off", "false", "no", "0")


def text_value(key: str, value: Any) -> str:
    if value is None or isinstance(value, (dict, list)):
        raise ConfigError(key, f"{value!r} is not a value for this option")
    return str(value)


def optional(parse: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``parse``, except that an empty value (YAML ``null``, ``""``) means "not set"."""
    return lambda key, value: None if value is None or value == "" else parse(key, value)


def path_value(key: str, value: Any) -> Path:
    return Path(text_value(key, value))


def named(pattern: re.Pattern[str], rule: str) -> Callable[[str, Any], str]:
    def parse(key: str, value: Any) -> str:
        text = text_value(key, value)
        if not pattern.match(text):
            raise ConfigError(key, f"{text!r} must be {rule}")
        return text

    return parse


def node_id_value(key: str, value: Any) -> str:
    """A node id (``NODE_ID_RULE``), or "" for the default."""
    text = "" if value is None else text_value(key, value)
    return check_node_id(text, key) if text else ""


def choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    """One of ``choices``; anything else is refused naming the close one."""

    def parse(key: str, value: Any) -> str:
        text = "off" if value is False else text_value(key, value).strip().lower()  # YAML reads a bare off as False
        if text not in choices:
            hint = did_you_mean(text, choices)
            raise ConfigError(key, f"{text!r} is not one of {', '.join(choices)}{'; ' + hint if hint else ''}")
        return text

    return parse


def switch(key: str, value: Any) -> bool:
    """on/off (also true/false, yes/no, 1/0, and YAML's bare booleans)."""
    if isinstance(value, bool):
        return value
    text = text_value(key, value).strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ConfigError(key, f"{text!r} is not on or off")


def size_value(positive: bool) -> Callable[[str, Any], int]:
    def parse(key: str, value: Any) -> int:
        size = parse_size(text_value(key, value), name=key)
        if positive and size <= 0:
            raise ConfigError(key, f"{value!r} is not a positive size")
        return size

    return parse


def int_in(low: int, high: int) -> Callable[[str, Any], int]:
    return lambda key, value: parse_int(key, text_value(key, value), low, high)


def seconds_value(key: str, value: Any) -> float:
    return parse_seconds(key, text_value(key, value), MIN_NODE_S, MAX_NODE_S)


def seconds_or_zero_value(key: str, value: Any) -> float:
    """Seconds, where 0 means none (no expiry, no cap)."""
    return parse_seconds(key, text_value(key, value), 0, MAX_NODE_S)


def shm_dir_value(key: str, value: Any) -> Path | None:
    text = "off" if value is False or value is None else text_value(key, value)
    if text.lower() == "off":
        return None
    if not Path(text).is_dir():
        if text != DEFAULT_SHM_DIR:
            raise ConfigError(key, f"{text} is not a directory (use 'off' for no arena)")
        return None  # a system without /dev/shm: private memory, TCP for everyone
    return Path(text)


def parse_advertise(key: str, value: Any) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``:PORT``, ``[V6]:PORT`` or a bare IPv6 address -> (host or "", port or 0)."""
    text = "" if value is None else text_value(key, value)
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or not host or (rest and not rest.startswith(":")):
            raise ConfigError(key, f"{text!r} is not HOST, HOST:PORT or [IPV6]:PORT")
        port_text = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""  # a name, or an IPv6 address without a port
    if not port_text:
        return host, 0
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(key, f"{text!r}: the port must be a number in 1..65535")
    return host, int(port_text)


def redis_value(key: str, value: Any) -> str:
    text = text_value(key, value)
    RedisTarget.parse(text, key=key)  # the form is checked now, the server when the node starts
    return text
