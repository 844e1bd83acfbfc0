"""The names of what the node, the client and the LMCache layer count: one ``StrEnum`` per owner.

Producers count under these members and the metrics and reports read them, so a misspelt
name is an ``AttributeError`` (and a mypy error), never a silent new series. A member's value
is the name on the wire (STAT's ``counters``) and in the metric (``kvpool_node_<value>_total``,
``kvpool_connector_<value>_total``); docs/metrics.md lists them. A member's name may say the
house's term where the public value keeps an older word (docs/design.md, glossary): a put
refused for lack of room counts as ``put_rejected_capacity``.
"""

from __future__ import annotations

from enum import StrEnum, unique

__all__ = ["ChannelCounter", "ClientCounter", "ConnectorCounter", "L2Counter", "MissCause", "NodeCounter"]


@unique
class NodeCounter(StrEnum):
    """What a pool node counts (its parts and a channel node alike); STAT reports them."""

    # requests and connections
    REQUESTS = "requests"
    REQUEST_ERRORS = "request_errors"
    PROTOCOL_ERRORS = "protocol_errors"
    AUTH_FAILURES = "auth_failures"
    TENANT_REFUSALS = "tenant_refusals"  # requests of a tenant-token connection outside its tenant (or admin ops)
    TLS_FAILURES = "tls_failures"
    CONNECTIONS_ACCEPTED = "connections_accepted"
    CONNECTION_ERRORS = "connection_errors"
    CONNECTIONS_SHED = "connections_shed"
    HANDSHAKE_TIMEOUTS = "handshake_timeouts"
    STALLED_CONNECTIONS = "stalled_connections"
    ACCEPT_ERRORS = "accept_errors"
    # puts
    PUTS = "puts"
    PUT_BYTES = "put_bytes"
    PUT_REFUSED_NO_ROOM = "put_rejected_capacity"
    PUT_REFUSED_BUSY = "put_rejected_busy"
    STAGED_PUT_BYTES = "staged_put_bytes"
    STAGES_REMOVED = "stages_removed"
    STAGE_SWEEPS = "stage_sweeps"
    # gets and deletes
    GETS = "gets"
    HITS = "hits"
    MISSES = "misses"
    GET_BYTES = "get_bytes"
    GET_OVER_FRAME_LIMIT = "get_over_frame_limit"
    SHM_GET_BYTES = "shm_get_bytes"
    DELETES = "deletes"
    TOUCHED_KEYS = "touched_keys"  # keys of TOUCH requests: lookups' hits the eviction order heard of
    LAYOUT_MISSES = "layout_misses"  # keys a read found stored with another layout fingerprint: misses, no bytes
    # tiers
    EVICTIONS = "evictions"
    QUOTA_EVICTIONS = "quota_evictions"
    DEMOTIONS = "demotions"
    PROMOTIONS = "promotions"
    NVME_WRITES = "nvme_writes"
    NVME_READS = "nvme_reads"
    NVME_EVICTIONS = "nvme_evictions"
    NVME_WRITE_ERRORS = "nvme_write_errors"
    DISK_FULL = "disk_full"
    DISK_RECHECKS = "disk_rechecks"
    INTEGRITY_FAILURES = "integrity_failures"
    QUARANTINED = "quarantined"
    REPUBLISHED = "republished"
    # leases
    LEASES_GRANTED = "leases_granted"
    LEASES_RELEASED = "leases_released"
    LEASES_EXPIRED = "leases_expired"
    LEASES_REFUSED = "leases_refused"
    LEASES_DISCONNECTED = "leases_disconnected"
    # the collector of dead nodes' index entries
    COLLECTOR_SWEEPS = "collector_sweeps"
    COLLECTOR_KEYS_READ = "collector_keys_read"
    COLLECTED_NODES = "collected_nodes"
    COLLECTED_INDEX_FIELDS = "collected_index_fields"
    # a node started with --channel
    CHANNEL_GETS = "channel_gets"
    CHANNEL_HITS = "channel_hits"
    CHANNEL_MISSES = "channel_misses"
    CHANNEL_PAIRS = "channel_pairs"
    CHANNEL_BYTES = "channel_bytes"
    CHANNEL_ERRORS = "channel_errors"


