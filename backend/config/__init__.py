"""PoolConfig: the one value object that says how to reach a pool.

A pool is named by a URL::

    kvpool://[:TOKEN@]REDIS_HOST:REDIS_PORT/NAMESPACE?option=value&...

The URL points at the metadata Redis; nodes are discovered from its registry. With
``redis_mode=cluster`` REDIS_HOST:REDIS_PORT is any member of a Redis Cluster; with
``sentinel=MASTER`` it is a Redis Sentinel that knows the master by that name
(``redis_hosts=`` adds more members or sentinels). ``tls=on`` encrypts both: node
connections (verified against ``tls_ca`` or the system trust) and Redis (``rediss://``).
Redis ACL credentials are the ``redis_user`` and ``redis_password`` options; the
userinfo of the URL is the pool token, for nodes only.

Secrets belong in files or the environment, not in the URL: LMCache logs its whole
configuration, pool URL included, at INFO. ``token_file=PATH`` and
``redis_password_file=PATH`` (or ``KVPOOL_TOKEN`` / ``KVPOOL_REDIS_PASSWORD``) keep them
out of every URL and config that is shown; a file, when named, wins over the other
sources. :func:`without_inline_secrets` strips secrets written into a URL.
Durations are in seconds, named for what they bound (``connect_timeout_s``,
``progress_timeout_s``, ``pair_timeout_s``).
Options may also come from ``KVPOOL_<OPTION>`` environment variables (which win over
the URL) and from a YAML file. Everything is validated once, here; an unknown or
malformed option raises :class:`ConfigError` naming it, and an unknown one the close
name too (:mod:`backend.config.suggest`, which also knows the names kvpool used before
0.1). An unknown ``KVPOOL_*`` variable is logged (once) and ignored: inside LMCache an
error would turn the cache off; an old name of one is refused.

:class:`NodeConfig` is a pool node's settings: flags (``kvpool node``/``kvpool up``),
a YAML file and the environment go through one table of options, :data:`NODE_OPTIONS`.
"""

from backend.config.node import NodeConfig
from backend.config.node_options import (
    NODE_OPTION_NAMES,
    NODE_OPTIONS,
    NODE_VERB_DEFAULTS,
    REDIS_HELP,
    NodeOption,
    node_options,
)
from backend.config.node_parsers import parse_advertise
from backend.config.pool import (
    DEFAULT_NAMESPACE,
    ENV_DEBUG,
    ENV_URL,
    OPTION_NAMES,
    SCHEME,
    SECRET_NAMES,
    PoolConfig,
    check_env,
    env_flag,
    known_env_names,
    mask_secrets,
    pool_config_of_redis,
    without_inline_secrets,
)
from backend.config.values import format_size, parse_size, split_url

__all__ = [
    "PoolConfig",
    "pool_config_of_redis",
    "NodeConfig",
    "NodeOption",
    "NODE_OPTIONS",
    "NODE_OPTION_NAMES",
    "NODE_VERB_DEFAULTS",
    "REDIS_HELP",
    "node_options",
    "parse_advertise",
    "check_env",
    "known_env_names",
    "env_flag",
    "ENV_URL",
    "ENV_DEBUG",
    "parse_size",
    "format_size",
    "SCHEME",
    "DEFAULT_NAMESPACE",
    "without_inline_secrets",
    "mask_secrets",
    "split_url",
    "SECRET_NAMES",
    "OPTION_NAMES",
]
