"""The ``kvpool`` admin CLI: parses, calls the library, prints. Nothing imports it.

One module per verb family, each with its flags and its commands: ``serve`` (up, node),
``listing`` (status, nodes, ls, stats), ``maintenance`` (evict, drain, undrain, flush, check),
``diagnose`` (doctor, selftest), ``lmcache`` (lmcache-config); beneath them ``options`` (shared flags, the
pool of ``--url``), ``output`` (JSON, tables, progress) and ``exits`` (exit codes); ``main``
builds the parser from the families and turns errors into exit codes.
"""

from backend.cli.main import build_parser, main

__all__ = ["main", "build_parser"]