@unique
class ClientCounter(StrEnum):
    """What a ``PoolClient`` counts; the connector reports some as its own (``CLIENT_COUNTERS`` there)."""

    PUT_CHUNKS = "put_chunks"
    PUT_BYTES = "put_bytes"
    PUT_FAILURES = "put_failures"
    STAGED_PUT_BYTES = "staged_put_bytes"
    GET_HITS = "get_hits"
    GET_MISSES = "get_misses"
    GET_FAILOVERS = "get_failovers"
    EARLY_READS = "early_reads"
    GET_BYTES_TCP = "get_bytes_tcp"
    SHM_GET_BYTES = "shm_get_bytes"
    GET_BYTES_CHANNEL = "get_bytes_channel"
    CHANNEL_FALLBACKS = "channel_fallbacks"
    INTEGRITY_FAILURES = "integrity_failures"
    LOOKUP_FAILURES = "lookup_failures"
    STALE_ENTRIES = "stale_entries"
    LAYOUT_MISSES = "layout_misses"  # keys held with another layout fingerprint than the reader's: misses
    NODES_MARKED_DOWN = "nodes_marked_down"
    NODES_RESTORED = "nodes_restored"
    TOUCHES_SENT = "touches_sent"  # TOUCH requests sent (lookups' found prefixes, batched, to one node)
    TOUCHES_DROPPED = "touches_dropped"  # found keys not told to their node (backlog full, node slow, down or refusing)
    TOUCH_REFUSALS = "touch_refusals"  # node epochs that refused TOUCH (an older build): not touched again


@unique
class ChannelCounter(StrEnum):
    """What the channel's client side counts (nccl_channel/client.py)."""

    PAIRS_CREATED = "pairs_created"
    PAIR_FAILURES = "pair_failures"
    BYTES = "bytes"
    INTEGRITY_FAILURES = "integrity_failures"


@unique
class ConnectorCounter(StrEnum):
    """What the in-process LMCache connector counts of its own (beside its misses, ``MissCause``)."""

    PUT_CHUNKS = "put_chunks"
    PUT_SKIPPED_BUSY = "put_skipped_busy"
    GET_HITS = "get_hits"
    GET_MISSES = "get_misses"
    TENANT_REFUSED = "tenant_refused"  # keys whose request tag names no valid tenant (backend/lmcache/tenant_names.py)
    # event_tokens=on (backend/lmcache/token_binding.py): chunks of puts with their token record, without
    # one (no binding: not hashed from tokens lately), and without one because no token database was found.
    EVENT_TOKENS_BOUND = "event_tokens_bound"
    EVENT_TOKENS_UNBOUND = "event_tokens_unbound"
    EVENT_TOKENS_NO_DATABASE = "event_tokens_no_database"


@unique
class L2Counter(StrEnum):
    """What the LMCache L2 adapter counts of its own (beside its misses, ``MissCause``)."""

    STORED_CHUNKS = "stored_chunks"
    STORE_SKIPPED_BUSY = "store_skipped_busy"
    # stores sent although the index listed the key, because this adapter's load of it had missed (a copy of
    # another layout, or an older adapter's without one): the new copy replaces it (backend/lmcache/l2/unreadable.py)
    STORE_REPLACED = "store_replaced"
    LOADED_CHUNKS = "loaded_chunks"
    LOAD_MISSES = "load_misses"
    TENANT_REFUSED = "tenant_refused"  # keys whose cache_salt is no valid tenant name (tenant_from_salt=on)


@unique
class MissCause(StrEnum):
    """Why the LMCache layer read a pool error as a miss; counted as ``miss_<cause>``."""

    LOOKUP = "lookup"
    GET = "get"
    PUT = "put"
    LIST = "list"
    REMOVE = "remove"
    SIZE = "size"
    ALLOCATE = "allocate"
    REGISTRY = "registry"
    LOAD = "load"
    STORE = "store"
    UNLOCK = "unlock"

    @property
    def counter(self) -> str:
        """The counter this cause's misses are counted under."""
        return f"miss_{self.value}"
