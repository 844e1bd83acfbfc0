"""A client killed without close() leaves no put stage behind; a live client's stage is never taken.

Before, a same-host client's 128 MiB stage in ``/dev/shm`` outlived a client killed with
``kill -9`` until the next node started in that directory. Now the client holds its
stage locked for its process's life, and the node removes stages no live process holds
(``backend/node/serve/stages.py``, every ``STAGE_SWEEP_INTERVAL_S``). A real client process
and a real node; what is promised: docs/design.md, "Same-host puts".
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.node.serve.stages import STAGE_SWEEP_INTERVAL_S
from backend.shm import STAGE_MIN_AGE_S, PutStage, remove_abandoned_stages
from kvpool import Chunk, PoolConfig, SyncPoolClient
from tests.conftest import REPO
from tests.support.waits import wait_until

KIB = 1024

# A client that does staged puts, says so, and waits to be killed.
CLIENT = textwrap.dedent(
    """
    import os, sys
    from kvpool import Chunk, PoolConfig, SyncPoolClient
    client = SyncPoolClient(PoolConfig.from_url(sys.argv[1]))
    client.put([Chunk(f"dead-client-{i}", os.urandom(256 * 1024)) for i in range(8)])
    assert client.counters["staged_put_bytes"] == 8 * 256 * 1024, client.counters
    print("staged", flush=True)
    sys.stdin.read()
    """
)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory of the node's own in /dev/shm: nodes of other test runs sweep /dev/shm itself."""
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvpool-test-") as directory:
        yield Path(directory)


def test_a_killed_clients_stage_is_removed_while_a_live_clients_stays_and_works(node_factory, pool_url, shm_dir):
    node_factory("--shm-dir", str(shm_dir), shm=True)

    def _stages_of(pid: int) -> list[str]:
        return glob.glob(f"{shm_dir}/kvpool-{pid}-*.stage")

    with SyncPoolClient(PoolConfig.from_url(pool_url)) as live:
        live.put([Chunk("live-0", os.urandom(128 * KIB))])
        assert live.counters["staged_put_bytes"] == 128 * KIB
        [mine] = _stages_of(os.getpid())
        node = live.nodes()[0]

        def sweeps() -> int:
            return int(live.node_stats(node)["counters"].get("stage_sweeps", 0))

        doomed = subprocess.Popen(
            [sys.executable, "-c", CLIENT, pool_url],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert doomed.stdout is not None and doomed.stdout.readline().strip() == "staged", doomed.stderr
            [left] = _stages_of(doomed.pid)
        finally:
            doomed.kill()  # SIGKILL: no close(), no finalizer
            doomed.wait(10)
        # Gone by the second sweep that begins after the kill (sweeps are STAGE_SWEEP_INTERVAL_S apart, so
        # the stage is STAGE_MIN_AGE_S old by then): counted in sweeps, not seconds, so a loaded machine that
        # runs them late does not fail it. Read before each look, the count may lag the removing sweep by
        # one (counted after its unlink) and a sweep under way at the kill may count after it: four at most.
        assert STAGE_MIN_AGE_S <= STAGE_SWEEP_INTERVAL_S
        at_kill = sweeps()
        seen: list[int] = []

        def removed() -> bool:
            seen.append(sweeps())
            return not os.path.exists(left)

        assert wait_until(removed, 60.0)
        assert seen[-1] <= at_kill + 4, (at_kill, seen[-1])
        assert os.path.exists(mine)
        # (counted once the sweep's thread is back on the node's loop: a moment after the unlink)
        assert wait_until(lambda: live.node_stats(node)["counters"].get("stages_removed") == 1, 5.0)
        # The live client's stage still carries its puts, past two more sweeps.
        kept_through = sweeps() + 2
        assert wait_until(lambda: sweeps() >= kept_through, 30.0)
        chunks = [Chunk(f"live-{i}", os.urandom(128 * KIB)) for i in range(1, 5)]
        live.put(chunks)
        assert live.counters["staged_put_bytes"] == 5 * 128 * KIB
        assert [bytes(g.data) for g in live.get([c.key for c in chunks])] == [bytes(c.data) for c in chunks]
        assert _stages_of(os.getpid()) == [mine]
    assert not os.path.exists(mine)  # close() removed it


@pytest.mark.usefixtures("processes")
def test_a_stage_is_kept_while_its_process_lives_and_removed_once_it_is_gone(tmp_path: Path):
    """The rule itself, without a node: a held lock keeps a stage, whoever looks and however old it is."""
    held = PutStage(str(tmp_path), 4 * KIB)
    dropped = PutStage(str(tmp_path), 4 * KIB)
    old = time.time() - 60
    for stage in (held, dropped):
        os.utime(stage.path, (old, old))  # past STAGE_MIN_AGE_S
    del stage
    assert remove_abandoned_stages(tmp_path) == 0  # both held by this live process
    path = dropped.path
    del dropped  # a client dropped without close(): collected, its stage goes with it
    assert not os.path.exists(path)
    child = subprocess.run(  # the same check from another process: the lock is per open file, not per process
        [
            sys.executable,
            "-c",
            f"from backend.shm import remove_abandoned_stages; print(remove_abandoned_stages({str(tmp_path)!r}))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.stdout.strip() == "0", child.stderr
    assert os.path.exists(held.path)
    held.close()
    assert not os.path.exists(held.path)
