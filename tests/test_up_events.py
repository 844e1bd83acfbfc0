"""``kvpool up --events``: one flag gives a pool that ``kvpool events`` serves with no other flag.

A real ``kvpool up`` (its redis-server, its node), a real ``kvpool events`` on the URL that
``up`` printed, and a subscriber holding the pool token from the file ``up`` made.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from backend.events.keys import block_of
from kvpool import Chunk, PoolConfig, SyncPoolClient, curve_keys
from tests.conftest import REPO
from tests.support import vllm_events
from tests.support.cli import events_addresses
from tests.support.up import UpProcess
from tests.support.waits import until

UP_TIMEOUT_S = 60.0
MODEL = "up-events-model"


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}, "LMCACHE_TRACK_USAGE": "false"}


@pytest.mark.usefixtures("processes")
async def test_up_with_events_makes_a_pool_whose_kvpool_events_publishes_a_put():
    up = UpProcess(["--events", "--dram", "64MiB", "--nvme", "0", "--shm-dir", "off"])
    up.start(_env())
    events: subprocess.Popen[str] | None = None
    ctx = zmq.asyncio.Context()
    sub: vllm_events.Subscriber | None = None
    try:
        up.wait_ready(UP_TIMEOUT_S)
        url = up.url
        token_file = Path(re.search(r"token_file=([^&\s]+)", url).group(1))  # type: ignore[union-attr]
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert token_file.parent == Path(re.search(r"redis_password_file=([^&\s]+)", url).group(1)).parent  # type: ignore[union-attr]
        assert f"in {token_file} (mode 0600" in up.log and "--event-ring-keys" in up.log
        assert f"remote_storage_plugin.kvpool.url: {url}" in up.log  # the engine's YAML carries token_file= too

        anywhere = "tcp://127.0.0.1:*"
        verb = ["events", "--url", url, "--model", MODEL, "--publish", anywhere, "--replay", anywhere]
        events = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", *verb, "--poll-interval-s", "0.05"],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        publish, replay = await events_addresses(events, 2)
        config = PoolConfig.from_url(url, {})
        keys = curve_keys(token_file.read_text().strip(), config.namespace)
        topic = f"kv@kvpool-{config.namespace}@{MODEL}".encode()
        sub = vllm_events.Subscriber(
            ctx, publish, replay, topic, (keys.server_public, keys.client_public, keys.client_secret)
        )
        await asyncio.sleep(0.3)  # ZMQ's slow joiner: the subscription takes a moment to reach the PUB side
        await sub.replay(0)
        chunk = Chunk(f"{MODEL}@1@0@abc123@bfloat16", b"x" * 4096)
        with SyncPoolClient(config) as client:
            client.put([chunk])
        block = block_of(chunk.key)
        assert block is not None

        async def stored() -> bool:
            await sub.drain()  # type: ignore[union-attr]
            return block.block_hash in sub.mirror.blocks  # type: ignore[union-attr]

        await until(stored, timeout_s=15.0)
        assert any(block.block_hash in e.block_hashes for e in sub.mirror.stored_events)  # a BlockStored
    finally:
        if sub is not None:
            sub.close()
        ctx.destroy(linger=0)
        if events is not None:
            events.terminate()
            events.wait(timeout=30)
            for stream in (events.stdout, events.stderr):
                if stream is not None:
                    stream.close()
        up.interrupt()


@pytest.mark.usefixtures("processes")
def test_kvpool_events_on_a_pool_without_a_token_names_the_flags_to_add():
    up = UpProcess(["--dram", "64MiB", "--nvme", "0", "--shm-dir", "off"])
    up.start(_env())
    try:
        up.wait_ready(UP_TIMEOUT_S)
        done = subprocess.run(
            [sys.executable, "-m", "backend.cli", "events", "--url", up.url, "--model", MODEL],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=_env(),
            timeout=60,
        )
        assert done.returncode != 0
        for named in ("token_file=", "--token-file", "--event-ring-keys", "kvpool up --events"):
            assert named in done.stderr, done.stderr
    finally:
        up.interrupt()


@pytest.mark.usefixtures("processes")
def test_up_events_with_an_outside_redis_and_no_token_names_the_flag():
    done = subprocess.run(
        [sys.executable, "-m", "backend.cli", "up", "--events", "--redis", "redis://127.0.0.1:1", "--nvme", "0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=60,
    )
    assert done.returncode != 0 and "--events" in done.stderr and "--token-file" in done.stderr, done.stderr
