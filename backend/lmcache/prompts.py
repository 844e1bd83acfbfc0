"""A prompt's chunks in the pool: LMCache's keys of its token ids, and pinning them (docs/fleet.md).

LMCache names the chunks of a prompt with its ``ChunkedTokenDatabase``: the tokens cut in
``chunk_size`` pieces (a last piece shorter than that gets a key only with
``save_unfull_chunk``), each piece's hash chained on the hashes before it, and each
hash made a ``CacheEngineKey`` of the engine's model, world size, worker and KV dtype
(in layerwise mode, one key a layer). :class:`PromptKeys` builds that same class from the
engine's own config and metadata, so its keys are the ones the engine stored: nothing of
the hashing is copied here.

:func:`pin_prompt` pins the chunks the pool holds from the start of the prompt up to the
first missing one, as a lookup would find them (a chunk after a gap could never be
read: LMCache loads a prefix), on every node holding a copy (``kvpool pin``'s path,
``backend.admin.pinning``). A tenant's client pins its own keys (``~t/NAME/KEY``); a client
whose keys name their tenant one by one (the connector under ``tenant_tag=``) or of no tenant
(an operator's) pins the tenant its caller names (:func:`prompt_tenant`). The pins count
against that tenant's quota on each node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.admin import DEFAULT_PIN_OWNER, UnpinReport, pin, unpin
from backend.client import PoolClient
from backend.errors import ConfigError, NodeUnavailable
from backend.tenants import check_tenant, scoped

__all__ = [
    "PromptChunks",
    "PromptKeys",
    "PromptPin",
    "PromptPins",
    "engine_prompt_keys",
    "pin_prompt",
    "prompt_tenant",
    "read_tokens",
    "unpin_prompt",
]

# LMCache logs the whole config it read at INFO (the pool URL and its secrets), and the token database its setup.
LOADER_LOGGERS = ("lmcache.v1.config", "lmcache.v1.config_base", "lmcache.v1.token_database")
PromptChunks = list[list[str]]  # each keyed chunk's pool keys, in prompt order


@dataclass(frozen=True)
class PromptPin:
    """What :func:`pin_prompt` did: the prompt's chunks with a key, how many from its start are pinned (the
    pool's hit prefix), the pool keys pinned (one a chunk, or one a layer in layerwise mode), the copies
    pinned on ``nodes``, and the ttl the nodes applied (None: no expiry)."""

    chunks: int
    pinned_chunks: int
    keys: int
    copies: int
    nodes: tuple[str, ...]
    owner: str
    ttl_s: float | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PromptKeys:
    """The pool keys of a prompt's chunks, made by LMCache's own ``ChunkedTokenDatabase`` for one engine."""

    def __init__(self, config: Any, metadata: Any) -> None:
        """``config``: the engine's ``LMCacheEngineConfig``; ``metadata``: its ``LMCacheMetadata``."""
        if getattr(config, "enable_blending", False):
            raise ConfigError(
                "enable_blending", "a blending engine names chunks by segments, not by token prefix: not supported"
            )
        from lmcache.v1.token_database import ChunkedTokenDatabase  # LMCache's users pay for its import

        self._tokens = ChunkedTokenDatabase(config, metadata)
        self.chunk_tokens = int(config.chunk_size)
        # LMCache's layerwise engines store a chunk as one key a layer and count it a hit only if all are held.
        self.keys_per_chunk = int(metadata.kv_shape[0]) if getattr(config, "use_layerwise", False) else 1

    def chunks(self, tokens: Sequence[int] | Any) -> PromptChunks:
        """Each keyed chunk's pool keys, in prompt order (``tokens``: token ids, a list or a 1-D tensor)."""
        out: PromptChunks = []
        for _start, _end, key in self._tokens.process_tokens(tokens=tokens):
            if self.keys_per_chunk > 1:
                out.append([layer.to_string() for layer in key.split_layers(self.keys_per_chunk)])
            else:
                out.append([key.to_string()])
        return out


