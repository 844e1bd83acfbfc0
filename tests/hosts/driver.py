"""A pool client on a host of the bed, driven by JSON lines on stdin (one answer line per command).

    python -m tests.hosts.driver URL     # then: {"op": "put", "keys": [...], "size": N}

Ops: ``put`` (keys, size: each value is derived from its key, so any reader can check
it), ``get`` (keys, size: seconds, hits, misses and wrong bytes), ``counters``,
``nodes``. A failed op answers ``{"error": ...}``; the driver keeps going.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

from backend.client.chunks import Chunk
from backend.client.sync import SyncPoolClient
from backend.config import PoolConfig


def value_of(key: str, size: int) -> bytes:
    """The bytes stored under ``key``: any reader recomputes them."""
    return random.Random(f"{key}/{size}").randbytes(size)


def handle(client: SyncPoolClient, command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    start = time.monotonic()
    if op == "put":
        client.put([Chunk(key, value_of(key, command["size"])) for key in command["keys"]])
        return {"seconds": time.monotonic() - start}
    if op == "get":
        got = client.get(command["keys"])
        seconds = time.monotonic() - start
        hits = [k for k, g in zip(command["keys"], got) if g is not None]
        wrong = [
            k for k, g in zip(command["keys"], got) if g is not None and bytes(g.data) != value_of(k, command["size"])
        ]
        return {"seconds": seconds, "hits": len(hits), "misses": len(got) - len(hits), "wrong": wrong}
    if op == "contains":
        found = client.contains(command["keys"])
        return {"seconds": time.monotonic() - start, "found": sum(found)}
    if op == "counters":
        return {"counters": dict(client.counters)}
    if op == "nodes":
        return {"nodes": [{"node_id": n.node_id, "hostname": n.hostname, "alive": n.alive} for n in client.nodes()]}
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    client = SyncPoolClient(PoolConfig.from_url(sys.argv[1]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            answer = handle(client, json.loads(line))
        except Exception as exc:  # the test reads it: one op failed, the driver goes on
            answer = {"error": f"{type(exc).__name__}: {exc}", "seconds": 0.0}
        print(json.dumps(answer), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
