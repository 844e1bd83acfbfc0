"""Tenants: a tenant's keys carry its name in front, so the index and the nodes keep them apart.

A client of a tenant (``tenant=NAME`` in the pool URL) stores, reads, leases and deletes
``~t/NAME/<key>`` where its caller said ``<key>``: another tenant's same key is another
key everywhere (a node's table, the Redis index, an NVMe file), so no tenant reads,
overwrites or deletes another's chunk, whatever key it names. The node learns a chunk's
tenant from its key alone (:func:`tenant_of`: a ``startswith`` and a ``find``), so a chunk
keeps no field for it; a key without the prefix belongs to no tenant (quotas never apply).

The prefix costs ``len(name) + 4`` bytes a chunk in the node's key string and in the
index key's name in Redis (docs/fleet.md, "Tenants and quotas").

Who names the tenant: the client's URL (``tenant=``, every key), or per key the LMCache
layer (``backend/lmcache/tenant_names.py``: a request tag, or a multiprocess key's salt).

Pure: no I/O; only the errors of ``backend``.
"""

from __future__ import annotations

import re

from backend.errors import ConfigError

__all__ = [
    "MAX_TENANT_CHARS",
    "TENANT_PREFIX",
    "check_tag_name",
    "check_tenant",
    "is_tenant",
    "scoped",
    "tenant_of",
    "unscoped",
]

TENANT_PREFIX = "~t/"  # a key of a tenant starts so; then the name, then "/"
MAX_TENANT_CHARS = 64
_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")  # MAX_TENANT_CHARS


def check_tenant(name: str, option: str = "tenant") -> str:
    """``name`` if it may name a tenant (1-64 of A-Z a-z 0-9 _ . -), else ConfigError naming ``option``."""
    if not isinstance(name, str) or not _TENANT_RE.match(name):
        raise ConfigError(option, f"tenant {name!r} must be 1-{MAX_TENANT_CHARS} characters of A-Z a-z 0-9 _ . -")
    return name


def is_tenant(name: object) -> bool:
    """Whether ``name`` may name a tenant (:func:`check_tenant`'s rule), without raising."""
    return isinstance(name, str) and _TENANT_RE.match(name) is not None


def check_tag_name(name: str, option: str = "tenant_tag") -> str:
    """``name`` if it may name the LMCache request tag that names the tenant (``lmcache.tag.NAME``): the
    tenant names' characters, so it never holds LMCache's key separators ``@`` and ``%``."""
    if not isinstance(name, str) or not _TENANT_RE.match(name):
        raise ConfigError(
            option, f"tag name {name!r} must be 1-{MAX_TENANT_CHARS} characters of A-Z a-z 0-9 _ . - (lmcache.tag.NAME)"
        )
    return name


def scoped(tenant: str, key: str) -> str:
    """``key`` as tenant ``tenant`` stores it (``tenant`` checked already)."""
    return f"{TENANT_PREFIX}{tenant}/{key}"


def unscoped(tenant: str, key: str) -> str:
    """The caller's key of a key :func:`scoped` made for ``tenant``."""
    return key[len(TENANT_PREFIX) + len(tenant) + 1 :]


def tenant_of(key: str) -> str | None:
    """The tenant a stored key belongs to, or None (a key of no tenant)."""
    if not key.startswith(TENANT_PREFIX):
        return None
    end = key.find("/", len(TENANT_PREFIX))
    return key[len(TENANT_PREFIX) : end] if end > len(TENANT_PREFIX) else None
