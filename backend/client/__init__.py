"""The pool's client: batched put/get/contains/delete against one namespace.

Lookups are one pipelined Redis round trip; bytes move between the client and the
nodes over per-node sets of multiplexed connections, or, for a node on this host,
straight out of its shared-memory arena. ``PoolClient`` is a thin facade over the
parts (``backend/client/pool_client.py`` lists them); ``SyncPoolClient`` is its
blocking twin.
"""

from backend.client.chunks import BytesSink, Chunk, Fetched, Lock, Sink
from backend.client.leases import MAX_LEASE_TTL_MS
from backend.client.pool_client import PoolClient
from backend.client.sync import SyncPoolClient

__all__ = ["BytesSink", "Chunk", "Fetched", "Lock", "MAX_LEASE_TTL_MS", "PoolClient", "Sink", "SyncPoolClient"]
