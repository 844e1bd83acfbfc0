"""Prometheus metrics and /health for pool nodes; connector counters in LMCache's registry.

A node started with ``--metrics-port`` serves, on its own event loop (no thread):

* ``GET /metrics``: Prometheus text (OpenMetrics when the scraper asks for it) from a
  registry of its own, filled at scrape time from ``PoolNode.stats()`` and ``health()``,
  so nothing on the data path pays for metrics;
* ``GET /health``: ``health()`` as JSON, 200 while its status is ``ok``, else 503.

Anything else is 404. One request per connection; a request head is bounded in size
and must arrive within a timeout, so a slow or broken client cannot hold the endpoint.

``register_connector_metrics`` puts the LMCache connector's counters into
prometheus_client's default registry, where LMCache keeps its own metrics.

Every name emitted here is listed in docs/operations.md (a test keeps them in step).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from backend.errors import NodeUnavailable
from backend.latency import LatencyHistograms

__all__ = ["NodeMetricsServer", "register_connector_metrics", "unregister_connector_metrics"]

logger = logging.getLogger(__name__)

NODE_PREFIX = "kvpool_node_"
CONNECTOR_PREFIX = "kvpool_connector_"
MAX_REQUEST_HEAD_BYTES = 8192  # request line + headers; a Prometheus scrape sends a few hundred
MAX_HEADER_LINES = 64
READ_TIMEOUT_S = 5.0  # the whole request head must arrive within this
WRITE_TIMEOUT_S = 10.0  # a client that does not read its response is dropped
LINGER_S = 1.0  # after an error answer, how long to read off what the client still sends
LINGER_MAX_BYTES = 1 << 20
MAX_CONNECTIONS = 16  # the node's file descriptors belong to the data path first
SNAPSHOT_ATTEMPTS = 3

_METRIC_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# Counters a node always exposes, 0 until they first happen, so that rate() and ratios
# work from the first scrape. Any other counter the node reports appears once non-zero.
NODE_COUNTERS: dict[str, str] = {
    "puts": "Chunks stored and committed to the index.",
    "put_bytes": "Payload bytes of chunks stored.",
    "put_rejected_capacity": "Chunks of a put refused for lack of capacity (the client tries another node).",
    "put_rejected_busy": "Chunks of a put refused as busy: DRAM stayed full of puts in flight until the put's deadline.",
    "gets": "Keys asked for by GET requests.",
    "hits": "Keys a GET found and returned.",
    "misses": "Keys a GET did not return.",
    "get_bytes": "Payload bytes returned by GETs.",
    "get_over_frame_limit": "Chunks held but not returned because the response frame was full (also misses).",
    "deletes": "Chunks removed by DELETE requests.",
    "evictions": "Chunks dropped from DRAM for room (no NVMe tier, or the disk would not take them).",
    "demotions": "Chunks moved from DRAM to NVMe.",
    "promotions": "Chunks read back from NVMe into DRAM.",
    "nvme_writes": "Files written to the NVMe tier.",
    "nvme_reads": "Chunks read from the NVMe tier.",
    "nvme_evictions": "Files deleted from the NVMe tier for room.",
    "disk_full": "Disk-full episodes: the disk refused an NVMe write (ENOSPC/EDQUOT) and demotion paused.",
    "integrity_failures": "Checksum mismatches: on arrival of a put, in DRAM, or on NVMe read.",
    "quarantined": "NVMe files moved to quarantine/.",
    "republished": "Index entries republished after Redis lost the namespace.",
    "auth_failures": "Requests refused for a missing or wrong token.",
    "tls_failures": "Connections closed because their TLS handshake failed (a plaintext client, an untrusted peer).",
    "protocol_errors": "Connections or requests refused as malformed.",
    "request_errors": "Requests answered with an error.",
    "stalled_connections": "Connections closed because a frame stalled mid-way.",
    "handshake_timeouts": "Connections closed because they did not finish their handshake in time.",
    "connections_shed": "Connections closed, oldest first, beyond the cap on those without a finished handshake.",
    "accept_errors": "Failed accepts (EMFILE and the like).",
    "requests": "Requests answered successfully (HELLO and AUTH not counted).",
    "shm_get_bytes": "Payload bytes same-host clients copied from the shared-memory arena (not sent).",
    "staged_put_bytes": "Payload bytes of staged puts: copied in from same-host clients' stages (not received).",
    "leases_granted": "Leases granted (same-host reads and locks).",
    "leases_released": "Leases ended by their client.",
    "leases_expired": "Leases ended by their deadline (client gone or slow).",
    "leases_refused": "Leases refused because the node held its maximum.",
    "leases_disconnected": "Leases ended because the connection that took them closed (client gone).",
    "connections_accepted": "Client connections accepted.",
}


class NodeCollector:
    """Reads one node's ``stats()`` and ``health()`` at scrape time and yields its families."""

    def __init__(self, stats: Callable[[], dict[str, Any]], health: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats
        self.health = health

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        node = str(stats["node_id"])
        yield from _node_counters(node, stats.get("counters") or {})
        yield _gauge("uptime_seconds", "Seconds since the node process started.", node, stats["uptime_s"])
        yield _gauge("epoch", "Epoch this node took at its start (a restart takes a new one).", node, stats["epoch"])
        yield _gauge("objects", "Distinct chunks held, over all tiers.", node, stats["objects"])
        yield _gauge("leases", "Leases currently held by clients.", node, stats.get("leases", 0))
        arena = stats.get("arena")
        if arena:
            yield _gauge("arena_allocated_bytes", "Bytes of the shared-memory arena in use.", node,
                         arena["allocated_bytes"])  # fmt: skip
            yield _gauge("arena_grown_bytes", "Bytes of the shared-memory arena backed by memory.", node,
                         arena["grown_bytes"])  # fmt: skip
        healthy = 1 if self.health().get("status") == "ok" else 0
        yield _gauge("healthy", "1 while /health answers ok, else 0.", node, healthy)
        yield from _tier_gauges(node, stats.get("tiers") or {})
        recovery = stats.get("recovery")
        if recovery:
            yield from _recovery_gauges(node, recovery)
        latency = stats.get("latency")
        histograms = _latency_histogram(node, latency) if latency else None
        if histograms is not None:
            yield histograms


def _gauge(name: str, documentation: str, node: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(NODE_PREFIX + name, documentation, labels=["node"])
    family.add_metric([node], value)
    return family


def _node_counters(node: str, counters: Mapping[str, int]) -> Iterator[Metric]:
    values = {name: 0 for name in NODE_COUNTERS} | dict(counters)
    for name in sorted(values):
        if not _METRIC_NAME.fullmatch(name):
            logger.warning("metrics: node counter %r is not a valid metric name; skipped", name)
            continue
        family = CounterMetricFamily(NODE_PREFIX + name, NODE_COUNTERS.get(name, f"Node counter {name}."),
                                     labels=["node"])  # fmt: skip
        family.add_metric([node], values[name])
        yield family


_TIER_GAUGES = {
    "capacity_bytes": "Configured size of the tier.",
    "used_bytes": "Bytes taken in the tier (DRAM: stored plus reserved for puts in flight; NVMe: file sizes).",
    "objects": "Chunks held in the tier.",
    "disk_full": "1 while the disk refuses writes and the node does not demote (NVMe only).",
}


def _tier_gauges(node: str, tiers: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    for field, documentation in _TIER_GAUGES.items():
        family = GaugeMetricFamily(NODE_PREFIX + "tier_" + field, documentation, labels=["node", "tier"])
        for tier, values in sorted(tiers.items()):
            if field in values:
                family.add_metric([node, tier], float(values[field]))
        if family.samples:
            yield family


_RECOVERY_GAUGES = {
    "files": "Chunk files found on NVMe at the last start.",
    "bytes": "Bytes of those files.",
    "quarantined": "Files quarantined by the last start's scan.",
    "temp_removed": "Temporary files (crash debris) removed by the last start's scan.",
    "seconds": "Duration of the last start's scan.",
}


def _recovery_gauges(node: str, recovery: Mapping[str, Any]) -> Iterator[Metric]:
    for field, documentation in _RECOVERY_GAUGES.items():
        if field in recovery:
            yield _gauge("recovery_" + field, documentation, node, float(recovery[field]))


def _latency_histogram(node: str, latency: Mapping[str, Any]) -> Metric | None:
    """The node's service time per op since it started, in its fixed buckets (``backend.latency``)."""
    family = HistogramMetricFamily(NODE_PREFIX + "request_latency_seconds",
                                   "Service time of successful requests, from header received to reply sent.",
                                   labels=["node", "op"])  # fmt: skip
    for op, histogram in sorted(LatencyHistograms.from_json(latency).ops.items()):
        buckets = [("+Inf" if math.isinf(bound) else repr(bound), count) for bound, count in histogram.cumulative()]
        family.add_metric([node, op], buckets, histogram.sum_s)
    return family if family.samples else None


class NodeMetricsServer:
    """HTTP endpoint of one node: ``/metrics`` (Prometheus text) and ``/health`` (JSON).

    ``stats`` returns ``PoolNode.stats()``; ``health`` returns ``PoolNode.health()``.
    Both are read at scrape time, so nothing on the data path pays for metrics.
    ``port`` is the bound port once ``start()`` returned (useful with port 0).
    """

    def __init__(self, stats: Callable[[], dict[str, Any]], health: Callable[[], dict[str, Any]], host: str,
                 port: int) -> None:  # fmt: skip
        self.stats = stats
        self.health = health
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(stats, health))
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._reading: dict[asyncio.StreamWriter, None] = {}  # still reading a request head, oldest first

    async def start(self) -> None:
        """Bind and serve. Raises NodeUnavailable naming ``metrics_port`` if the address cannot be bound.

        A taken port is a fact of the machine at run time, not a bad flag: exit 1, not 2."""
        # One socket, so that port 0 means one port even for a wildcard host.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            sock = socket.create_server((self.host, self.port), family=family, backlog=64)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise NodeUnavailable(f"metrics_port: cannot listen on {self.host}:{self.port}: {reason}") from None
        sock.setblocking(False)
        self._server = await asyncio.start_server(self._serve, sock=sock, limit=MAX_REQUEST_HEAD_BYTES)
        self.port = int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting and close the connections being served."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= MAX_CONNECTIONS:
            # Full: drop the oldest connection still sending its head rather than the new
            # one, so clients that connect and say nothing cannot lock scrapers out.
            if not self._reading:
                writer.close()
                return
            next(iter(self._reading)).close()
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        self._reading[writer] = None
        try:
            try:
                status, response = await self._read_and_answer(reader)
            finally:
                self._reading.pop(writer, None)
            if response:
                writer.write(response)
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await writer.drain()
            if status in _MAY_LEAVE_INPUT:
                await _linger(reader, writer)
        except (OSError, TimeoutError):
            pass  # the client went away or stopped reading; nothing to tell it
        finally:
            writer.close()
            self._writers.discard(writer)
            self._reading.pop(writer, None)
            self._handlers.discard(task)

    async def _read_and_answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                lines = await _read_head(reader)
        except TimeoutError:
            return _response(408, b"request head not received in time\n")
        except _HeadTooLarge:
            return _response(431, b"request head too large\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return 0, b""  # closed before a whole request: nobody to answer
        return self._answer(lines)

    def _answer(self, lines: list[str]) -> tuple[int, bytes]:
        parts = lines[0].split() if lines else []
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _response(400, b"malformed request line\n")
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return _response(405, b"only GET and HEAD\n", extra={"Allow": "GET, HEAD"})
        headers = _parse_headers(lines[1:])
        if headers is None:
            return _response(400, b"malformed header line\n")
        path = urlsplit(target).path
        head_only = method == "HEAD"
        try:
            if path == "/metrics":
                encoder, content_type = choose_encoder(headers.get("accept", ""))
                return _response(200, encoder(self.registry), content_type, head_only=head_only)
            if path == "/health":
                health = self.health()
                status = 200 if health.get("status") == "ok" else 503
                body = json.dumps(health, sort_keys=True, default=str).encode() + b"\n"
                return _response(status, body, "application/json", head_only=head_only)
        except Exception:
            # A bug in stats() must not take the node down; the scrape shows it as a 500.
            logger.exception("metrics: %s %s failed", method, path)
            return _response(500, b"internal error; see the node's log\n", head_only=head_only)
        return _response(404, b"not found: try /metrics or /health\n", head_only=head_only)


class _HeadTooLarge(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> list[str]:
    """Read a request line and headers up to the blank line, bounded in size."""
    lines: list[str] = []
    total = 0
    while True:
        try:
            raw = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            raise _HeadTooLarge from None
        total += len(raw)
        if total > MAX_REQUEST_HEAD_BYTES or len(lines) > MAX_HEADER_LINES:
            raise _HeadTooLarge
        line = raw.rstrip(b"\r\n").decode("latin-1")
        if not line:
            if lines:
                return lines
            continue  # tolerate blank lines before the request line (RFC 9112 2.2)
        lines.append(line)


def _parse_headers(lines: list[str]) -> dict[str, str] | None:
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return None
        headers[name.lower()] = value.strip()
    return headers


_MAY_LEAVE_INPUT = {400, 405, 431}  # answers given before the request was read to its end

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}  # fmt: skip


def _response(status: int, body: bytes, content_type: str = "text/plain; charset=utf-8", *, head_only: bool = False,
              extra: Mapping[str, str] | None = None) -> tuple[int, bytes]:  # fmt: skip
    headers = {"Content-Type": content_type, "Content-Length": str(len(body)), "Connection": "close",
               "Cache-Control": "no-store", **(extra or {})}  # fmt: skip
    head = f"HTTP/1.1 {status} {_REASONS[status]}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return status, (head + "\r\n").encode("latin-1") + (b"" if head_only else body)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After an error answer, read off what the client still sends (bounded) before closing.

    Closing a socket with unread input sends a reset, which can destroy the answer
    before the client reads it.
    """
    if writer.can_write_eof():
        writer.write_eof()
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(LINGER_S):
            discarded = 0
            while discarded < LINGER_MAX_BYTES and (data := await reader.read(65536)):
                discarded += len(data)


# -- connector counters (default registry) ------------------------------------------------

CONNECTOR_COUNTERS: dict[str, str] = {
    "put_chunks": "Chunks LMCache handed to the pool and the pool stored.",
    "put_skipped_busy": "Chunks of LMCache's puts not stored because every node tried was busy (skipped, not errors).",
    "get_hits": "Chunks LMCache asked the pool for and received.",
    "get_misses": "Chunks LMCache asked the pool for and did not receive.",
    "shm_get_bytes": "Bytes read through a same-host node's shared-memory arena instead of TCP.",
    "get_bytes_tcp": "Payload bytes of hits received over the nodes' TCP protocol.",
    "staged_put_bytes": "Payload bytes put through this client's stage to a node on its host, instead of TCP.",
    "get_bytes_channel": "Payload bytes of hits received over the channel (nccl=on, same cluster).",
    "channel_fallbacks": "Chunks the channel failed to bring (NcclError, node or pair failure), then read over TCP.",
}


class ConnectorCollector:
    """The connectors' counters, one ``plugin`` label value per registered connector."""

    def __init__(self) -> None:
        self._sources: dict[str, Callable[[], Mapping[str, int]]] = {}
        self._lock = threading.Lock()  # LMCache scrapes from its own thread

    def set(self, plugin: str, counters: Callable[[], Mapping[str, int]]) -> None:
        with self._lock:
            self._sources[plugin] = counters

    def remove(self, plugin: str) -> None:
        with self._lock:
            self._sources.pop(plugin, None)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            sources = sorted(self._sources.items())
        families: dict[str, CounterMetricFamily] = {}
        for plugin, counters in sources:
            values = _snapshot(plugin, counters)
            if values is None:
                continue
            for name in sorted({**dict.fromkeys(CONNECTOR_COUNTERS, 0), **values}):
                if not _METRIC_NAME.fullmatch(name):
                    continue
                family = families.get(name)
                if family is None:
                    documentation = CONNECTOR_COUNTERS.get(name, f"Connector counter {name}.")
                    if name.startswith("miss_"):
                        documentation = f"Calls whose {name[5:]} failed and read as misses (or were skipped)."
                    family = families[name] = CounterMetricFamily(CONNECTOR_PREFIX + name, documentation,
                                                                  labels=["plugin"])  # fmt: skip
                family.add_metric([plugin], values.get(name, 0))
        return list(families.values())


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


def register_connector_metrics(counters: Callable[[], Mapping[str, int]], plugin: str) -> None:
    """Expose a connector's counters as ``kvpool_connector_<name>_total{plugin=...}``.

    Goes into prometheus_client's default ``REGISTRY`` (LMCache's metrics live there).
    Registering the same ``plugin`` again replaces the earlier source.
    """
    global _connector_collector
    with _connector_lock:
        if _connector_collector is None:
            collector = ConnectorCollector()
            collector.set(plugin, counters)
            REGISTRY.register(collector)
            _connector_collector = collector
        else:
            _connector_collector.set(plugin, counters)


def unregister_connector_metrics(plugin: str) -> None:
    """Stop exposing ``plugin``'s counters (e.g. when its connector closes)."""
    with _connector_lock:
        if _connector_collector is not None:
            _connector_collector.remove(plugin)
