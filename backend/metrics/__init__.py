"""Prometheus metrics and /health for pool nodes; connector counters in LMCache's registry.

A node started with ``--metrics-port`` serves ``GET /metrics`` and ``GET /health`` on its
own event loop. Three parts:

* ``node.py``: the Prometheus mapping of a node's ``stats()`` and ``health()``
  (``NodeCollector`` and its families), read at scrape time, so nothing on the data
  path pays for metrics;
* ``server.py``: ``NodeMetricsServer``, the small HTTP server of ``/metrics`` and
  ``/health``, with its limits on request heads, time and connections;
* ``connector.py``: ``register_connector_metrics``, the LMCache connectors' counters in
  prometheus_client's default registry, where LMCache keeps its own metrics.

Every name emitted is listed in docs/metrics.md (a test keeps them in step).
"""

from backend.metrics.connector import (
    CONNECTOR_COUNTERS,
    CONNECTOR_PREFIX,
    POOL_UP,
    SNAPSHOT_ATTEMPTS,
    ConnectorCollector,
    register_connector_metrics,
    unregister_connector_metrics,
)
from backend.metrics.node import _RECOVERY_GAUGES, _TIER_GAUGES, METRIC_NAME, NODE_COUNTERS, NODE_PREFIX, NodeCollector
from backend.metrics.server import (
    LINGER_MAX_BYTES,
    LINGER_S,
    MAX_CONNECTIONS,
    MAX_HEADER_LINES,
    MAX_REQUEST_HEAD_BYTES,
    READ_TIMEOUT_S,
    WRITE_TIMEOUT_S,
    NodeMetricsServer,
)

__all__ = [
    "NodeMetricsServer",
    "register_connector_metrics",
    "unregister_connector_metrics",
    "NodeCollector",
    "ConnectorCollector",
    "NODE_PREFIX",
    "NODE_COUNTERS",
    "CONNECTOR_PREFIX",
    "POOL_UP",
    "CONNECTOR_COUNTERS",
    "METRIC_NAME",
    "MAX_REQUEST_HEAD_BYTES",
    "MAX_HEADER_LINES",
    "READ_TIMEOUT_S",
    "WRITE_TIMEOUT_S",
    "LINGER_S",
    "LINGER_MAX_BYTES",
    "MAX_CONNECTIONS",
    "SNAPSHOT_ATTEMPTS",
    "_TIER_GAUGES",  # the node's tier and recovery gauges, read by tests/test_docs_drift.py
    "_RECOVERY_GAUGES",
]
