"""What a check found: a :class:`Finding`, and the causes of docs/troubleshooting.md it can name.

Each cause is an entry of the troubleshooting page; its ``slug`` is that entry's anchor,
so a finding points the reader at the symptom, the cause and the command that confirms it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = [
    "Cause",
    "CAUSES",
    "Finding",
    "State",
    "TROUBLESHOOTING",
    "render",
    "EVERY_LOOKUP_MISSES",
    "PLUGIN_NOT_LOADED",
    "WRONG_PASSWORD",
    "WRONG_TOKEN",
    "WRONG_NAMESPACE",
    "NOT_ADVERTISED",
    "SHM_TOO_SMALL",
    "NVME_NOT_WRITABLE",
    "REDIS_FULL",
    "CLOCK_SKEW",
    "TLS_NAME",
    "VERSION_MISMATCH",
    "REDIS_UNREACHABLE",
    "REDIS_SLOW",
    "SECRET_FILE",
    "TLS_UNTRUSTED",
]

TROUBLESHOOTING = "docs/troubleshooting.md"


@dataclasses.dataclass(frozen=True)
class Cause:
    """One entry of docs/troubleshooting.md: ``title`` is its heading, ``slug`` that heading's anchor."""

    title: str

    @property
    def slug(self) -> str:
        """The anchor a Markdown renderer gives the heading: lower case, spaces to dashes, no punctuation."""
        kept = "".join(ch for ch in self.title.lower() if ch.isalnum() or ch in " -")
        return kept.replace(" ", "-")


EVERY_LOOKUP_MISSES = Cause("Every lookup misses")
PLUGIN_NOT_LOADED = Cause("Plugin not loaded")
WRONG_PASSWORD = Cause("Wrong Redis password")
WRONG_TOKEN = Cause("Wrong token")
WRONG_NAMESPACE = Cause("Wrong namespace")
NOT_ADVERTISED = Cause("Node not advertised on a reachable address")
SHM_TOO_SMALL = Cause("/dev/shm too small")
NVME_NOT_WRITABLE = Cause("NVMe directory not writable")
REDIS_FULL = Cause("Redis full")
CLOCK_SKEW = Cause("Clock skew")
TLS_NAME = Cause("TLS name mismatch")
VERSION_MISMATCH = Cause("Version mismatch")
REDIS_UNREACHABLE = Cause("Redis unreachable")
REDIS_SLOW = Cause("Redis paused or slow")
SECRET_FILE = Cause("Secret file unreadable")
TLS_UNTRUSTED = Cause("TLS certificate not trusted")

CAUSES: tuple[Cause, ...] = (
    EVERY_LOOKUP_MISSES,
    PLUGIN_NOT_LOADED,
    WRONG_PASSWORD,
    WRONG_TOKEN,
    WRONG_NAMESPACE,
    NOT_ADVERTISED,
    SHM_TOO_SMALL,
    NVME_NOT_WRITABLE,
    REDIS_FULL,
    CLOCK_SKEW,
    TLS_NAME,
    VERSION_MISMATCH,
    REDIS_UNREACHABLE,
    REDIS_SLOW,
    SECRET_FILE,
    TLS_UNTRUSTED,
)


class State(enum.Enum):
    OK = "ok"
    WARN = "warn"  # works here, but likely not from elsewhere (a loopback address, say): not a failure
    FAIL = "FAIL"
    SKIP = "skip"  # not run: an earlier check it needs failed


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check's outcome: what was checked, what was found, and for a failure its fix and cause."""

    check: str
    state: State
    detail: str
    fix: str = ""
    cause: Cause | None = None

    @classmethod
    def passed(cls, check: str, detail: str) -> Finding:
        return cls(check, State.OK, detail)

    @classmethod
    def failed(cls, check: str, detail: str, fix: str = "", cause: Cause | None = None) -> Finding:
        return cls(check, State.FAIL, detail, fix, cause)

    @classmethod
    def warned(cls, check: str, detail: str, fix: str = "", cause: Cause | None = None) -> Finding:
        return cls(check, State.WARN, detail, fix, cause)

    @classmethod
    def skipped(cls, check: str, why: str) -> Finding:
        return cls(check, State.SKIP, why)

    @property
    def ok(self) -> bool:
        """False only for a failure: a warning or a skipped check fails nothing by itself."""
        return self.state is not State.FAIL

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "state": self.state.value,
            "check": self.check,
            "detail": self.detail,
            "fix": self.fix,
            "cause": self.cause.slug if self.cause is not None else "",
        }


# The state's tag in a terminal: ANSI colours; a file or a pipe gets the plain tag.
STATE_COLOURS = {State.OK: "\x1b[32m", State.WARN: "\x1b[33m", State.FAIL: "\x1b[1;31m", State.SKIP: "\x1b[2m"}
COLOUR_RESET = "\x1b[0m"


def render(findings: list[Finding], *, colour: bool = False) -> list[str]:
    """The findings as ``kvpool doctor`` and ``kvpool selftest`` print them, one or more lines each; ``colour``
    colours each state's tag (for a terminal)."""
    lines = []
    for f in findings:
        tag = f"[{f.state.value:<4}]"
        if colour:
            tag = f"{STATE_COLOURS[f.state]}{tag}{COLOUR_RESET}"
        lines.append(f"{tag} {f.check}: {f.detail}")
        if f.cause is not None and f.state in (State.FAIL, State.WARN):
            lines.append(f"       cause: {f.cause.title} ({TROUBLESHOOTING}#{f.cause.slug})")
        if f.fix and f.state in (State.FAIL, State.WARN):
            lines.append(f"       fix: {f.fix}")
    return lines
