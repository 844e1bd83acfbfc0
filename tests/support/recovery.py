"""Waiting for a restarted node's NVMe recovery: it serves while recovery runs, keys becoming hits as indexed."""

from __future__ import annotations

import time

from kvpool import SyncPoolClient

__all__ = ["wait_recovered"]


def wait_recovered(client: SyncPoolClient, timeout_s: float = 30.0) -> bool:
    """Wait until every live node with an NVMe tier says (STAT) its recovery is done; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reports = [client.node_stats(node).get("recovery") for node in client.nodes()]
        if all(report is None or report.get("done", True) for report in reports):
            return True
        time.sleep(0.05)
    return False
