"""The tenant of each key, when the LMCache layer names it per key (docs/fleet.md, "Naming the tenant").

A client of ``tenant=NAME`` scopes every key it is given (``backend/tenants.py``): one engine, one
tenant. Here one engine serves many: each key names its own tenant,

* for the connector (``tenant_tag=TAG`` in the pool URL), by the value of its request tag
  ``lmcache.tag.TAG`` (vLLM hands a request's ``kv_transfer_params`` entries ``lmcache.tag.*`` to
  LMCache, which keeps them in the key: :class:`TagNames`);
* for the multiprocess-mode adapter (``tenant_from_salt=on``), by its ``cache_salt``
  (``backend.lmcache.l2.keys.SaltNames``).

A key that names none (no such tag, an empty salt) is the URL's ``tenant``'s, or no tenant's
when the URL gives none. A value that is not a tenant name names no pool key at all: that key's
put is refused, its lookup and get are misses, counted in ``tenant_refused`` and said in one
warning per value (:class:`TenantNames`); it is never stored under another name. The client
under these names has no ``tenant`` of its own: the names come scoped already.

The tag is not stored twice: the prefix ``~t/VALUE/`` says it, so the pool key is the LMCache
key without its ``@TAG%VALUE`` (a tagged key and the same key without the tag, in an engine whose
URL names that tenant, are one chunk). :meth:`TagNames.listed` puts it back for ``list()``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

from backend.config import PoolConfig
from backend.counters import ConnectorCounter
from backend.tenants import is_tenant, scoped, tenant_of, unscoped

__all__ = ["KeyNames", "PlainNames", "TagNames", "TenantNames", "TAG_PREFIX", "key_names"]

logger = logging.getLogger(__name__)

TAG_PREFIX = "lmcache.tag."  # LMCache keeps a request's kv_transfer_params entries named so in its keys
MAX_SAID_VALUES = 256  # distinct refused values warned about, then only counted: a flood of bad tags logs no flood
MAX_SHOWN_CHARS = 80  # of a refused value, in its warning


class TenantNames:
    """Pool names of keys each naming its tenant: scoped by it, by ``fallback`` when it names none, or refused."""

    def __init__(self, fallback: str, counters: Counter[str], counter: str, source: str) -> None:
        """``fallback``: the URL's tenant ("" for none); ``counter``: the refusals' counter in ``counters``;
        ``source``: what names the tenant, for the warning."""
        self.fallback = fallback
        self.counters = counters
        self.counter = counter
        self.source = source
        self._said: set[str] = set()

    def name(self, value: object, key: str) -> str | None:
        """``key`` as the pool stores it for the tenant ``value`` names (None: it names none); None if refused."""
        if value is None:
            return scoped(self.fallback, key) if self.fallback else key
        if not is_tenant(value):
            self.refuse(value)
            return None
        return scoped(str(value), key)

    def refuse(self, value: object) -> None:
        self.counters[self.counter] += 1
        shown = repr(value)[:MAX_SHOWN_CHARS]
        if shown in self._said or len(self._said) >= MAX_SAID_VALUES:
            return
        self._said.add(shown)
        logger.warning(
            "kvpool: %s %s is not a tenant name (1-64 of A-Z a-z 0-9 _ . -): the keys naming it are not stored "
            "and read as misses (counted in tenant_refused)",
            self.source,
            shown,
        )


class _Names:
    def names(self, keys: Sequence[Any]) -> list[str | None]:
        raise NotImplementedError

    def prefix(self, keys: Sequence[Any]) -> list[str]:
        """The pool names of ``keys`` up to the first refused one (a lookup: LMCache loads a prefix)."""
        names = self.names(keys)
        end = names.index(None) if None in names else len(names)
        return cast(list[str], names[:end])


class PlainNames(_Names):
    """The pool names of an engine without per-key tenants: LMCache's key strings (the client scopes them)."""

    def names(self, keys: Sequence[Any]) -> list[str | None]:
        return [key.to_string() for key in keys]

    def listed(self, stored: str) -> str:
        return stored


class TagNames(_Names):
    """The pool names of an engine whose keys name their tenant by the request tag ``lmcache.tag.<tag>``."""

    def __init__(self, tag: str, fallback: str, counters: Counter[str]) -> None:
        self.tag = tag
        self.tenants = TenantNames(
            fallback, counters, ConnectorCounter.TENANT_REFUSED, f"the request tag {TAG_PREFIX}{tag}"
        )

    def names(self, keys: Sequence[Any]) -> list[str | None]:
        """Each ``CacheEngineKey``'s pool name (None: refused, its tag names no tenant)."""
        return [self._name(key) for key in keys]

    def _name(self, key: Any) -> str | None:
        text: str = key.to_string()
        tags: tuple[tuple[str, Any], ...] = key.tags or ()
        value = next((v for k, v in tags if k == self.tag), None)
        if value is None:
            return self.tenants.name(None, text)
        if not isinstance(value, str):
            return self.tenants.name(value, text)  # refused: a tenant is named by a string
        # to_string() ends "@" + "@".join(f"{k}%{v}" for each tag) (LMCache 0.5.6, layer keys too): rebuild that
        # tail without ours. A key of another shape keeps its whole string (the tag then stored twice, still right).
        tail = "@" + "@".join(f"{k}%{v}" for k, v in tags)
        if not text.endswith(tail):
            return self.tenants.name(value, text)
        others = "".join(f"@{k}%{v}" for k, v in tags if k != self.tag)
        return self.tenants.name(value, text[: len(text) - len(tail)] + others)

    def listed(self, stored: str) -> str:
        """A stored name as LMCache names the key: its tenant back in the tag (at the end of the tags)."""
        tenant = tenant_of(stored)
        return stored if tenant is None else f"{unscoped(tenant, stored)}@{self.tag}%{tenant}"


KeyNames = PlainNames | TagNames


def key_names(config: PoolConfig, counters: Counter[str]) -> KeyNames:
    """How the connector of ``config`` names its keys in the pool."""
    if config.tenant_tag:
        return TagNames(config.tenant_tag, config.tenant, counters)
    return PlainNames()
