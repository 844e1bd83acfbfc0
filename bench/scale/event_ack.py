"""Whether a node's event ring slows a put's ack: the same puts to a node with the ring and one without.

    python -m bench.scale.event_ack                        # 300 rounds of a 16-chunk put to each node
    python -m bench.scale.event_ack --rounds 100 --batch 64
    python -m bench.scale.event_ack --tokens 256           # each chunk with its 256 token ids (event_tokens=on)

Two real ``kvpool node`` processes on one real redis-server (DRAM only, no shared memory:
every byte crosses TCP, as from another host), one started with ``--event-ring-keys N``,
one without. Each is filled first with more chunks than its ring holds, so the ring is
full and every put drops its oldest entries, as on a node that has run a while. Then in
interleaved rounds (each node first in every other round, so a slow moment of a shared
machine lands on both) the client puts ``--batch`` new chunks to one node, then to the
other, and times each put to its ack (bytes on the node, committed to Redis, the
ring's entry appended: the ack is sent after that). Printed: p50 and p90 per node, and the
ratio of the p50s (ring on / off). At the end the ring node's EVENTS answer must name the
last put's keys: the ring was on and saw them. With ``--tokens N`` every chunk carries N
token ids and its parent's hash, as the LMCache connector's ``event_tokens=on`` sends them:
the ring node (whose registry entry says it keeps them) gets each put's token section and
keeps the records in its ring, the node without a ring gets the older form, and the last
put's records must come back from EVENTS. Results: docs/scale-node.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from array import array
from collections.abc import Sequence
from typing import Any

from backend.embedded import EmbeddedRedis
from backend.launch.nodes import NodeProcess
from backend.metadata import NodeInfo
from backend.protocol.tokens import ChunkTokens
from kvpool import Chunk, PoolClient, PoolConfig

__all__ = ["measure", "main"]

VALUE_BYTES = 1024  # small: what is timed is the put's bookkeeping and commit, not its bytes
RING_KEYS = 100_000
FILL_BATCH = 4096
PAST_ANY_SEQ = 1 << 62


def _chunks(prefix: str, start: int, count: int, tokens: int = 0) -> list[Chunk]:
    """``count`` chunks; with ``tokens``, each with that many token ids and the previous one as its parent."""
    return [
        Chunk(
            f"{prefix}@{n}",
            n.to_bytes(8, "little") * (VALUE_BYTES // 8),
            tokens=ChunkTokens(n - 1 if n else None, array("I", range(n, n + tokens))) if tokens else None,
        )
        for n in range(start, start + count)
    ]


def _pcts(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50": statistics.median(ordered), "p90": ordered[int(len(ordered) * 0.9)]}


async def _scenario(config: PoolConfig, rounds: int, batch: int, ring_keys: int, tokens: int) -> dict[str, Any]:
    async with PoolClient(config) as client:
        nodes = {info.node_id: info for info in await client.nodes(refresh=True)}
        fill = ring_keys + FILL_BATCH  # past the ring's capacity: it is full and drops entries from here on
        for node_id in nodes:
            for start in range(0, fill, FILL_BATCH):
                chunks = _chunks(f"fill-{node_id}", start, min(FILL_BATCH, fill - start), tokens)
                await client.put(chunks, only=[node_id])
        times: dict[str, list[float]] = {node_id: [] for node_id in nodes}
        order = sorted(nodes)
        last: list[Chunk] = []
        for r in range(rounds):
            for node_id in order if r % 2 else order[::-1]:
                last = _chunks(f"round-{node_id}", r * batch, batch, tokens)
                started = time.perf_counter()
                await client.put(last, only=[node_id])
                times[node_id].append((time.perf_counter() - started) * 1000)
        ring = nodes["ring"]
        page = await client.node_admin.events(ring, max(0, (await _next_seq(client, ring)) - 1), tokens=True)
        seen = {key for entry in page.entries for key in entry.keys}
        assert {c.key for c in _chunks("round-ring", (rounds - 1) * batch, batch)} <= seen, "the ring missed a put"
        if tokens:
            got = [t for entry in page.entries for t in entry.tokens or ()]
            assert got and all(t is not None and len(t.token_ids) == tokens for t in got), "the ring lost the tokens"
    figures = {node_id: _pcts(samples) for node_id, samples in times.items()}
    return {
        "rounds": rounds,
        "batch": batch,
        "value_bytes": VALUE_BYTES,
        "ring_keys": ring_keys,
        "tokens": tokens,
        "off_ms": figures["off"],
        "ring_ms": figures["ring"],
        "ratio_p50": figures["ring"]["p50"] / figures["off"]["p50"],
    }


async def _next_seq(client: PoolClient, node: NodeInfo) -> int:
    """The ring's next sequence number (asked from a cursor past it, a node answers with it)."""
    return (await client.node_admin.events(node, PAST_ANY_SEQ, 1)).next_seq


def measure(rounds: int = 300, batch: int = 16, ring_keys: int = RING_KEYS, tokens: int = 0) -> dict[str, Any]:
    """Put ack latency to a node with an event ring of ``ring_keys`` and to one without, interleaved; with
    ``tokens``, each chunk carries that many token ids."""
    redis = EmbeddedRedis().start()
    nodes: list[NodeProcess] = []
    try:
        dram = str((ring_keys + FILL_BATCH + rounds * batch) * VALUE_BYTES * 2)
        base = ["--redis", redis.url, "--namespace", "event-ack", "--dram", dram, "--nvme", "0"]
        base += ["--shm-dir", "off", "--prefault", "off"]
        nodes.append(NodeProcess([*base, "--node-id", "off"]).start())
        nodes.append(NodeProcess([*base, "--node-id", "ring", "--event-ring-keys", str(ring_keys)]).start())
        config = PoolConfig.from_url(f"kvpool://127.0.0.1:{redis.port}/event-ack?shm=off&progress_timeout_s=60")
        return asyncio.run(_scenario(config, rounds, batch, ring_keys, tokens))
    finally:
        for node in nodes:
            node.stop()
        redis.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="interleaved rounds (one put to each node a round)")
    parser.add_argument("--batch", type=int, default=16, help="chunks per put")
    parser.add_argument("--ring-keys", type=int, default=RING_KEYS, help="the ring node's --event-ring-keys")
    parser.add_argument("--tokens", type=int, default=0, help="token ids each chunk carries (default: none)")
    args = parser.parse_args(argv)
    if args.tokens < 0:
        parser.error(f"--tokens {args.tokens} is not a number of tokens")
    for name in ("rounds", "batch", "ring_keys"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not a positive number")
    out = measure(args.rounds, args.batch, args.ring_keys, args.tokens)
    with_tokens = f", each with {out['tokens']} token ids" if out["tokens"] else ""
    print(
        f"put of {out['batch']} chunks of {out['value_bytes']} B{with_tokens} to its ack, p50 (p90) of "
        f"{out['rounds']} interleaved rounds; both nodes full past the ring's {out['ring_keys']:,} keys"
    )
    print(f"  ring off: {out['off_ms']['p50']:.3f} ms ({out['off_ms']['p90']:.3f})")
    print(f"  ring on:  {out['ring_ms']['p50']:.3f} ms ({out['ring_ms']['p90']:.3f})")
    print(f"  ratio of p50s, on / off: {out['ratio_p50']:.3f}")


if __name__ == "__main__":
    main()
