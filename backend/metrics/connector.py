"""The LMCache connectors' counters, in prometheus_client's default registry.

LMCache keeps its own metrics in that registry; ``register_connector_metrics`` puts
each connector's counters beside them as ``kvpool_connector_<name>_total{plugin=...}``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from backend.counters import ClientCounter, ConnectorCounter
from backend.metrics.node import METRIC_NAME

__all__ = [
    "CONNECTOR_COUNTERS",
    "CONNECTOR_PREFIX",
    "POOL_UP",
    "PoolState",
    "register_connector_metrics",
    "unregister_connector_metrics",
]

logger = logging.getLogger(__name__)

CONNECTOR_PREFIX = "kvpool_connector_"
SNAPSHOT_ATTEMPTS = 3
POOL_UP = CONNECTOR_PREFIX + "pool_up"
POOL_UP_HELP = (
    "1 when the connector's last check reached Redis with its credentials and found a live node in its "
    "namespace, else 0 with the cause (a docs/troubleshooting.md anchor) as a label."
)

# A connector's view of its pool: (usable, cause: the troubleshooting anchor when not); None before its first check.
PoolState = Callable[[], "tuple[bool, str] | None"]

CONNECTOR_COUNTERS: dict[str, str] = {
    ConnectorCounter.PUT_CHUNKS: "Chunks LMCache handed to the pool and the pool stored.",
    ConnectorCounter.PUT_SKIPPED_BUSY: "Chunks of LMCache's puts not stored because every node tried was busy (skipped, not errors).",
    ConnectorCounter.GET_HITS: "Chunks LMCache asked the pool for and received.",
    ConnectorCounter.GET_MISSES: "Chunks LMCache asked the pool for and did not receive.",
    ConnectorCounter.EVENT_TOKENS_BOUND: "Chunks put with their token ids and parent hash (event_tokens=on).",
    ConnectorCounter.EVENT_TOKENS_UNBOUND: "Chunks put without token ids (event_tokens=on): LMCache's token database "
    "did not hash them from tokens lately.",
    ConnectorCounter.EVENT_TOKENS_NO_DATABASE: "Chunks put without token ids (event_tokens=on) because no LMCache engine "
    "in the process holds this connector.",
    ClientCounter.SHM_GET_BYTES: "Bytes read through a same-host node's shared-memory arena instead of TCP.",
    ClientCounter.GET_BYTES_TCP: "Payload bytes of hits received over the nodes' TCP protocol.",
    ClientCounter.STAGED_PUT_BYTES: "Payload bytes put through this client's stage to a node on its host, instead of TCP.",
    ClientCounter.GET_BYTES_CHANNEL: "Payload bytes of hits received over the channel (nccl=on, same cluster).",
    ClientCounter.CHANNEL_FALLBACKS: "Chunks the channel failed to bring (NcclError, node or pair failure), then read over TCP.",
    ClientCounter.LAYOUT_MISSES: "Chunks LMCache asked for that the pool holds from an engine of another KV layout "
    "(another layout fingerprint): read as misses, no bytes.",
    ConnectorCounter.TENANT_REFUSED: "Keys whose request tag (tenant_tag=NAME) names no valid tenant: not stored, "
    "read as misses.",
}


class ConnectorCollector:
    """The connectors' counters, one ``plugin`` label value per registered connector."""

    def __init__(self) -> None:
        self._sources: dict[str, Callable[[], Mapping[str, int]]] = {}
        self._states: dict[str, PoolState] = {}
        self._lock = threading.Lock()  # LMCache scrapes from its own thread

    def set(self, plugin: str, counters: Callable[[], Mapping[str, int]], state: PoolState | None = None) -> None:
        with self._lock:
            self._sources[plugin] = counters
            if state is not None:
                self._states[plugin] = state
            else:
                self._states.pop(plugin, None)

    def remove(self, plugin: str) -> None:
        with self._lock:
            self._sources.pop(plugin, None)
            self._states.pop(plugin, None)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            sources = sorted(self._sources.items())
            states = sorted(self._states.items())
        out: list[Metric] = []
        up = GaugeMetricFamily(POOL_UP, POOL_UP_HELP, labels=["plugin", "cause"])
        for plugin, state in states:
            seen = state()
            if seen is not None:
                usable, cause = seen
                up.add_metric([plugin, "" if usable else cause], 1 if usable else 0)
        if up.samples:
            out.append(up)
        families: dict[str, CounterMetricFamily] = {}
        for plugin, counters in sources:
            values = _snapshot(plugin, counters)
            if values is None:
                continue
            for name in sorted({**dict.fromkeys(CONNECTOR_COUNTERS, 0), **values}):
                if not METRIC_NAME.fullmatch(name):
                    continue
                family = families.get(name)
                if family is None:
                    documentation = CONNECTOR_COUNTERS.get(name, f"Connector counter {name}.")
                    if name.startswith("miss_"):
                        documentation = f"Calls whose {name[5:]} failed and read as misses (or were skipped)."
                    family = families[name] = CounterMetricFamily(
                        CONNECTOR_PREFIX + name, documentation, labels=["plugin"]
                    )
                family.add_metric([plugin], values.get(name, 0))
        return out + list(families.values())


def _snapshot(plugin: str, counters: Callable[[], Mapping[str, int]]) -> dict[str, int] | None:
    """Copy a connector's counters; they may change on another thread while we copy."""
    for _ in range(SNAPSHOT_ATTEMPTS):
        try:
            return {str(k): int(v) for k, v in dict(counters()).items()}
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
        except Exception:
            logger.exception("metrics: reading the counters of plugin %r failed", plugin)
            return None
    logger.warning("metrics: the counters of plugin %r kept changing while read; left out of this scrape", plugin)
    return None


_connector_collector: ConnectorCollector | None = None
_connector_lock = threading.Lock()


def register_connector_metrics(
    counters: Callable[[], Mapping[str, int]], plugin: str, state: PoolState | None = None
) -> None:
    """Expose a connector's counters as ``kvpool_connector_<name>_total{plugin=...}``, and with ``state``
    whether its pool is usable as ``kvpool_connector_pool_up{plugin=...,cause=...}``.

    Goes into prometheus_client's default ``REGISTRY`` (LMCache's metrics live there).
    Registering the same ``plugin`` again replaces the earlier source.
    """
    global _connector_collector
    with _connector_lock:
        if _connector_collector is None:
            collector = ConnectorCollector()
            collector.set(plugin, counters, state)
            REGISTRY.register(collector)
            _connector_collector = collector
        else:
            _connector_collector.set(plugin, counters, state)


def unregister_connector_metrics(plugin: str) -> None:
    """Stop exposing ``plugin``'s counters (e.g. when its connector closes)."""
    with _connector_lock:
        if _connector_collector is not None:
            _connector_collector.remove(plugin)
