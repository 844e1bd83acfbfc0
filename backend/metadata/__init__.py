"""The Redis metadata layer: key schema, node registry, index, lookup, rendezvous, Lua scripts.

:class:`MetadataStore` holds four separate parts over one :class:`~backend.metadata.connection.RedisConnection`
(the client, key names, deadlines and breaker, shared by composition): ``store.registry``
(:class:`NodeRegistry`: nodes, epochs, claims, heartbeats), ``store.index`` (:class:`KeyIndex`: which
node holds which key), ``store.lookup`` (:class:`LiveLookup`: the per-request read) and
``store.rendezvous`` (:class:`Rendezvous`: the channel's pairing offers); ``store.connection`` answers
for Redis itself (ping, version, memory). A node's parts get :class:`NodeMetadata`, what they use of two.

Redis holds metadata only -- which key lives on which node and tier, node liveness,
epochs. Bytes never pass through it, and it can be rebuilt: a node that finds the
namespace marker missing republishes what it holds.

Key schema (``NS`` is the namespace)::

    kvp:{NS}:marker          namespace generation; missing or changed means Redis lost our state
    kvp:NS:m:{NS.<n>}        Redis Cluster only: the same, on each other primary (see marker_keys)
    kvp:{NS}:epoch           counter; every node start takes a new epoch from it
    kvp:{NS}:nodes           hash node_id -> NodeInfo JSON (the registry)
    kvp:{NS}:hb:<node_id>    liveness and the id's claim; value = the epoch of the run holding the id,
                             expires after the heartbeat TTL; renewed only by that run (registry.py)
    kvp:{NS}:holder:<node_id> that run's address and pid (ClaimHolder JSON), expiring with the beat
    kvp:{NS}:draining        set of node ids placement skips (kvpool drain)
    kvp:{NS}:quotas          hash tenant -> byte quota on each node (kvpool quota); nodes read it with each heartbeat
    kvp:{NS}:poolquotas      hash tenant -> byte quota over the pool (kvpool quota --scope pool); read likewise
    kvp:{NS}:held:<node_id>  hash tenant -> bytes that node holds, for the tenants with a pool quota: written
                             with its heartbeat, expiring with it (quotas.py)
    kvp:{NS}:beats           sorted set node_id -> when its heartbeat expires (Redis server time, ms)
    kvp:{NS}:regv            registry version: bumped whenever what clients keep of a node changes
    kvp:{NS}:regchanges      list, newest first, of "version|node_id" per bump (the last REGISTRY_LOG_MAX)
    kvp:{NS}:slots           hash node_id -> slot: the small number its index fields go under (NodeSlots),
                             given at its first claim, kept across restarts until the id is forgotten
    kvp:{NS}:slotseq         counter the slots are given from (never reused)
    kvp:NS/<key>             index entry: hash slot -> varint(epoch) varint(nbytes << 2 | tier) checksum[8]
                             (read per request by one Lua call against the client's live view: lookup.py)
    kvp:{NS}:rdv:<session>   channel rendezvous offer (JSON), read once by the peer; expires (TTL)
    kvp:{NS}:probe, kvp:NS/  never set: a node DELs them at start to see it may write here (check_writable)

Registry keys share the hash tag ``{NS}`` (one Redis Cluster slot, small); index keys
carry no tag, so the index spreads over every shard by the whole name. An index entry
is a small hash (one field per copy) that Redis keeps as a listpack under its default
``hash-max-listpack-*`` limits: about 100 bytes of ``used_memory`` per chunk beyond the
key (docs/scale-redis.md). The release before kept ``kvp:NS:k:{<key>}`` hashes of
node id -> text; nothing reads those, and ``kvpool check --fix`` deletes them.

A client's registry refresh costs one command while nothing changed: it compares its
version with ``regv`` and reads only the nodes the change log names since then (the
whole registry only when it is new, fell behind the log, or Redis lost the log). The
version is bumped when a node joins, restarts (new epoch), comes back, leaves, dies
(the first heartbeat of any node after its beat expired notices), starts or stops
draining, or reports a change clients rely on (address, arena, load by tenths).

The same code runs on one Redis, a Redis Cluster and a Sentinel-managed master
(``backend.redis_topology`` builds the client). On a cluster a pipeline is split by
redis-py into one pipeline per shard, sent in parallel; multi-key DEL is split by
slot, SCAN walks every primary. Every call is bounded by ``timeout_s``: a Redis that
is down, paused or failing over costs at most that long, then raises MetadataError.
"""

from backend.metadata.connection import RedisFullError, RedisSlowError
from backend.metadata.index import KeyIndex
from backend.metadata.lookup import LiveLookup
from backend.metadata.quotas import NODE_SCOPE, POOL_SCOPE, QUOTA_SCOPES, QuotaBook, Quotas, check_scope
from backend.metadata.records import (
    MIN_REDIS_VERSION,
    Beat,
    ClaimHeld,
    ClaimHolder,
    IndexEntry,
    LiveCopies,
    LiveNamespaces,
    Location,
    NodeInfo,
    NodeSlots,
    RedisFacts,
    RedisMemory,
    SweepPage,
)
from backend.metadata.registry import NodeRegistry
from backend.metadata.rendezvous import Rendezvous
from backend.metadata.scripts import COMMIT_LUA, LOOKUP_BATCH, SWEEP_PAGE
from backend.metadata.store import MetadataStore, NodeMetadata

__all__ = [
    "Beat",
    "COMMIT_LUA",
    "ClaimHeld",
    "ClaimHolder",
    "IndexEntry",
    "KeyIndex",
    "LOOKUP_BATCH",
    "LiveCopies",
    "LiveLookup",
    "LiveNamespaces",
    "Location",
    "MIN_REDIS_VERSION",
    "MetadataStore",
    "NODE_SCOPE",
    "NodeMetadata",
    "NodeInfo",
    "NodeRegistry",
    "NodeSlots",
    "POOL_SCOPE",
    "QUOTA_SCOPES",
    "QuotaBook",
    "Quotas",
    "RedisFacts",
    "RedisFullError",
    "RedisMemory",
    "RedisSlowError",
    "Rendezvous",
    "SWEEP_PAGE",
    "SweepPage",
    "check_scope",
]
