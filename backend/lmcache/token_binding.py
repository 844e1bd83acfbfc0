"""Which tokens a chunk LMCache puts holds, and its parent chunk: the token records of ``event_tokens=on``.

LMCache 0.5.6 calls a remote connector with keys and memory objects only (``put(key, obj)``,
``batched_put(keys, objs)``): no token ids, no parent. Its engine knows both a moment earlier:
``LMCacheEngine.store()`` walks ``token_database.process_tokens(tokens, ..., mask)``, whose
``ChunkedTokenDatabase`` cuts the tokens into chunks and chains each chunk's hash on the hash
before it (``_prefix_hash``), then hands the keys to the storage manager, which reaches the
connector. So the binding wraps that database's ``_prefix_hash`` *on the instance* (never the
class: other engines in the process are left alone) and keeps, for each chunk hash it yields,
the chunk's token ids (an ``array('I')``: 4 bytes a token) and the hash before it (the parent;
none for a prompt's first chunk), as ``ChunkTokens``, which the client sends as token records
(``backend/protocol/tokens.py``). Nothing is hashed twice: the wrapper reads what the
database computed. The parent of the first chunk of a masked store (the
chunks before it are stored already) is the hash of the chunk before it, which the database
computed on the way; LMCache's own ``CacheStoreEvent`` says 0 there.

A put then looks its keys' chunk hashes up (:meth:`TokenBinding.tokens`). The map is bounded
(at most ``MAX_ENTRIES`` chunks and ``MAX_BYTES`` of token ids, oldest first out), like LMCache's
multiprocess server's ``_kv_event_bindings``: lookups and retrieves hash chunks too, and a
binding only has to live from the store's hashing to its put, moments later. A put's key with
no binding (evicted from the map, stored with hashes instead of tokens, or no database found)
goes without its record, counted; a put never fails for it.

The engine is found lazily through ``LMCacheEngineBuilder``: the connector is built while the
engine builds its storage manager (``post_init``), before ``engine.storage_manager`` names it,
so the search happens at the connector's first lookup (a store follows a lookup in vLLM's
integration) and again at puts until found. No engine holding this connector (a storage stack
built without one, LMCache's multiprocess server) is said once in the log and counted per put;
:meth:`TokenBinding.bind` takes a database directly.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from backend.counters import ConnectorCounter
from backend.protocol.tokens import MAX_RECORD_TOKENS, ChunkTokens

__all__ = ["MAX_BYTES", "MAX_ENTRIES", "TokenBinding", "TokenRecords"]

logger = logging.getLogger(__name__)

MAX_ENTRIES = 65_536  # chunks, as LMCache's multiprocess server keeps its event bindings
MAX_BYTES = 32 * 1024 * 1024  # of token ids, 4 bytes each: 32,768 chunks of 256 tokens
_ATTRIBUTE = "_kvpool_token_records"  # on a wrapped database: its TokenRecords (the wrap is done once)
_UNWRAP_DEPTH = 4  # LMCache wraps a connector (InstrumentedRemoteConnector._connector): how deep to look


class TokenRecords:
    """chunk hash -> its tokens, bounded; fed from the engine's threads, read on LMCache's loop."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._records: OrderedDict[Any, ChunkTokens] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.unencodable = 0  # chunks whose ids are not u32 (never the case for a real vocabulary)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def bind(self, chunk_hash: Any, parent: Any, tokens: Any) -> None:
        """Keep ``tokens`` (and ``parent``) under ``chunk_hash``; a hash kept already is only made the newest."""
        with self._lock:
            if chunk_hash in self._records:
                self._records.move_to_end(chunk_hash)
                return
        try:
            ids = array("I", tokens.tolist() if hasattr(tokens, "tolist") else tokens)
            bound = ChunkTokens(None if parent is None else int(parent), ids)
        except (OverflowError, TypeError, ValueError):
            self.unencodable += 1
            return
        if not 0 < len(ids) <= MAX_RECORD_TOKENS:
            self.unencodable += 1
            return
        with self._lock:
            earlier = self._records.pop(chunk_hash, None)  # bound meanwhile by another thread
            self._bytes += _nbytes(bound) - (_nbytes(earlier) if earlier is not None else 0)
            self._records[chunk_hash] = bound
            while len(self._records) > self.max_entries or self._bytes > self.max_bytes:
                self._bytes -= _nbytes(self._records.popitem(last=False)[1])

    def get(self, chunk_hash: Any) -> ChunkTokens | None:
        with self._lock:
            return self._records.get(chunk_hash)

    def wrap(self, database: Any) -> TokenRecords:
        """Wrap ``database._prefix_hash`` on the instance so every chunk hash it yields is bound; once per
        database: a database wrapped already keeps its records, which are returned."""
        existing = getattr(database, _ATTRIBUTE, None)
        if isinstance(existing, TokenRecords):
            return existing
        original: Callable[[Iterable[Any]], Iterator[Any]] = database._prefix_hash

        def prefix_hash(token_chunks: Iterable[Any]) -> Iterator[Any]:
            last: list[Any] = [None]

            def fed() -> Iterator[Any]:
                for chunk in token_chunks:
                    last[0] = chunk
                    yield chunk

            parent = None
            for chunk_hash in original(fed()):
                self.bind(chunk_hash, parent, last[0])
                parent = chunk_hash
                yield chunk_hash

        database._prefix_hash = prefix_hash
        setattr(database, _ATTRIBUTE, self)
        return self


