"""A connection flood, run as its own process: ``python -m tests.security.flood HOST PORT SECONDS``.

Opens connections to HOST:PORT as fast as one process can for SECONDS, sends nothing
and keeps every one open; then looks at what each got without waiting: the node's
reason for closing it (an error frame for request id 0), a close without a word, or
nothing yet (still open: among the node's pending ones). Prints one JSON line: counts,
the rate, and each distinct reason with how many got it. Tests run it beside real
clients (tests/security/test_flood.py).
"""

from __future__ import annotations

import json
import resource
import socket
import sys
import time
from collections import Counter

from backend.protocol import Op, Status
from backend.protocol.frame import HEADER, RESPONSE_BIT, decode_header

CONNECT_TIMEOUT_S = 2.0


def _outcome(sock: socket.socket) -> str:
    """``told: REASON``, ``silent`` or ``open``, from what is already there to read."""
    sock.setblocking(False)  # (a socket with a timeout would wait for it before each recv)
    try:
        data = sock.recv(65536, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return "open"
    except OSError:
        return "silent"  # reset before anything arrived
    if len(data) < HEADER.size:
        return "silent"
    header = decode_header(data[: HEADER.size])
    message = data[HEADER.size : HEADER.size + header.meta_len]
    if (header.op, header.request_id, header.status) != (Op.PING | RESPONSE_BIT, 0, Status.UNAVAILABLE):
        return f"unexpected frame: op {header.op} id {header.request_id} status {header.status}"
    return "told: " + message.decode("utf-8", "replace")


def flood(host: str, port: int, seconds: float) -> dict[str, object]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[socket.socket] = []
    refused = 0
    started = time.monotonic()
    while time.monotonic() - started < seconds and len(held) < hard - 64:
        try:
            held.append(socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S))
        except OSError:
            refused += 1
    elapsed = time.monotonic() - started
    time.sleep(0.5)  # the node's answers to the last ones arrive
    outcomes = Counter(_outcome(sock) for sock in held)
    for sock in held:
        sock.close()
    told = {k[len("told: ") :]: n for k, n in outcomes.items() if k.startswith("told: ")}
    return {
        "connections": len(held),
        "connect_failures": refused,
        "seconds": round(elapsed, 3),
        "rate_per_s": round(len(held) / elapsed),
        "told": sum(told.values()),
        "silent": outcomes["silent"],
        "open": outcomes["open"],
        "reasons": told,
        "other": {k: n for k, n in outcomes.items() if k not in ("silent", "open") and not k.startswith("told: ")},
    }


if __name__ == "__main__":
    print(json.dumps(flood(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))), flush=True)
