"""Faults as LMCache sees them: through its own RemoteBackend, every call comes back.

LMCache waits on the plugin from its worker threads; a plugin call that hangs would
hang serving. Under a stalled path and a frozen node each call must return (a hit
from the replica, or a miss) well before a generous bound, with the right bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from backend.embedded import free_port
from backend.lmcache.stack import LMCacheStack
from tests.faults.proxy import FaultProxy
from tests.support.waits import run_with_timeout, wait_until

BOUND_S = 20.0  # "returned at all": the timeouts are 0.5 s


def _right_or_miss(stack: LMCacheStack, got: list[Any]) -> int:
    """Assert each object holds exactly what was stored for it (or is a miss); return the hits."""
    for seed, obj in enumerate(got):
        if obj is not None:
            assert torch.equal(obj.tensor, stack.expected_tensor(seed)), f"wrong bytes for chunk {seed}"
    stack.release(got)
    return sum(1 for obj in got if obj is not None)


def test_lmcache_calls_return_within_bounds_under_a_stalled_path_and_a_frozen_replica(
    node_factory, pool_url, stack_factory
):
    port = free_port()
    with FaultProxy(port) as proxy:
        node_factory("--port", str(port), "--advertise", f"127.0.0.1:{proxy.port}", "--cluster", "near")
        replica = node_factory()
        stack = stack_factory(pool_url + "?replicas=2&connect_timeout_s=0.5&progress_timeout_s=0.5&cluster=near")
        keys = [stack.key(300 + i) for i in range(4)]
        objs = [stack.make_object(i) for i in range(4)]
        stack.put(keys, objs)
        stack.release(objs)
        assert _right_or_miss(stack, run_with_timeout(lambda: stack.get(keys), BOUND_S)) == 4

        proxy.set("stall")  # the copy LMCache's reads try first stops answering
        assert _right_or_miss(stack, run_with_timeout(lambda: stack.get(keys), BOUND_S)) == 4
        assert stack.connector().client.counters["get_failovers"] >= 1

        replica.pause()  # now neither copy answers: misses, still bounded
        assert _right_or_miss(stack, run_with_timeout(lambda: stack.get(keys), BOUND_S)) == 0
        more = [stack.make_object(9)]
        run_with_timeout(lambda: stack.put([stack.key(399)], more), BOUND_S)
        stack.release(more)
        assert stack.connector().counters["miss_put"] >= 1

        replica.resume()
        proxy.set("pass")
        assert wait_until(lambda: _right_or_miss(stack, stack.get(keys)) == 4, 20.0, 0.2)