async def prompt_tenant(client: PoolClient, named: str | None, default: str = "") -> str:
    """The tenant whose chunks of a prompt ``client`` pins ("": no tenant's): ``named``, or when None ``default``
    (the URL's tenant: ``client``'s own, or for a connector under ``tenant_tag=`` its URL's ``tenant``).

    ConfigError naming ``tenant``, before anything is pinned, when ``named`` is no tenant name; when ``client``
    has a tenant of its own (its URL's ``tenant=`` scopes every key it names) and ``named`` is another; and when
    ``named`` is not the URL's tenant while ``client``'s connections proved a tenant's token (a live node says
    so in the handshake: such a connection touches only that tenant's keys)."""
    url_tenant = client.config.tenant or default
    if named is None or named == url_tenant:
        return url_tenant
    check_tenant(named, "tenant")
    if client.config.tenant:
        raise ConfigError(
            "tenant",
            f"this client is tenant {url_tenant}'s (tenant={url_tenant} in its pool URL, no tenant_tag): every key "
            f"it names is {url_tenant}'s, so it cannot pin tenant {named}'s chunks",
        )
    bound = await _bound_tenant(client)
    if bound is not None:
        raise ConfigError(
            "tenant",
            f"this client's connections proved tenant {bound}'s token: it pins only the chunks of its URL's tenant "
            f"({url_tenant or 'none'}), not tenant {named}'s (the nodes would refuse them)",
        )
    return named


async def _bound_tenant(client: PoolClient) -> str | None:
    """The tenant whose token ``client``'s connections proved, as the first live node that answers says (None: the
    pool token, no token, or no node answered, when the pin cannot reach a node either)."""
    if not client.config.token:
        return None
    for node in await client.nodes(refresh=False):
        try:
            return await client.node_admin.bound_tenant(node)
        except NodeUnavailable:
            continue
    return None


def _named(client: PoolClient, tenant: str, keys: Sequence[str]) -> list[str]:
    """``keys`` of ``tenant``'s chunks as ``client`` names them (a client with a tenant scopes them itself)."""
    return [scoped(tenant, key) for key in keys] if tenant and not client.config.tenant else list(keys)


def _stored(client: PoolClient, tenant: str, keys: Sequence[str]) -> list[str]:
    """``keys`` of ``tenant``'s chunks as the nodes hold them: the operator's pin verbs name them so."""
    return [scoped(tenant, key) for key in keys] if tenant else list(keys)


async def pin_prompt(
    client: PoolClient,
    chunks: Sequence[Sequence[str]],
    *,
    ttl_s: float | None = None,
    owner: str = DEFAULT_PIN_OWNER,
    tenant: str | None = None,
    default_tenant: str = "",
) -> PromptPin:
    """Pin the chunks of a prompt (:meth:`PromptKeys.chunks`) that the pool holds from its start up to the first
    missing one: ``tenant``'s chunks (None: the URL's tenant's, or ``default_tenant``'s; :func:`prompt_tenant`).
    ConfigError, nothing pinned, when there is no keyed chunk, the pool holds not even the first, or the tenant
    is refused; a node refusing the ttl or the owner fails it with the node's reason."""
    if not chunks:
        raise ConfigError("tokens", "the prompt has no chunk with a key (fewer tokens than LMCache's chunk_size)")
    tenant = await prompt_tenant(client, tenant, default_tenant)
    flat = [key for chunk in chunks for key in chunk]
    per_chunk = len(chunks[0])
    found = (
        await client.hit_prefix(_named(client, tenant, flat)) // per_chunk
    )  # a chunk counts only with all its keys (layerwise)
    if not found:
        raise ConfigError(
            "tokens", f"the pool holds none of the prompt's {len(chunks)} chunks (not even the first): nothing pinned"
        )
    keys = _stored(client, tenant, flat[: found * per_chunk])
    report = await pin(client, keys, owner=owner, ttl_s=ttl_s)
    return PromptPin(len(chunks), found, report.keys, report.copies, report.nodes, owner, report.ttl_s)


async def unpin_prompt(
    client: PoolClient,
    chunks: Sequence[Sequence[str]],
    *,
    owner: str = DEFAULT_PIN_OWNER,
    tenant: str | None = None,
    default_tenant: str = "",
) -> UnpinReport:
    """Let go of one of ``owner``'s pins of each of the prompt's chunks (``tenant``'s, as :func:`pin_prompt`),
    wherever a live node pins it (a pin outlives its chunk, so every chunk of the prompt is asked, held or not);
    ``not_pinned`` names the keys ``owner`` pinned nowhere."""
    if not chunks:
        raise ConfigError("tokens", "the prompt has no chunk with a key (fewer tokens than LMCache's chunk_size)")
    tenant = await prompt_tenant(client, tenant, default_tenant)
    return await unpin(client, _stored(client, tenant, [key for chunk in chunks for key in chunk]), owner=owner)


