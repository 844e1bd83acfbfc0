"""Kept for code that imports it from here; the LMCache config that enables kvpool is backend.lmcache.config."""

from backend.lmcache.config import *  # noqa: F403
