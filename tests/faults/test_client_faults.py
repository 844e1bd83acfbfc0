"""A client process that dies holding leases: the node ends them when its connection closes.

Real node process, real redis-server, and a real client process killed with SIGKILL.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

from kvpool import CapacityError, Chunk, PoolConfig, SyncPoolClient
from tests.conftest import REPO
from tests.support.waits import wait_until

MIB = 1024 * 1024
LOCK_TTL_MS = 600_000  # the longest a node grants: without the fix the DRAM would stay pinned this long

HOLDER = textwrap.dedent("""
    import sys, time
    from kvpool import Chunk, PoolConfig, SyncPoolClient

    url, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    client = SyncPoolClient(PoolConfig.from_url(url))
    chunks = [Chunk(f"held@{i}", bytes([i]) * size) for i in range(count)]
    client.put(chunks)
    locks = client.lock([c.key for c in chunks], ttl_ms=int(sys.argv[4]))
    assert all(lock is not None for lock in locks), locks
    print("locked", flush=True)
    time.sleep(3600)
""")


def test_a_client_killed_while_holding_leases_on_most_of_dram_does_not_block_the_next_put(node_factory, pool_url):
    node_factory(dram="8MiB")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, pool_url, "7", str(MIB), str(LOCK_TTL_MS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line.strip() == "locked", holder.stderr.read() if holder.poll() is not None else line
        data = random.Random(1).randbytes(2 * MIB)
        with SyncPoolClient(PoolConfig.from_url(f"{pool_url}?connect_timeout_s=2&progress_timeout_s=2")) as client:
            info = client.nodes()[0]
            assert client.node_stats(info)["leases"] == 1
            try:  # 7 of 8 MiB leased: a 2 MiB put has nowhere to go
                client.put([Chunk("blocked", data)])
                raise AssertionError("the put succeeded although the leases pin 7 of 8 MiB")
            except CapacityError:
                pass
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            # The kernel closes the dead process's sockets; the node ends its leases on that close. The bound
            # only tells that close from the leases' 600 s ttl: 30 s holds on a loaded machine.
            assert wait_until(lambda: client.node_stats(info)["leases"] == 0, 30.0), client.node_stats(info)
            client.put([Chunk("next", data)])  # at once, not after the 600 s ttl
            assert bytes(client.get(["next"])[0].data) == data
            counters = client.node_stats(info)["counters"]
            assert counters["leases_disconnected"] == 1 and counters.get("leases_expired", 0) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
