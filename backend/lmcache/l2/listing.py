"""``list_l2_keys``: the adapter's keys in the pool, one page per call, with an opaque resumable cursor.

The cursor is ``"<SCAN cursor>:<keys of that SCAN step already returned>"``, so a page
that ends inside one SCAN step resumes there without returning a key twice.
"""

from __future__ import annotations

from lmcache.v1.distributed.api import EncodedObjectKey, KeyEntry, KeyListPage

from backend.client import PoolClient
from backend.errors import ConfigError
from backend.lmcache.l2.keys import SaltNames, listing_pattern

__all__ = ["list_page", "parse_cursor", "check_page_size"]

MIN_SCAN_COUNT = 100  # SCAN's COUNT hint for small pages


def check_page_size(page_size: object) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ConfigError("page_size", f"must be a positive integer, got {page_size!r}")
    return page_size


def parse_cursor(cursor: str | None) -> tuple[int, int]:
    """``(SCAN cursor, keys to skip)`` of a cursor this adapter returned; ConfigError for anything else."""
    if cursor is None:
        return 0, 0
    try:
        scan, skip = (int(part) for part in cursor.split(":"))
    except ValueError:
        raise ConfigError("cursor", f"{cursor!r} is not a cursor this adapter returned") from None
    if scan < 0 or skip < 0:
        raise ConfigError("cursor", f"{cursor!r} is not a cursor this adapter returned")
    return scan, skip


async def list_page(
    client: PoolClient, namer: SaltNames, model_name: str | None, page_size: int, scan_cursor: int, skip: int
) -> KeyListPage:
    """One page of this adapter's multiprocess-mode keys (of ``model_name``: those ``namer`` would store so, of
    its tenants) that the index still locates, from a parsed cursor."""
    pattern = listing_pattern(model_name)
    names: list[str] = []
    token: str | None = None
    while True:
        next_cursor, found = await client.index.scan_step(scan_cursor, pattern, count=max(page_size, MIN_SCAN_COUNT))
        batch = found[skip:]
        room = page_size - len(names)
        names.extend(batch[:room])
        if len(batch) > room:  # resume inside this SCAN step next time
            token = f"{scan_cursor}:{skip + room}"
            break
        scan_cursor, skip = int(next_cursor), 0
        if scan_cursor == 0:
            break
        if len(names) >= page_size:
            token = f"{scan_cursor}:0"
            break
    entries = await client.index.lookup(names) if names else []
    out: list[KeyEntry] = []
    for name, entry in zip(names, entries):
        key = namer.own(name)
        if key is not None and entry:
            out.append(
                KeyEntry(
                    EncodedObjectKey(
                        key.chunk_hash.hex(), key.model_name, key.kv_rank, key.object_group_id, key.cache_salt
                    ),
                    entry[0].nbytes,
                )
            )
    return KeyListPage(tuple(out), token)
