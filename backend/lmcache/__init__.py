"""Everything of kvpool that touches LMCache, one room per part.

- :mod:`.config`: the LMCache config that enables kvpool (both in-process forms and the
  multiprocess ``--l2-adapter``), and the pool URL it names. Imports neither LMCache nor
  torch, so the CLI prints it on a pool node's core install.
- :mod:`.connector`: the in-process connector (``RemoteConnector``), its plugin adapter
  and the ``remote_url`` connector.
- :mod:`.l2`: the L2 adapter of LMCache's multiprocess mode.
- :mod:`.doctor`: ``kvpool doctor``.
- The shared core: :mod:`.chunks` (memory object <-> pool chunk, one rule for both
  modes) and :mod:`.boundary` (pool errors become misses). The loop thread both use is
  :class:`backend.threads.LoopThread`.

Configs name ``kvpool.lmcache_connector`` and ``kvpool.lmcache_l2_adapter``; those modules
re-export :mod:`.connector` and :mod:`.l2`. Nothing outside this package (and those two)
imports LMCache, and importing this package itself imports nothing of it.
"""
