"""How an L2 ``ObjectKey`` becomes a pool key and back (docs/design.md, "Key mapping").

``ObjectKey`` -> ``mp:SALT@MODEL@0xKVRANK@GROUP@HASH``. ``@`` cannot occur in a salt
or model name, so the mapping is injective and the salt is a prefix (per-salt usage
is one SCAN). In-process keys (``MODEL@WS@WORKER@HASH@DTYPE``) never take this shape:
their third field is a decimal worker id, never ``0x...``.
"""

from __future__ import annotations

from lmcache.v1.distributed.api import ObjectKey

from backend.client.index import glob_escape

__all__ = ["MP_KEY_PREFIX", "pool_key", "object_key_from_pool_key", "salt_pattern", "listing_pattern"]

MP_KEY_PREFIX = "mp:"


def pool_key(key: ObjectKey) -> str:
    """The pool key of an L2 object key; salts and models are ``@``-free, so it is injective."""
    return (
        f"{MP_KEY_PREFIX}{key.cache_salt}@{key.model_name}@{key.kv_rank:#010x}"
        f"@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    )


def object_key_from_pool_key(text: str) -> ObjectKey | None:
    """Reverse :func:`pool_key`; None for keys of another shape (in-process keys)."""
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


def salt_pattern(cache_salt: str, model_name: str | None = None) -> str:
    """A SCAN glob matching every pool key of one salt (and model)."""
    model = glob_escape(model_name) if model_name is not None else "*"
    return f"{glob_escape(MP_KEY_PREFIX + cache_salt)}@{model}@*"


def listing_pattern(model_name: str | None = None) -> str:
    """A SCAN glob matching every multiprocess-mode key (of one model)."""
    return glob_escape(MP_KEY_PREFIX) + "*" + (f"@{glob_escape(model_name)}@*" if model_name else "")
