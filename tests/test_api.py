"""The public API (docs/api.md): ``kvpool`` exports it, ``backend`` keeps its old names for a release."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

import backend
import kvpool
from backend.lmcache.config import ADAPTER_MODULE, L2_ADAPTER_MODULE
from tests.test_class_sizes import REPO


def test_every_public_name_resolves_to_the_implementation_object() -> None:
    from backend import client, config, errors

    homes = {"PoolConfig": config, **{n: client for n in ("PoolClient", "SyncPoolClient", "Chunk", "Fetched", "Lock")}}
    for name in kvpool.__all__:
        if name == "__version__":
            assert kvpool.__version__ == backend.__version__
            continue
        assert getattr(kvpool, name) is getattr(homes.get(name, errors), name), name
    assert set(kvpool.__all__) - {"__version__"} == set(backend.MOVED)  # one list of public names


@pytest.mark.parametrize("name", ["SyncPoolClient", "PoolConfig", "KVPoolError", "PutOutcome"])
def test_the_old_import_name_still_works_and_says_where_the_name_moved(name: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(backend, name)
    assert value is getattr(kvpool, name)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert f"from kvpool import {name}" in str(caught[0].message)


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


def test_the_printed_module_paths_are_the_public_ones_and_load_the_same_classes() -> None:
    import backend.lmcache_connector as kept
    import backend.lmcache_l2_adapter as kept_l2
    import kvpool.lmcache_connector as public
    import kvpool.lmcache_l2_adapter as public_l2

    assert (ADAPTER_MODULE, L2_ADAPTER_MODULE) == ("kvpool.lmcache_connector", "kvpool.lmcache_l2_adapter")
    assert public.KVPoolConnectorAdapter is kept.KVPoolConnectorAdapter
    assert public.KVPoolRemoteURLConnector is kept.KVPoolRemoteURLConnector
    assert public_l2.KVPoolL2Adapter is kept_l2.KVPoolL2Adapter
    assert sorted(public.__all__) == sorted(kept.__all__) and sorted(public_l2.__all__) == sorted(kept_l2.__all__)
