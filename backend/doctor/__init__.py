"""What is wrong with a pool, and why, in words a user can act on: ``kvpool doctor`` and ``kvpool selftest``.

- :mod:`.findings`: a check's outcome (:class:`Finding`) and the causes of
  docs/troubleshooting.md it names (:data:`CAUSES`).
- :mod:`.pool`: the pool as a client sees it (Redis with its credentials, live nodes,
  each node's handshake); :func:`reach` is the short form every client runs first.
- :mod:`.node_host`: what a node started with given options would meet on this host.
- :mod:`.selftest`: put, look up, get and delete a few chunks through the pool.

The LMCache side (loading an LMCache config the way LMCache does) is
``backend.lmcache.doctor``, which builds on this. Nothing here imports LMCache: a node
host, which has only the core install, runs all of it.
"""

from backend.doctor.findings import CAUSES, TROUBLESHOOTING, Cause, Finding, State, render
from backend.doctor.node_host import check_node_host
from backend.doctor.pool import check_pool, reach
from backend.doctor.selftest import SELFTEST_PREFIX, selftest

__all__ = [
    "CAUSES",
    "TROUBLESHOOTING",
    "SELFTEST_PREFIX",
    "Cause",
    "Finding",
    "State",
    "check_node_host",
    "check_pool",
    "reach",
    "render",
    "selftest",
]