class TokenBinding:
    """One connector's token records: finds its engine's token database, wraps it, and answers a put's keys."""

    def __init__(self, connector: object, counters: Counter[str], enabled: bool) -> None:
        self.connector = connector
        self.counters = counters
        self.enabled = enabled
        self._records: TokenRecords | None = None
        self._told = False
        self._lock = threading.Lock()  # LMCache's worker threads and its loop may look at once

    @property
    def bound(self) -> bool:
        return self._records is not None

    def bind(self, database: Any) -> TokenRecords:
        """Take token records from ``database`` (a ``ChunkedTokenDatabase``)."""
        self._records = TokenRecords().wrap(database)
        return self._records

    def ensure(self) -> bool:
        """Whether this connector's engine's token database is wrapped; looks for it until it is found."""
        if self._records is not None or not self.enabled:
            return self._records is not None
        with self._lock:
            if self._records is not None:
                return True
            database, why = _find_database(self.connector)
            if database is None:
                if not self._told:
                    self._told = True
                    logger.warning("kvpool: event_tokens=on, but %s: puts carry no token ids", why)
                return False
            self.bind(database)
        logger.info("kvpool: event_tokens=on: puts carry their chunks' token ids and parent hashes")
        return True

    def tokens(self, chunk_hashes: Sequence[Any]) -> list[ChunkTokens | None]:
        """Each chunk's tokens (None: none, counted); nothing at all when the option is off."""
        if not self.enabled:
            return [None] * len(chunk_hashes)
        if not self.ensure():
            self.counters[ConnectorCounter.EVENT_TOKENS_NO_DATABASE] += len(chunk_hashes)
            return [None] * len(chunk_hashes)
        assert self._records is not None
        out = [self._records.get(h) for h in chunk_hashes]
        unbound = out.count(None)
        self.counters[ConnectorCounter.EVENT_TOKENS_UNBOUND] += unbound
        self.counters[ConnectorCounter.EVENT_TOKENS_BOUND] += len(out) - unbound
        return out


def _nbytes(tokens: ChunkTokens) -> int:
    return 4 * len(tokens.token_ids)


def _holds(connection: Any, connector: object) -> bool:
    for _ in range(_UNWRAP_DEPTH):
        if connection is connector:
            return True
        connection = getattr(connection, "_connector", None)
        if connection is None:
            return False
    return False


def _find_database(connector: object) -> tuple[Any, str]:
    """The token database of the engine whose remote backend holds ``connector``; (None, why) if none."""
    try:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.token_database import ChunkedTokenDatabase
    except ImportError as exc:  # pragma: no cover - the connector imports lmcache already
        return None, f"LMCache's engine cannot be imported ({exc})"
    for engine in list(LMCacheEngineBuilder._instances.values()):
        manager = getattr(engine, "storage_manager", None)
        backends = getattr(manager, "storage_backends", None) or {}
        if not any(_holds(getattr(b, "connection", None), connector) for b in list(backends.values())):
            continue
        database = getattr(engine, "token_database", None)
        if not isinstance(database, ChunkedTokenDatabase):
            return None, f"its engine's token database is a {type(database).__name__}, not a ChunkedTokenDatabase"
        return database, ""
    return None, "no LMCache engine in this process holds this connector (LMCacheEngineBuilder lists none)"
