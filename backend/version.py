"""The version of kvpool (one place: the kvpool package and the CLI read it here)."""

__version__ = "0.1.0"
