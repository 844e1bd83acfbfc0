"""The public API (docs/api.md): ``kvpool`` exports it; ``backend`` is the implementation and re-exports none of it."""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import subprocess
import sys

import pytest

import backend
import kvpool
from backend.lmcache.config import ADAPTER_MODULE, L2_ADAPTER_MODULE
from tests.test_class_sizes import REPO


def test_every_public_name_resolves_to_the_implementation_object() -> None:
    from backend import client, config, errors
    from backend.events import auth

    homes = {"PoolConfig": config, **{n: client for n in ("PoolClient", "SyncPoolClient", "Chunk", "Fetched", "Lock")}}
    homes |= {"CurveKeys": auth, "curve_keys": auth}
    for name in kvpool.__all__:
        if name == "__version__":
            assert kvpool.__version__ == backend.__version__
            continue
        assert getattr(kvpool, name) is getattr(homes.get(name, errors), name), name


@pytest.mark.parametrize("name", ["SyncPoolClient", "PoolConfig", "KVPoolError", "PutOutcome", "MOVED"])
def test_backend_no_longer_answers_for_the_public_names(name: str) -> None:
    """0.1 is the first release: ``from backend import SyncPoolClient`` of the drafts before it is an ImportError."""
    assert not hasattr(backend, name)
    with pytest.raises(ImportError, match=f"cannot import name '{name}' from 'backend'"):
        exec(f"from backend import {name}", {})


@pytest.mark.parametrize(
    ("old", "public"),
    [
        ("backend.lmcache_connector", "kvpool.lmcache_connector"),
        ("backend.lmcache_l2_adapter", "kvpool.lmcache_l2_adapter"),
    ],
)
def test_the_module_paths_of_the_drafts_before_0_1_are_gone(old: str, public: str) -> None:
    # How `import` finds a submodule of backend; PathFinder alone, as a shared editable install's finder may
    # also serve another checkout's files.
    assert importlib.machinery.PathFinder.find_spec(old, backend.__path__) is None
    assert importlib.import_module(public).__all__  # what configs name instead


def test_an_unknown_name_is_an_attribute_error_in_both() -> None:
    with pytest.raises(AttributeError, match="'kvpool' has no attribute 'Nope'"):
        kvpool.Nope  # noqa: B018
    with pytest.raises(AttributeError, match="'backend' has no attribute 'Nope'"):
        backend.Nope  # noqa: B018