class PromptPins:
    """Pins of prompts by their token ids for one engine (what the connector's ``pin_prompt`` runs): the
    engine's :class:`PromptKeys`, made on first use, over the connector's client."""

    def __init__(self, client: PoolClient, config: Any, metadata: Any, tenant: str = "") -> None:
        """``tenant``: the URL's tenant, for a client without one (the connector's under ``tenant_tag=``): whose
        chunks are pinned when the caller names none."""
        self._client = client
        self._engine = (config, metadata)
        self._keys: PromptKeys | None = None
        self._tenant = tenant

    def keys(self, tokens: Sequence[int] | Any) -> PromptChunks:
        """The LMCache keys of the prompt's chunks, as this engine's LMCache names them."""
        if self._keys is None:
            self._keys = PromptKeys(*self._engine)
        return self._keys.chunks(tokens)

    async def pin(
        self, tokens: Sequence[int] | Any, ttl_s: float | None, owner: str, tenant: str | None = None
    ) -> PromptPin:
        chunks = self.keys(tokens)
        return await pin_prompt(
            self._client, chunks, ttl_s=ttl_s, owner=owner, tenant=tenant, default_tenant=self._tenant
        )

    async def unpin(self, tokens: Sequence[int] | Any, owner: str, tenant: str | None = None) -> UnpinReport:
        chunks = self.keys(tokens)
        return await unpin_prompt(self._client, chunks, owner=owner, tenant=tenant, default_tenant=self._tenant)


def engine_prompt_keys(
    config_file: Path, model: str, world_size: int = 1, kv_dtype: str = "bfloat16", layers: int = 0
) -> list[PromptKeys]:
    """Each worker's :class:`PromptKeys` of an engine described by its LMCache config file (read with LMCache's
    own loader, ``LMCACHE_*`` variables included, as the engine reads it) and what its keys carry: the model
    name, the world size (one worker each), the KV dtype as LMCache spells it, and in layerwise mode the
    layers. ConfigError naming the option that is wrong."""
    import lmcache.v1.token_database  # noqa: F401  (its logger is set up on import: before it is quieted)
    from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE
    from lmcache.v1.config import load_engine_config_with_overrides
    from lmcache.v1.metadata import LMCacheMetadata

    if not config_file.is_file():
        raise ConfigError("--lmcache-config", f"{config_file} is not a file")
    if world_size < 1:
        raise ConfigError("--world-size", f"{world_size} is not a number of workers >= 1")
    dtype = STR_DTYPE_TO_TORCH_DTYPE.get(kv_dtype)
    if dtype is None:
        raise ConfigError(
            "--kv-dtype", f"{kv_dtype!r} is none of LMCache's: {', '.join(sorted(STR_DTYPE_TO_TORCH_DTYPE))}"
        )
    with _quiet(LOADER_LOGGERS):
        config = load_engine_config_with_overrides(config_file_path=str(config_file))
        if getattr(config, "use_layerwise", False) and layers < 1:
            raise ConfigError(
                "--layers", "the config is layerwise (use_layerwise): its keys name a layer, give the layers"
            )
        return [
            PromptKeys(
                config,
                LMCacheMetadata(
                    model_name=model,
                    world_size=world_size,
                    local_world_size=world_size,
                    worker_id=worker,
                    local_worker_id=worker,
                    kv_dtype=dtype,
                    kv_shape=(max(layers, 1), 2, int(config.chunk_size), 1, 1),  # only the layers name keys
                ),
            )
            for worker in range(world_size)
        ]


@contextlib.contextmanager
def _quiet(names: Sequence[str]) -> Iterator[None]:
    """LMCache's loggers ``names`` at WARNING while the block runs (they print to stderr at INFO)."""
    loggers = [logging.getLogger(name) for name in names]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, before):
            logger.setLevel(level)


def read_tokens(path: Path) -> list[int]:
    """A prompt's token ids from a file: a JSON list of integers, or integers separated by white space or
    commas. ConfigError naming the file for anything else."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("--tokens-file", f"{path} cannot be read: {exc.strerror or exc}") from None
    words = text.strip().removeprefix("[").removesuffix("]").replace(",", " ").split()
    try:
        tokens = [int(word) for word in words]
    except ValueError:
        bad = next(w for w in words if not w.lstrip("-").isdigit())
        raise ConfigError("--tokens-file", f"{path}: {bad[:40]!r} is not a token id (integers only)") from None
    if not tokens or min(tokens) < 0:
        raise ConfigError("--tokens-file", f"{path} holds no token ids" if not tokens else f"{path}: a negative id")
    return tokens
