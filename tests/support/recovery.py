"""Waiting for a restarted node's NVMe recovery: it serves while recovery runs, keys becoming hits as indexed."""

from __future__ import annotations

from kvpool import SyncPoolClient
from tests.support.waits import wait_until

__all__ = ["wait_recovered"]


def wait_recovered(client: SyncPoolClient, timeout_s: float = 30.0) -> bool:
    """Wait until every live node with an NVMe tier says (STAT) its recovery is done; False on timeout."""

    def done() -> bool:
        reports = [client.node_stats(node).get("recovery") for node in client.nodes()]
        return all(report is None or report.get("done", True) for report in reports)

    return wait_until(done, timeout_s)
