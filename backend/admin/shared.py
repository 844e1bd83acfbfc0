"""What the admin verb families share: the key pattern of --model/--prefix, the nodes' STAT
answers, and a node that refused this client's token, named."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backend.client import PoolClient
from backend.client.index import glob_escape
from backend.errors import AuthError, ConfigError, KVPoolError
from backend.metadata import NodeInfo
from backend.protocol.reports import NodeReport

SCAN_BATCH = 1000  # index keys per batch when evicting or flushing by pattern

Progress = Callable[[int, int], None]  # (done, total)


def key_pattern(model: str | None, prefix: str | None) -> str:
    if model and prefix:
        raise ConfigError("--prefix", "give --model or --prefix, not both")
    if model:
        return glob_escape(model) + "@*"
    if prefix:
        return glob_escape(prefix) + "*"
    return "*"


def refusal(node: NodeInfo, exc: AuthError) -> AuthError:
    """``exc`` naming the node that refused (the node's own answer does not)."""
    text = str(exc).removeprefix("node: ")
    named = f"node {node.node_id}"
    if named in text:
        return AuthError(text.replace(named, f"{named} ({node.address})", 1))
    return AuthError(f"{named} ({node.address}) refused the request: {text}")


async def stats_of(client: PoolClient, nodes: Sequence[NodeInfo]) -> dict[str, NodeReport]:
    """Each live node's STAT answer. A node that refuses the token fails the call: figures
    without it would look like an empty pool. One that does not answer is left out."""
    out: dict[str, NodeReport] = {}
    for node in nodes:
        if node.alive:
            try:
                out[node.node_id] = await client.node_admin.stats(node)
            except AuthError as exc:
                raise refusal(node, exc) from None
            except KVPoolError:
                pass  # the registry's figures (up to a heartbeat old) stand
    return out
