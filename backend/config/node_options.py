"""A pool node's options: one table, :data:`NODE_OPTIONS`, that makes its flags, YAML keys and variables.

:func:`node_options` reads each option from the first source that gives it (flag, environment,
YAML file, default) and parses it on its own; :class:`backend.config.node.NodeConfig` then
checks them together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from backend.config.node_parsers import (
    DEFAULT_SHM_DIR,
    choice,
    int_in,
    named,
    node_id_value,
    optional,
    parse_advertise,
    path_value,
    redis_value,
    seconds_or_zero_value,
    seconds_value,
    shm_dir_value,
    size_value,
    switch,
    text_value,
)
from backend.config.pool import DEFAULT_NAMESPACE, check_env
from backend.config.suggest import did_you_mean
from backend.config.values import CLUSTER_RE, NAMESPACE_RE, NODE_ID_RULE, parse_size
from backend.errors import ConfigError

__all__ = [
    "CHANNELS",
    "ENV_PREFAULT",
    "EVICTIONS",
    "NodeOption",
    "NODE_OPTIONS",
    "NODE_OPTION_NAMES",
    "NODE_VERB_DEFAULTS",
    "REDIS_HELP",
    "node_options",
]

DEFAULT_NODE_PAIR_TIMEOUT_S = 60.0  # a node waits longer than a client: it serves many pairings
DEFAULT_DEAD_NODE_GRACE_S = 300.0
# A kvpool client's handshake is a few round trips (TLS, HELLO, AUTH), and gives up after its own
# connect_timeout_s and progress_timeout_s (2 s by default) for each: 10 s is far above any legitimate one.
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
# Twice the listen backlog: a burst of reconnecting clients fits, and what waiting peers can hold
# stays small (a descriptor and at most max_handshake_meta_bytes each).
DEFAULT_MAX_PENDING_CONNECTIONS = 1024
MAX_PENDING_CONNECTIONS = 1_000_000
# Pin deadlines (docs/fleet.md): Mooncake's soft pins' default and cap (its master's 30 min and 24 h).
DEFAULT_PIN_TTL_S = 1800.0
DEFAULT_PIN_TTL_MAX_S = 86400.0
# The ring a `kvpool events` endpoint reads (docs/fleet-events.md): off unless set.
MAX_EVENT_RING_KEYS = 16_777_216
CHANNELS = ("off", "nccl", "cpu")
EVICTIONS = ("lru", "prefix", "prefix-recency")  # the node's eviction orders (backend/node/store/eviction.py ORDERS)
ENV_PREFAULT = "KVPOOL_PREFAULT"


@dataclasses.dataclass(frozen=True)
class NodeOption:
    """One node setting: YAML key ``name``, flag ``--name-with-dashes``, and optionally a ``KVPOOL_*`` variable."""

    name: str
    parse: Callable[[str, Any], Any]  # (the option as the user wrote it, raw value) -> value; ConfigError naming it
    default: Any
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    env: str = ""  # the environment variable that sets it (flags win over it, it wins over YAML)
    flag: bool = True  # False for secrets: from a file or the environment, never from argv

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")


REDIS_HELP = (
    "the pool's metadata Redis (required): redis://HOST:PORT, redis+cluster://HOST:PORT[,HOST:PORT] or "
    "redis+sentinel://HOST:PORT[,HOST:PORT]/MASTER; TLS: rediss://, rediss+cluster://, rediss+sentinel://; "
    "an ACL user as USER@HOST:PORT"
)
# Every node setting, in the order of `kvpool node --help`. The help strings of dram, nvme_dir and
# nvme name {default}: `kvpool up` and `kvpool node` differ there (NODE_VERB_DEFAULTS).
NODE_OPTIONS: tuple[NodeOption, ...] = (
    NodeOption("redis", optional(redis_value), "", REDIS_HELP, metavar="URL"),
    NodeOption(
        "namespace",
        named(NAMESPACE_RE, "1-64 characters of A-Z a-z 0-9 _ . -"),
        DEFAULT_NAMESPACE,
        f"pool namespace (default {DEFAULT_NAMESPACE})",
    ),
    NodeOption("dram", size_value(positive=True), parse_size("4GiB"), "DRAM tier size (default {default})"),
    NodeOption("nvme_dir", optional(path_value), None, "NVMe tier directory ({default})"),
    NodeOption(
        "nvme", size_value(positive=False), parse_size("100GiB"), "NVMe tier size; 0 turns it off (default {default})"
    ),
    NodeOption("host", text_value, "127.0.0.1", "address to listen on (default 127.0.0.1)"),
    NodeOption("port", int_in(0, 65535), 0, "port to listen on (default: any free port)"),
    NodeOption(
        "advertise",
        parse_advertise,
        ("", 0),
        "address clients should use, published in the registry (default: "
        "--host, or the hostname for 0.0.0.0; the port defaults to the one listened on)",
        metavar="HOST[:PORT]",
    ),
    NodeOption(
        "node_id",
        node_id_value,
        "",
        f"stable node id, {NODE_ID_RULE}; refused while a live node holds it "
        "(default: kept in the NVMe dir, else HOSTNAME-PORT)",
    ),
    NodeOption("cluster", named(CLUSTER_RE, "A-Z a-z 0-9 _ . -"), "", "cluster label for same-cluster reads"),
    NodeOption(
        "channel",
        choice(CHANNELS),
        "off",
        "serve same-cluster clients over the channel: nccl (GPU), "
        "cpu (its socket twin, for tests) or off (default); needs --cluster",
        choices=CHANNELS,
    ),
    NodeOption("device", text_value, "cuda:0", "CUDA device of --channel nccl (default cuda:0)"),
    NodeOption(
        "pair_timeout_s",
        seconds_value,
        DEFAULT_NODE_PAIR_TIMEOUT_S,
        "deadline of one channel pairing, in seconds; a cold NCCL init takes seconds "
        f"(default {DEFAULT_NODE_PAIR_TIMEOUT_S:g})",
        metavar="S",
    ),
    NodeOption(
        "dead_node_grace_s",
        seconds_value,
        DEFAULT_DEAD_NODE_GRACE_S,
        "a node dead this many seconds loses its registry entry and index entries, collected by a live node "
        f"(default {DEFAULT_DEAD_NODE_GRACE_S:g})",
        metavar="S",
    ),
    NodeOption(
        "handshake_timeout_s",
        seconds_value,
        DEFAULT_HANDSHAKE_TIMEOUT_S,
        "a connection must finish its handshake (TLS, its first frame, and AUTH where the pool has a "
        f"token) this many seconds after it is accepted, or it is closed (default {DEFAULT_HANDSHAKE_TIMEOUT_S:g})",
        metavar="S",
    ),
    NodeOption(
        "max_pending_connections",
        int_in(1, MAX_PENDING_CONNECTIONS),
        DEFAULT_MAX_PENDING_CONNECTIONS,
        "most connections kept before their handshake finished; above it the oldest is closed "
        f"(default {DEFAULT_MAX_PENDING_CONNECTIONS})",
        metavar="N",
    ),
    NodeOption(
        "token_file",
        optional(path_value),
        None,
        "file holding the pool token (or set KVPOOL_TOKEN_FILE, as engines do, or KVPOOL_TOKEN)",
        env="KVPOOL_TOKEN_FILE",
    ),
    NodeOption(
        "token_file_next",
        optional(path_value),
        None,
        "file holding a second pool token the node accepts beside --token-file's, for a rotation "
        "(docs/security.md, 'Rotating the token')",
    ),
    NodeOption(
        "tenant_tokens",
        optional(path_value),
        None,
        "directory of tenant tokens: the file NAME holds the token of tenant NAME, which may touch only "
        "that tenant's keys, and NAME.next a second one during a rotation (docs/security.md, 'Tenant tokens'); "
        "needs --token-file",
        metavar="DIR",
    ),
    NodeOption(
        "tls_cert",
        optional(path_value),
        None,
        "serve the node protocol over TLS only, with this PEM "
        "certificate chain (it must name the address clients use: --advertise or --host); needs --tls-key",
        metavar="FILE",
    ),
    NodeOption("tls_key", optional(path_value), None, "the PEM private key of --tls-cert", metavar="FILE"),
    NodeOption(
        "redis_ca",
        optional(path_value),
        None,
        "CA bundle that verifies a rediss:// Redis (default: the system trust store)",
        metavar="FILE",
    ),
    NodeOption(
        "redis_password_file",
        optional(path_value),
        None,
        "file holding the Redis ACL password (or set KVPOOL_REDIS_PASSWORD_FILE or "
        "KVPOOL_REDIS_PASSWORD); the user goes in the --redis URL: rediss://USER@HOST:PORT",
        metavar="FILE",
        env="KVPOOL_REDIS_PASSWORD_FILE",
    ),
    NodeOption(
        "metrics_port",
        optional(int_in(0, 65535)),
        None,
        "serve /metrics and /health on this port (0: any free port; default: off)",
    ),
    NodeOption("metrics_host", text_value, "127.0.0.1", "address for --metrics-port (default 127.0.0.1)"),
    NodeOption(
        "shm_dir",
        shm_dir_value,
        Path(DEFAULT_SHM_DIR) if Path(DEFAULT_SHM_DIR).is_dir() else None,
        f"keep DRAM in a shared-memory arena here so same-host clients read without TCP "
        f"(default {DEFAULT_SHM_DIR}; off: private memory)",
        metavar="DIR|off",
    ),
    NodeOption(
        "prefault",
        switch,
        True,
        "take the whole DRAM arena's memory at start, before the node registers "
        f"(1-3 s per GiB of arena), so the first puts find their pages ready; off: take it as chunks "
        f"arrive (default on; or {ENV_PREFAULT})",
        metavar="on|off",
        env=ENV_PREFAULT,
    ),
    NodeOption(
        "eviction",
        choice(EVICTIONS),
        "lru",
        "which chunks leave a full tier first: lru (least recently used); prefix, for a prefix cache (tails "
        "of cold prefix chains first: the fewest reads leave first, tail first inside a chain, a chunk whose "
        "prefix left before any still reachable, and a put that would evict a chunk read as often is refused); "
        "prefix-recency (prefix's chains by recency alone); default lru. Clients tell a node of either prefix "
        "order what their lookups found (the pool URL's touch=auto)",
        metavar="{" + ",".join(EVICTIONS) + "}",  # no argparse choices: choice() names the close one
    ),
    NodeOption(
        "pin_ttl_default_s",
        seconds_or_zero_value,
        DEFAULT_PIN_TTL_S,
        "how long a pin (kvpool pin) lasts when it names no --ttl, in seconds; 0: no expiry, which needs "
        f"--pin-ttl-max-s 0 (default {DEFAULT_PIN_TTL_S:g})",
        metavar="S",
    ),
    NodeOption(
        "pin_ttl_max_s",
        seconds_or_zero_value,
        DEFAULT_PIN_TTL_MAX_S,
        f"the longest ttl a pin may ask for, in seconds; 0: no cap, and pins may ask for no expiry "
        f"(default {DEFAULT_PIN_TTL_MAX_S:g})",
        metavar="S",
    ),
    NodeOption(
        "event_ring_keys",
        int_in(0, MAX_EVENT_RING_KEYS),
        0,
        "keys kept in the ring of recent stores and removals a `kvpool events` endpoint reads; "
        "0: no ring, no events (default 0)",
        metavar="N",
    ),
    NodeOption("token", text_value, "", "the pool token clients must prove", env="KVPOOL_TOKEN", flag=False),
    NodeOption("redis_password", text_value, "", "the Redis ACL password", env="KVPOOL_REDIS_PASSWORD", flag=False),
)
NODE_OPTION_NAMES = tuple(option.name for option in NODE_OPTIONS)
# What `kvpool up` and `kvpool node` default to where they differ, as the user would write it.
NODE_VERB_DEFAULTS: dict[str, dict[str, Any]] = {
    "node": {"dram": "4GiB", "nvme_dir": None, "nvme": "100GiB"},
    "up": {"dram": "1GiB", "nvme_dir": str(Path(".kvpool") / "nvme"), "nvme": "8GiB"},
}


def node_options(
    flags: Mapping[str, Any],
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Each node option's value, parsed and checked on its own: flag, else environment, else YAML, else default.

    ``flags`` maps option names to what was given on the command line (None: not given);
    ``defaults`` overrides the table's defaults (raw, as a user would write them). An
    error names the option as its source spells it: ``--dram``, ``KVPOOL_TOKEN``, or
    ``dram (in FILE)``; an unknown flag or YAML key is an error, an unknown ``KVPOOL_*`` variable a warning.
    """
    environ = environ if environ is not None else {}
    check_env(environ)
    flag_names = {option.name: option.flag_name for option in NODE_OPTIONS if option.flag}
    for name in flags:
        if name not in flag_names:
            flag = "--" + name.replace("_", "-")
            hint = did_you_mean(flag, flag_names.values())
            raise ConfigError(
                flag, f"unknown flag; {hint + ' ' if hint else ''}known: {', '.join(flag_names.values())}"
            )
    from_file = _node_yaml(config_file) if config_file is not None else {}
    values: dict[str, Any] = {}
    for option in NODE_OPTIONS:
        if option.flag and flags.get(option.name) is not None:
            values[option.name] = option.parse(option.flag_name, flags[option.name])
        elif option.env and option.env in environ:
            values[option.name] = option.parse(option.env, environ[option.env])
        elif option.name in from_file:
            values[option.name] = option.parse(f"{option.name} (in {config_file})", from_file[option.name])
        elif defaults is not None and option.name in defaults:
            raw = defaults[option.name]
            values[option.name] = None if raw is None else option.parse(option.flag_name, raw)
        else:
            values[option.name] = option.default
    return values


def _node_yaml(path: str | Path) -> dict[str, Any]:
    """The options of a node's YAML file, keys with dashes or underscores; unknown or secret keys are errors."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of options")
    settable = [option.name for option in NODE_OPTIONS if option.flag]
    options = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in ("token", "redis_password"):
            raise ConfigError(
                str(key), f"a secret does not belong in {path}: give {name}_file, or set KVPOOL_{name.upper()}"
            )
        if name not in settable:
            hint = did_you_mean(str(key), settable)
            raise ConfigError(
                str(key), f"unknown option in {path}; {hint + ' ' if hint else ''}known: {', '.join(sorted(settable))}"
            )
        options[name] = value
    return options
