"""A connection flood: the node sheds what it must, and says why to every connection it closes.

Before, a client shed under a flood (``--max-pending-connections``) or refused at a full
accept queue got an error with no text, or "closed the connection", which says nothing
of the node. Now a connection the node closes before its handshake is done (shed, or
past ``--handshake-timeout-s``) first gets an error frame for request id 0 naming the
reason, written without waiting; a kvpool client raises it as its NodeUnavailable, and a
connection that ends without a word, or a connect that gets no answer, still says what
happened. Real node processes; the flood is a process of its own (``tests/security/flood.py``).
What is promised: docs/protocol-connections.md, "Connection limits".
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import socket
import subprocess
import sys
import time

from backend.client.connection import NodeConnection
from backend.metadata import NodeInfo
from backend.protocol import Op, Status
from backend.protocol.frame import RESPONSE_BIT, error_for_status
from kvpool import NodeUnavailable, PoolClient, PoolConfig
from tests.conftest import REPO
from tests.faults.proxy import FaultProxy
from tests.security.wire import read_frame
from tests.support.waits import wait_until

TOKEN = "flood-token-" + "5e" * 16
CAP = 8
FLOOD_S = 1.5


def _node(node_factory, *extra: str):
    return node_factory("--max-pending-connections", str(CAP), *extra, env={"KVPOOL_TOKEN": TOKEN})


def _url(pool_url: str, timeout_s: float = 10.0) -> str:
    query = f"?connect_timeout_s={timeout_s:g}&progress_timeout_s={timeout_s:g}"
    return pool_url.replace("kvpool://", f"kvpool://:{TOKEN}@") + query


def _freeze(node) -> None:
    """SIGSTOP the node and wait until it is stopped (the signal lands a moment after it is sent)."""
    node.pause()

    def stopped() -> bool:
        with open(f"/proc/{node.pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"

    assert wait_until(stopped, 5.0, 0.005)


def _shed_reason(node_id: str) -> str:
    return f"node {node_id} shed this connection: over {CAP} connections without a finished handshake"


async def _handshake(url: str) -> BaseException | None:
    """One fresh connection's handshake, as a client makes it; what it failed with, if it did."""
    async with PoolClient(PoolConfig.from_url(url)) as client:
        [info] = await client.nodes()
        conn = NodeConnection(info, client.config)
        try:
            await conn.ensure_open()
            await conn.request(Op.PING, b"")
        except NodeUnavailable as exc:
            return exc
        finally:
            conn.close()
    return None


def test_a_real_client_shed_during_its_handshake_is_told_why(node_factory, pool_url):
    """The client's connection is the oldest pending one when a burst of others arrives: it is shed.

    The client reaches the node through a proxy that holds its bytes meanwhile (a slow
    link), so that its handshake cannot finish before the burst lands.
    """
    node = _node(node_factory)

    async def attempt() -> BaseException | None:
        async with PoolClient(PoolConfig.from_url(_url(pool_url))) as client:
            [info] = await client.nodes()
            shed_before = (await client.node_stats(info))["counters"].get("connections_shed", 0)
            with FaultProxy(node.port) as proxy:
                proxy.set("stall")
                slow = NodeConnection(dataclasses.replace(info, port=proxy.port), client.config)
                others: list[socket.socket] = []
                try:
                    handshake = asyncio.ensure_future(slow.ensure_open())
                    assert await asyncio.to_thread(wait_until, lambda: proxy.counters["accepted"] == 1, 5.0)
                    await asyncio.sleep(0.3)  # the node accepted the proxy's connection: the oldest pending one
                    for _ in range(3 * CAP):
                        others.append(await asyncio.to_thread(socket.create_connection, (node.host, node.port), 5))

                    async def shed() -> int:
                        return int((await client.node_stats(info))["counters"].get("connections_shed", 0))

                    while await shed() < shed_before + 2 * CAP + 1:
                        await asyncio.sleep(0.05)
                    proxy.set("pass")  # the held bytes move: the node's last word reaches the client
                    await handshake
                    return None
                except NodeUnavailable as exc:
                    return exc
                finally:
                    slow.close()
                    for sock in others:
                        sock.close()

    error = asyncio.run(asyncio.wait_for(attempt(), 30))
    assert isinstance(error, NodeUnavailable)
    assert str(error).startswith(_shed_reason(node.node_id)), str(error)
    assert "--max-pending-connections" in str(error)
    assert asyncio.run(_handshake(_url(pool_url))) is None  # and the next one gets in


