"""NodeConfig: a pool node's settings, checked together once; the options it is built from are in
:mod:`backend.config.node_options`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from backend.config.node_options import (
    CHANNELS,
    DEFAULT_DEAD_NODE_GRACE_S,
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_MAX_PENDING_CONNECTIONS,
    DEFAULT_NODE_PAIR_TIMEOUT_S,
    DEFAULT_PIN_TTL_MAX_S,
    DEFAULT_PIN_TTL_S,
    ENV_PREFAULT,
    EVICTIONS,
    node_options,
)
from backend.config.values import CLUSTER_RE, NAMESPACE_RE, check_node_id, check_token, read_secret_file
from backend.errors import ConfigError
from backend.protocol import DEFAULT_LIMITS, Limits
from backend.redis_topology import RedisTarget, mask_url
from backend.tenants import check_tenant

__all__ = ["ENV_PREFAULT", "EVICTIONS", "NodeConfig", "read_tenant_tokens"]

NEXT_SUFFIX = ".next"  # --tenant-tokens DIR/NAME.next: tenant NAME's second token, during a rotation


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Everything a pool node needs to run; checked once, here. Build with :meth:`from_sources` or directly."""

    redis_url: str
    namespace: str
    dram_bytes: int
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    advertise_port: int = 0  # 0: the port listened on; else a forwarder's (NAT, container, proxy)
    node_id: str = ""
    token: str = dataclasses.field(default="", repr=False)
    cluster: str = ""
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0  # a registry entry not renewed this long expires: the node counts as dead
    redis_timeout_s: float = 2.0  # each Redis call, its connect included (backend/metadata/connection.py)
    limits: Limits = DEFAULT_LIMITS
    nvme_dir: Path | None = None
    nvme_bytes: int = 0
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    frame_timeout_s: float = 30.0  # once a header arrived, the rest of its frame must follow
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    shm_dir: Path | None = None  # shared-memory arena for same-host clients; None: off
    prefault: bool = False  # take the DRAM arena's pages at start (the flag's default is on; see NODE_OPTIONS)
    eviction: str = "lru"  # which chunks leave a full tier first: one of EVICTIONS (backend/node/store/eviction.py)
    channel: str = "off"  # serve CHANNEL_GET over this transport: "off", "cpu" or "nccl" (nccl_channel)
    device: str = "cuda:0"  # the CUDA device of the NCCL channel
    tls_cert: Path | None = None  # PEM certificate chain: serve the node protocol over TLS only
    tls_key: Path | None = None  # its private key (PEM)
    redis_password: str = dataclasses.field(default="", repr=False)  # Redis ACL password, if not in redis_url
    redis_ca_file: str = ""  # CA bundle verifying a rediss:// Redis; empty: the system trust store
    dead_node_grace_s: float = DEFAULT_DEAD_NODE_GRACE_S  # a dead node's Redis entries go after this long
    pair_timeout_s: float = DEFAULT_NODE_PAIR_TIMEOUT_S  # deadline of one channel pairing (a cold NCCL init: seconds)
    handshake_timeout_s: float = (
        DEFAULT_HANDSHAKE_TIMEOUT_S  # from accept to admitted (backend/node/serve/admission.py)
    )
    max_pending_connections: int = DEFAULT_MAX_PENDING_CONNECTIONS  # not yet admitted; above it the oldest is closed
    token_file: str = ""  # where the token came from, if a file (so `kvpool up` can name it, never print it)
    token_next: str = dataclasses.field(default="", repr=False)  # a second pool token, during a rotation
    token_file_next: str = ""  # where it came from
    # Tenant name -> its token (--tenant-tokens DIR): a connection that proves one touches only that tenant.
    tenant_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    # Tenant name -> a second token of it (DIR/NAME.next), bound to the same tenant: during a rotation.
    tenant_tokens_next: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    tenant_tokens_dir: str = ""  # where they came from
    redis_password_file: str = ""  # likewise for redis_password
    pin_ttl_default_s: float = DEFAULT_PIN_TTL_S  # a pin's ttl when it names none; 0: no expiry (needs no cap)
    pin_ttl_max_s: float = DEFAULT_PIN_TTL_MAX_S  # the longest a pin may ask for; 0: no cap
    event_ring_keys: int = 0  # keys in the ring a `kvpool events` endpoint reads; 0: off

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ConfigError(
                "--redis", "the pool's metadata Redis is required: --redis redis://HOST:PORT (or redis: in --config)"
            )
        redis_tls = RedisTarget.parse(self.redis_url, key="--redis").tls
        if self.token_file:
            check_token(self.token, "--token-file", self.token_file)
        else:
            check_token(self.token, "KVPOOL_TOKEN", "KVPOOL_TOKEN")
        self._check_other_tokens()
        if not NAMESPACE_RE.match(self.namespace):
            raise ConfigError("--namespace", f"{self.namespace!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
        if self.node_id:
            check_node_id(self.node_id, "--node-id")
        if not CLUSTER_RE.match(self.cluster):
            raise ConfigError("--cluster", f"{self.cluster!r} must be A-Z a-z 0-9 _ . -")
        if self.dram_bytes <= 0:
            raise ConfigError("--dram", f"{self.dram_bytes} is not a positive size")
        if self.eviction not in EVICTIONS:
            raise ConfigError("--eviction", f"{self.eviction!r} is not one of {', '.join(EVICTIONS)}")
        if self.channel not in CHANNELS:
            raise ConfigError("--channel", f"{self.channel!r} is not one of {', '.join(CHANNELS)}")
        if self.channel != "off" and not self.cluster:
            raise ConfigError("--channel", "the channel serves clients of the same cluster: give --cluster NAME too")
        for flag, value in (
            ("--pair-timeout-s", self.pair_timeout_s),
            ("--dead-node-grace-s", self.dead_node_grace_s),
            ("--handshake-timeout-s", self.handshake_timeout_s),
        ):
            if value <= 0:
                raise ConfigError(flag, f"{value} is not a positive number of seconds")
        if self.pin_ttl_default_s < 0 or self.pin_ttl_max_s < 0:
            raise ConfigError("--pin-ttl-default-s", "pin ttls are numbers of seconds >= 0")
        if self.pin_ttl_max_s and not 0 < self.pin_ttl_default_s <= self.pin_ttl_max_s:
            raise ConfigError(
                "--pin-ttl-default-s",
                f"{self.pin_ttl_default_s:g} must be within the cap --pin-ttl-max-s {self.pin_ttl_max_s:g} "
                "(0, no expiry, needs --pin-ttl-max-s 0)",
            )
        if self.max_pending_connections <= 0:
            raise ConfigError("--max-pending-connections", f"{self.max_pending_connections} is not a positive number")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert", "TLS needs both --tls-cert and --tls-key")
        if self.tls_cert is not None and not redis_tls:
            # Clients reach a TLS node with tls=on, which also means rediss:// to the registry.
            raise ConfigError("--tls-cert", f"a TLS node needs a TLS Redis (rediss://), not {mask_url(self.redis_url)}")
        if self.redis_ca_file and not redis_tls:
            raise ConfigError(
                "--redis-ca", f"a CA bundle only matters for a rediss:// Redis, not {mask_url(self.redis_url)}"
            )

    def _check_other_tokens(self) -> None:
        """The rotation's second token and the tenant tokens: each a good token, none given twice, and only
        beside a pool token (a node without one accepts anyone, so a tenant token would bound nothing)."""
        if self.token_next:
            if not self.token:
                raise ConfigError("--token-file-next", "a second token is for a rotation: give --token-file too")
            check_token(self.token_next, "--token-file-next", self.token_file_next or "--token-file-next")
        if not self.tenant_tokens and not self.tenant_tokens_next:
            return
        if not self.token:
            raise ConfigError(
                "--tenant-tokens", "tenant tokens need the pool token (--token-file): a node without one accepts anyone"
            )
        seen = {self.token: "the pool token"}
        if self.token_next:
            seen[self.token_next] = "the pool token of --token-file-next"
        where = self.tenant_tokens_dir or "--tenant-tokens"
        tokens = [(name, token, name, "token") for name, token in self.tenant_tokens.items()]
        tokens += [
            (name, token, f"{name}{NEXT_SUFFIX}", "next token") for name, token in self.tenant_tokens_next.items()
        ]
        for name, token, file, what in sorted(tokens):
            check_tenant(name, "--tenant-tokens")
            if name not in self.tenant_tokens:
                raise ConfigError(
                    "--tenant-tokens",
                    f"{where}/{file} is tenant {name}'s next token (a rotation), but {where}/{name} is missing: "
                    f"write the current token there (a tenant named {file} can have no token file)",
                )
            check_token(token, "--tenant-tokens", f"{where}/{file}")
            if token in seen:
                raise ConfigError(
                    "--tenant-tokens",
                    f"tenant {name}'s {what} is also {seen[token]} ({where}/{file}): every token must name one "
                    "tenant (or the pool), and a rotation's two tokens must differ",
                )
            seen[token] = f"tenant {name}'s {what}"

    @classmethod
    def from_sources(
        cls,
        flags: Mapping[str, Any],
        *,
        config_file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> NodeConfig:
        """Flags, environment and YAML file through :data:`NODE_OPTIONS` (see :func:`node_options`)."""
        return cls.from_options(node_options(flags, config_file=config_file, environ=environ, defaults=defaults))

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> NodeConfig:
        """Build from parsed option values (:func:`node_options`); reads the secret files it names."""
        token, token_file = values["token"], values["token_file"]
        if token_file is not None:
            token = _read_node_secret(token_file, "--token-file")
        token_file_next = values["token_file_next"]
        token_next = _read_node_secret(token_file_next, "--token-file-next") if token_file_next is not None else ""
        tenants_dir = values["tenant_tokens"]
        tenant_tokens, tenant_tokens_next = read_tenant_tokens(tenants_dir) if tenants_dir is not None else ({}, {})
        password, password_file = values["redis_password"], values["redis_password_file"]
        if password_file is not None:
            password = _read_node_secret(password_file, "--redis-password-file")
        nvme_bytes = values["nvme"] if values["nvme_dir"] is not None else 0
        advertise_host, advertise_port = values["advertise"]
        return cls(
            redis_url=values["redis"] or "",
            namespace=values["namespace"],
            dram_bytes=values["dram"],
            nvme_dir=values["nvme_dir"] if nvme_bytes else None,
            nvme_bytes=nvme_bytes,
            host=values["host"],
            port=values["port"],
            advertise_host=advertise_host,
            advertise_port=advertise_port,
            node_id=values["node_id"],
            token=token,
            cluster=values["cluster"],
            metrics_host=values["metrics_host"],
            metrics_port=values["metrics_port"],
            shm_dir=values["shm_dir"],
            prefault=values["prefault"],
            eviction=values["eviction"],
            channel=values["channel"],
            device=values["device"],
            tls_cert=values["tls_cert"],
            tls_key=values["tls_key"],
            redis_password=password,
            redis_ca_file=str(values["redis_ca"] or ""),
            pair_timeout_s=values["pair_timeout_s"],
            dead_node_grace_s=values["dead_node_grace_s"],
            handshake_timeout_s=values["handshake_timeout_s"],
            max_pending_connections=values["max_pending_connections"],
            pin_ttl_default_s=values["pin_ttl_default_s"],
            pin_ttl_max_s=values["pin_ttl_max_s"],
            event_ring_keys=values["event_ring_keys"],
            token_file=str(token_file.resolve()) if token_file is not None else "",
            token_next=token_next,
            token_file_next=str(token_file_next.resolve()) if token_file_next is not None else "",
            tenant_tokens=tenant_tokens,
            tenant_tokens_next=tenant_tokens_next,
            tenant_tokens_dir=str(tenants_dir.resolve()) if tenants_dir is not None else "",
            redis_password_file=str(password_file.resolve()) if password_file is not None else "",
        )


def _read_node_secret(path: Path, flag: str) -> str:
    why = "; a node without a token accepts anyone" if flag == "--token-file" else ""
    return read_secret_file(path, flag, if_empty=why)


def read_tenant_tokens(directory: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Tenant name -> token, and tenant name -> next token, from ``directory`` (--tenant-tokens): the file NAME
    holds tenant NAME's token, the file NAME.next a second one of the same tenant, during a rotation.

    Names starting with ``.`` are skipped (a Kubernetes secret volume keeps its ``..data`` links
    there); any other name must be a tenant name, or one with ``.next`` after it; a NAME.next
    without its NAME is refused (``NodeConfig``). ConfigError naming the flag and the file otherwise.
    """
    flag = "--tenant-tokens"
    try:
        names = sorted(entry.name for entry in os.scandir(directory) if not entry.name.startswith("."))
    except OSError as exc:
        raise ConfigError(flag, f"cannot list {directory}: {exc.strerror}") from None
    tokens: dict[str, str] = {}
    next_tokens: dict[str, str] = {}
    for name in names:
        tenant = name.removesuffix(NEXT_SUFFIX)
        check_tenant(tenant, f"{flag} ({directory}/{name})")
        token = read_secret_file(directory / name, f"{flag} ({directory}/{name})")
        (next_tokens if name.endswith(NEXT_SUFFIX) else tokens)[tenant] = token
    if not tokens and not next_tokens:
        raise ConfigError(flag, f"{directory} holds no tenant token (a file NAME holding tenant NAME's token)")
    return tokens, next_tokens
