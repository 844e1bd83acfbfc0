"""Shared fixtures: a real redis-server and real pool-node processes (``backend.launch.nodes``).

The tiers: a test whose fixtures include ``processes`` is marked ``process``; the others are the
fast tier (``make test-fast``, ``-m "not process"``). ``tests.support.processes`` holds the rule and
the check that keeps it true: a test that starts a process without requesting ``processes`` fails.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from backend.embedded import EmbeddedRedis
from backend.launch.nodes import NodeProcess
from backend.node.memory.arena import remove_stale_arenas
from tests.support import processes as tiers
from tests.support.waits import wait_until

if TYPE_CHECKING:
    from backend.client import PoolClient
    from backend.metadata import NodeInfo

__all__ = ["REPO", "NodeProcess", "raw_request", "wait_until"]

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{tiers.MARK}: starts processes (its fixtures include {tiers.FIXTURE!r})")
    tiers.install()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if tiers.starts_processes(getattr(item, "fixturenames", ())):
            item.add_marker(tiers.MARK)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    with tiers.guard(item.nodeid, tiers.starts_processes(getattr(item, "fixturenames", ()))):
        yield


@pytest.fixture(scope="session")
def processes() -> None:
    """Requested by every test and fixture that starts a process (a node, a redis-server, a command):
    such tests are marked ``process`` and left out of the fast tier."""


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """The session's redis-server: the one process fast tests share (started once, outside the check)."""
    with tiers.allowed():
        server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        with tiers.allowed():
            server.cleanup()


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def redis_factory(processes: None) -> Iterator[list[EmbeddedRedis]]:
    """Private redis-servers a test may kill and restart; all cleaned up after."""
    made: list[EmbeddedRedis] = []
    yield made
    for server in made:
        server.cleanup()


@pytest.fixture
def node_factory(processes: None, redis_server: EmbeddedRedis, namespace: str) -> Iterator[object]:
    started: list[NodeProcess] = []

    def spawn(
        *extra: str,
        redis_url: str | None = None,
        ns: str | None = None,
        dram: str = "256MiB",
        env: dict[str, str] | None = None,
        max_open_files: int = 0,
        shm: bool = False,
    ) -> NodeProcess:
        """A node process. ``shm=False`` (the default here) makes every read go over TCP,
        as it does from another host; tests of the same-host path pass ``shm=True``.
        Test nodes do not prefault (``--prefault on`` in ``extra`` or ``env`` turns it on): hundreds
        of short-lived nodes each taking 320 MiB at start would cost the suite memory and CPU."""
        from backend.config.node import ENV_PREFAULT  # here: conftest itself must import without redis-py

        full_env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", ENV_PREFAULT: "off", **(env or {})}
        args = ["--redis", redis_url or redis_server.url, "--namespace", ns or namespace, "--dram", dram, *extra]
        if not shm and "--shm-dir" not in extra:
            args += ["--shm-dir", "off"]
        node = NodeProcess(args, full_env, max_open_files).start()
        started.append(node)
        return node

    yield spawn
    for node in started:
        if node.alive():
            node.resume()
        node.kill()
    remove_stale_arenas(Path("/dev/shm"))  # the killed nodes' shared-memory files


@pytest.fixture
def pool_url(redis_server: EmbeddedRedis, namespace: str) -> str:
    return f"kvpool://127.0.0.1:{redis_server.port}/{namespace}"


@pytest.fixture
def stack_factory(processes: None) -> Iterator[Any]:
    """Build LMCache's storage stack for a pool URL (``make(url, form=..., engine=..., **config_overrides)``;
    ``engine``: LMCacheStack's keyword arguments, the engine's model and layout); closed at teardown."""
    from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config  # imports lmcache: only its users pay

    made: list[LMCacheStack] = []

    def make(url: str, form: str = "plugin", engine: dict[str, Any] | None = None, **config: Any) -> LMCacheStack:
        cfg = kvpool_lmcache_config(url, form=form)
        cfg.update(config)
        made.append(LMCacheStack(cfg, **(engine or {})))
        return made[-1]

    yield make
    for stack in made:
        stack.close()


async def raw_request(client: PoolClient, node: NodeInfo, op: int, meta: bytes) -> bytes:
    """One request of any op to ``node`` over ``client``'s connections; the answer's meta.

    For tests that send what no client method sends (a lease by hand, a bad flag):
    the client's own requests go through its typed methods.
    """
    return bytes(await client.connections.to(node).request(op, meta))


@pytest.fixture
def adapters() -> Iterator[Callable[..., Any]]:
    """kvpool's multiprocess-mode L2 adapters as ``lmcache server`` builds them (``--l2-adapter`` JSON), with
    the adapter's parameters beside the URL's; closed at teardown."""
    from tests.support.lmcache import build_adapter

    made: list[Any] = []

    def make(url: str, **params: Any) -> Any:
        made.append(build_adapter(url, **params))
        return made[-1]

    yield make
    for adapter in made:
        adapter.close()
