"""LMCache's own log while a kvpool command runs it: only its errors unless asked, uncoloured off a terminal.

LMCache logs its whole configuration and every backend it builds at INFO, in colour,
through a handler of its own on each module's logger (some made only as the backends
are built, one as the package is imported). So the level is set process-wide
(``logging.disable``) before LMCache is imported, and the colour on the formatter class
those handlers share. Importing this module imports nothing of LMCache.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["lmcache_logs"]

PLAIN_FORMAT = "[%(asctime)s] LMCache %(levelname)s: %(message)s (%(name)s)"


@contextlib.contextmanager
def lmcache_logs(*, verbose: bool, plain: bool) -> Iterator[None]:
    """Meanwhile, LMCache's records below ERROR are dropped unless ``verbose`` (the lines it logs as it is
    imported, the device it found, always are), and its lines carry no colour codes when ``plain``."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        from lmcache.logging import CustomFormatter as shared
    except ImportError:  # a core install: whoever imports LMCache next says so
        shared = None
    coloured = getattr(shared, "format", None)
    if shared is not None and plain:
        uncoloured = logging.Formatter(PLAIN_FORMAT)
        shared.format = lambda _self, record: uncoloured.format(record)
    logging.disable(before if verbose else logging.WARNING)
    try:
        yield
    finally:
        if shared is not None:
            shared.format = coloured
        logging.disable(before)
