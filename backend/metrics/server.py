"""The HTTP endpoint of a pool node, served on the node's own event loop (no thread).

* ``GET /metrics``: Prometheus text (OpenMetrics when the scraper asks for it) from a
  registry of its own, holding a ``NodeCollector`` (``backend/metrics/node.py``);
* ``GET /health``: ``health()`` as JSON, 200 while its status is ``ok``, else 503.

Anything else is 404. One request per connection; a request head is bounded in size
and must arrive within a timeout, so a slow or broken client cannot hold the endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from backend.errors import NodeUnavailable
from backend.metrics.node import NodeCollector
from backend.protocol.reports import NodeReport

__all__ = ["MAX_CONNECTIONS", "NodeMetricsServer"]

logger = logging.getLogger(__name__)

MAX_REQUEST_HEAD_BYTES = 8192  # request line + headers; a Prometheus scrape sends a few hundred
MAX_HEADER_LINES = 64
READ_TIMEOUT_S = 5.0  # the whole request head must arrive within this
WRITE_TIMEOUT_S = 10.0  # a client that does not read its response is dropped
LINGER_S = 1.0  # after an error answer, how long to read off what the client still sends
LINGER_MAX_BYTES = 1 << 20
MAX_CONNECTIONS = 16  # the node's file descriptors belong to the data path first


class NodeMetricsServer:
    """HTTP endpoint of one node: ``/metrics`` (Prometheus text) and ``/health`` (JSON).

    ``report`` returns ``PoolNode.report()``; ``health`` returns ``PoolNode.health()``.
    Both are read at scrape time, so nothing on the data path pays for metrics.
    ``port`` is the bound port once ``start()`` returned (useful with port 0).
    """

    def __init__(
        self, report: Callable[[], NodeReport], health: Callable[[], dict[str, Any]], host: str, port: int
    ) -> None:
        self.report = report
        self.health = health
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(report, health))
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
            # A bug in report() must not take the node down; the scrape shows it as a 500.
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

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def _response(
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
    extra: Mapping[str, str] | None = None,
) -> tuple[int, bytes]:
    headers = {
        "Content-Type": content_type,
        "Content-Length": str(len(body)),
        "Connection": "close",
        "Cache-Control": "no-store",
        **(extra or {}),
    }
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