def test_a_flood_of_connections_is_shed_and_every_shed_connection_is_told_why(node_factory, pool_url):
    node = _node(node_factory)
    flood = subprocess.Popen(
        [sys.executable, "-m", "tests.security.flood", node.host, str(node.port), str(FLOOD_S)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    failures: list[str] = []

    async def clients_meanwhile() -> int:
        attempts = 0
        while flood.poll() is None:
            attempts += 1
            error = await _handshake(_url(pool_url, timeout_s=2.0))
            if error is not None:
                failures.append(str(error))
        return attempts

    attempts = asyncio.run(clients_meanwhile())
    out, err = flood.communicate(timeout=60)
    assert flood.returncode == 0, err
    seen = json.loads(out)
    print(
        f"flood: {seen['connections']} connections in {seen['seconds']} s ({seen['rate_per_s']}/s); "
        f"{attempts} client handshakes meanwhile, {len(failures)} failed: {sorted(set(failures))}"
    )
    assert seen["connections"] > 10 * CAP, seen
    # Every connection the node closed was told why, and nothing else was said.
    assert seen["silent"] == 0 and seen["other"] == {}, seen
    assert seen["told"] + seen["open"] == seen["connections"], seen
    assert seen["open"] <= CAP, seen
    assert list(seen["reasons"]) and all(r.startswith(_shed_reason(node.node_id)) for r in seen["reasons"]), seen
    # A client that failed meanwhile says why; none says nothing.
    for text in failures:
        assert text.strip(), failures
        assert (
            text.startswith(_shed_reason(node.node_id))
            or "ended the connection during the handshake without a reason" in text
            or "timed out" in text
            or "no answer within" in text
        ), text
    assert asyncio.run(_handshake(_url(pool_url))) is None  # the flood is over: clients get in


def test_a_connection_past_the_handshake_deadline_is_told_why(node_factory):
    node = _node(node_factory, "--handshake-timeout-s", "0.5")
    with socket.create_connection((node.host, node.port), timeout=10) as sock:  # and says nothing
        last = read_frame(sock)
        assert last is not None, "closed without a word"
        header, message = last
        assert (header.op, header.request_id, header.status) == (Op.PING | RESPONSE_BIT, 0, Status.UNAVAILABLE)
        error = error_for_status(header.status, message.decode())
        assert isinstance(error, NodeUnavailable)
        assert str(error) == (
            f"node {node.node_id} closed this connection: its handshake did not finish within 0.5 s of the "
            "connect (--handshake-timeout-s)"
        )
        assert read_frame(sock) is None  # then the close


def test_a_connect_the_node_cannot_answer_is_named_not_an_empty_message(node_factory, pool_url):
    """A frozen node's accept queue filled by a flood: the next connect gets no answer at all."""
    node = _node(node_factory)
    url = _url(pool_url, timeout_s=0.5)
    filler: list[socket.socket] = []
    _freeze(node)
    try:
        for _ in range(600):  # past the listen backlog (512): later SYNs are dropped
            sock = socket.socket()
            sock.setblocking(False)
            code = sock.connect_ex((node.host, node.port))
            assert code in (0, errno.EINPROGRESS), code
            filler.append(sock)
        time.sleep(0.2)
        error = asyncio.run(_handshake(url))
    finally:
        node.resume()
        for sock in filler:
            sock.close()
    assert isinstance(error, NodeUnavailable)
    text = str(error)
    assert text.startswith(f"cannot connect to {node.host}:{node.port}: no answer within 500 ms"), text
    assert "accept queue is full" in text


def test_a_connection_closed_without_a_word_during_the_handshake_still_says_what_happened():
    """A listener that accepts and closes at once (no kvpool node): the client's error is not empty."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    async def attempt() -> BaseException | None:
        conn = NodeConnection(NodeInfo("mute", "127.0.0.1", port, 1), PoolConfig(token=TOKEN))
        accepting = asyncio.ensure_future(asyncio.to_thread(lambda: listener.accept()[0].close()))
        try:
            await conn.ensure_open()
        except NodeUnavailable as exc:
            return exc
        finally:
            conn.close()
            await accepting
        return None

    try:
        error = asyncio.run(attempt())
    finally:
        listener.close()
    assert isinstance(error, NodeUnavailable)
    assert str(error).startswith(
        f"node mute (127.0.0.1:{port}) ended the connection during the handshake without a reason: "
    ), str(error)