@pytest.mark.usefixtures("processes")
def test_importing_kvpool_loads_no_redis_until_the_client_is_used() -> None:
    """The errors import on a machine without redis-py (the GPU machines of the NCCL channel)."""
    code = (
        "import json, sys, kvpool\nfirst = 'redis' in sys.modules\n"
        "kvpool.PoolConfig\nprint(json.dumps([first, 'redis' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(out.stdout) == [False, True]


def test_the_printed_module_paths_are_the_public_ones_and_load_the_implementation_classes() -> None:
    import backend.lmcache.connector as connector
    import backend.lmcache.l2 as l2
    import kvpool.lmcache_connector as public
    import kvpool.lmcache_l2_adapter as public_l2

    assert (ADAPTER_MODULE, L2_ADAPTER_MODULE) == ("kvpool.lmcache_connector", "kvpool.lmcache_l2_adapter")
    assert public.KVPoolConnectorAdapter is connector.KVPoolConnectorAdapter
    assert public.KVPoolRemoteURLConnector is connector.KVPoolRemoteURLConnector
    assert public_l2.KVPoolL2Adapter is l2.KVPoolL2Adapter


# -- opening: Redis and the token are checked when a client opens, not at its first call -------------
def test_redis_refusing_the_password_at_open_is_an_auth_error_naming_the_file(redis_factory, tmp_path) -> None:
    import asyncio

    from backend.embedded import EmbeddedRedis

    server = EmbeddedRedis().start(password="the-right-password")
    redis_factory.append(server)
    wrong = tmp_path / "redis-password"
    wrong.write_text("a-wrong-password\n")
    wrong.chmod(0o600)
    config = kvpool.PoolConfig.from_url(f"kvpool://127.0.0.1:{server.port}/open?redis_password_file={wrong}")
    with pytest.raises(kvpool.AuthError) as caught:
        with kvpool.SyncPoolClient(config):
            pytest.fail("opened although Redis refused the password")
    assert isinstance(caught.value, kvpool.MetadataError)  # code that catches MetadataError keeps working
    assert f"refused the password in {wrong}" in str(caught.value) and "a-wrong-password" not in str(caught.value)

    async def open_async() -> None:
        async with kvpool.PoolClient(config):
            pytest.fail("opened although Redis refused the password")

    with pytest.raises(kvpool.AuthError, match="refused the password in"):
        asyncio.run(open_async())
    anonymous = kvpool.SyncPoolClient(kvpool.PoolConfig.from_url(f"kvpool://127.0.0.1:{server.port}/open"))
    try:
        with pytest.raises(kvpool.AuthError, match="asks for a password and none was given"):
            anonymous.connect()
    finally:
        anonymous.close()


def test_an_acl_permission_refusal_is_a_metadata_error_but_not_an_auth_error(redis_factory) -> None:
    import redis

    from backend.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    redis_factory.append(server)
    with redis.Redis(port=server.port) as raw:
        raw.execute_command("ACL", "SETUSER", "pinger", "on", ">pinger-password", "~*", "-@all", "+ping", "+hello")
    url = f"kvpool://127.0.0.1:{server.port}/acl?redis_user=pinger"
    config = kvpool.PoolConfig.from_url(url, {"KVPOOL_REDIS_PASSWORD": "pinger-password"})
    with kvpool.SyncPoolClient(config) as client:  # authenticated: PING is allowed, so it opens
        with pytest.raises(kvpool.MetadataError, match="ACL") as caught:
            client.list_keys()
    assert not isinstance(caught.value, kvpool.AuthError)


def test_connect_checks_the_token_with_a_live_node_and_opens_with_no_live_node(node_factory, pool_url) -> None:
    token = "the-pool-token-0123456789abcdef0123"
    right = kvpool.PoolConfig.from_url(pool_url.replace("kvpool://", f"kvpool://:{token}@"))
    wrong = kvpool.PoolConfig.from_url(pool_url.replace("kvpool://", "kvpool://:not-the-token-0123456789abcdef01@"))
    with kvpool.SyncPoolClient(wrong).connect() as client:  # no live node: nothing to refuse the token
        assert client.nodes() == []
        with pytest.raises(kvpool.CapacityError):
            client.put([kvpool.Chunk("k", b"v")])
    node_factory(env={"KVPOOL_TOKEN": token})
    refused = kvpool.SyncPoolClient(wrong)
    try:
        with pytest.raises(kvpool.AuthError) as caught:
            refused.connect()
    finally:
        refused.close()
    assert not isinstance(caught.value, kvpool.MetadataError)  # the node refused it, not Redis
    with kvpool.SyncPoolClient(right).connect() as client:
        client.put([kvpool.Chunk("k", b"v")])


def test_a_refused_password_from_the_environment_says_where_it_came_from(redis_factory) -> None:
    from backend.embedded import EmbeddedRedis

    server = EmbeddedRedis().start(password="the-right-password")
    redis_factory.append(server)
    config = kvpool.PoolConfig.from_url(
        f"kvpool://127.0.0.1:{server.port}/env", {"KVPOOL_REDIS_PASSWORD": "a-wrong-password"}
    )
    with pytest.raises(kvpool.AuthError) as caught:
        with kvpool.SyncPoolClient(config):
            pytest.fail("opened although Redis refused the password")
    assert "refused the password given (KVPOOL_REDIS_PASSWORD" in str(caught.value)
    assert "a-wrong-password" not in str(caught.value)
