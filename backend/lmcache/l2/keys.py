"""How an L2 ``ObjectKey`` becomes a pool key and back (docs/design.md, "Key mapping").

``ObjectKey`` -> ``mp:SALT@MODEL@0xKVRANK@GROUP@HASH``. ``@`` cannot occur in a salt
or model name, so the mapping is injective and the salt is a prefix (one salt's keys are
one SCAN pattern). In-process keys (``MODEL@WS@WORKER@HASH@DTYPE``) never take this shape:
their third field is a decimal worker id, never ``0x...``.

A tenant's key carries ``~t/NAME/`` in front (``backend/tenants.py``): the URL's ``tenant=``
for every key, or with ``tenant_from_salt=on`` the key's own salt (:class:`SaltNames`). The
reverse mapping and the listing patterns take both shapes; :func:`salt_pattern` names the tenant
a salt's keys are stored under (:meth:`SaltNames.pattern`: as an adapter stores them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from lmcache.v1.distributed.api import ObjectKey

from backend.client.index import glob_escape
from backend.config import PoolConfig
from backend.counters import L2Counter
from backend.errors import ConfigError
from backend.lmcache.tenant_names import TenantNames
from backend.tenants import check_tenant, is_tenant, scoped, tenant_of, unscoped

__all__ = [
    "MP_KEY_PREFIX",
    "SaltNames",
    "pool_key",
    "object_key_from_pool_key",
    "salt_pattern",
    "listing_pattern",
]

MP_KEY_PREFIX = "mp:"


def pool_key(key: ObjectKey) -> str:
    """The pool key of an L2 object key; salts and models are ``@``-free, so it is injective."""
    return (
        f"{MP_KEY_PREFIX}{key.cache_salt}@{key.model_name}@{key.kv_rank:#010x}"
        f"@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    )


class SaltNames:
    """The pool names of an adapter's keys: ``tenant_from_salt=on`` scopes each by its salt (an empty salt by the
    URL's tenant, or none), refusing a salt that is no tenant name; otherwise the client scopes them."""

    def __init__(self, config: PoolConfig, counters: Counter[str]) -> None:
        source = "the cache_salt (tenant_from_salt=on)"
        self.tenants = TenantNames(config.tenant, counters, L2Counter.TENANT_REFUSED, source)
        self.from_salt = config.tenant_from_salt

    def names(self, keys: Sequence[ObjectKey]) -> list[str | None]:
        """Each key's name for the adapter's client; None for a key refused (its salt names no tenant)."""
        if not self.from_salt:
            return [pool_key(key) for key in keys]
        return [self.tenants.name(key.cache_salt or None, pool_key(key)) for key in keys]

    def stored(self, name: str) -> str:
        """A name :meth:`names` gave, as the index and the nodes hold it (the client's scoping added)."""
        fallback = self.tenants.fallback
        return scoped(fallback, name) if fallback and not self.from_salt else name

    def pattern(self, cache_salt: str, model_name: str | None = None) -> str:
        """A SCAN glob matching every key of ``cache_salt`` (and model) as this adapter stores them: under the
        salt with ``tenant_from_salt=on`` (an empty salt: the URL's tenant), else under the URL's tenant or none.
        ConfigError naming ``cache_salt`` for a salt that ``tenant_from_salt=on`` refuses (no key of it is stored)."""
        tenant = self.tenants.fallback
        if self.from_salt and cache_salt:
            if not is_tenant(cache_salt):
                raise ConfigError(
                    "cache_salt",
                    f"{cache_salt[:80]!r} is not a tenant name: with tenant_from_salt=on no key of it is stored",
                )
            tenant = cache_salt
        return salt_pattern(cache_salt, model_name, tenant=tenant)

    def own(self, stored: str) -> ObjectKey | None:
        """The object key of a stored pool key that this adapter stores under that very name (its tenant's, or
        its salt's); None for another tenant's key or another shape. Counts and says no refusal."""
        key = object_key_from_pool_key(stored)
        if key is None or (self.from_salt and key.cache_salt and not is_tenant(key.cache_salt)):
            return None
        (name,) = self.names([key])
        return key if name is not None and self.stored(name) == stored else None


def object_key_from_pool_key(text: str) -> ObjectKey | None:
    """Reverse :func:`pool_key`, a tenant's key too; None for keys of another shape (in-process keys)."""
    tenant = tenant_of(text)
    if tenant is not None:
        text = unscoped(tenant, text)
    if not text.startswith(MP_KEY_PREFIX):
        return None
    parts = text[len(MP_KEY_PREFIX) :].split("@")
    if len(parts) != 5 or not parts[2].startswith("0x"):
        return None
    salt, model, kv_rank, group, chunk_hash = parts
    try:
        return ObjectKey(bytes.fromhex(chunk_hash), model, int(kv_rank, 16), int(group, 16), salt)
    except ValueError:
        return None


def salt_pattern(cache_salt: str, model_name: str | None = None, *, tenant: str = "") -> str:
    """A SCAN glob matching every pool key of one salt (and model) stored under ``tenant`` ("": the keys of no
    tenant, ``mp:SALT@...``). An adapter with ``tenant_from_salt=on`` stores a salt's keys under the salt
    itself, ``~t/SALT/mp:SALT@...`` (``tenant=SALT``); one whose URL says ``tenant=NAME``, under ``NAME``.
    :meth:`SaltNames.pattern` picks the tenant as an adapter stores the salt. ConfigError naming ``tenant`` for a
    name that is no tenant name."""
    model = glob_escape(model_name) if model_name is not None else "*"
    scope = glob_escape(scoped(check_tenant(tenant, "tenant"), "")) if tenant else ""
    return f"{scope}{glob_escape(MP_KEY_PREFIX + cache_salt)}@{model}@*"


def listing_pattern(model_name: str | None = None) -> str:
    """A SCAN glob matching every multiprocess-mode key (of one model), tenants' (``~t/NAME/mp:...``) too; it
    may match other keys holding ``mp:``: :func:`object_key_from_pool_key` tells them apart (None)."""
    return "*" + glob_escape(MP_KEY_PREFIX) + "*" + (f"@{glob_escape(model_name)}@*" if model_name else "")
