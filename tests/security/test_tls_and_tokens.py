"""Auth and transport security: the pool token, TLS to nodes, TLS and ACL users for Redis.

Every certificate here is made by the test (a private CA signs one certificate for
Redis, named 127.0.0.1, and one for nodes, named localhost); nothing is read from
the system. Real redis-server and node processes, as everywhere.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from backend.cli import main
from backend.embedded import EmbeddedRedis
from backend.protocol import Op
from backend.protocol.frame import encode_header, error_for_status
from backend.protocol.meta import encode_json
from backend.transport import FrameSocket, client_tls_context
from kvpool import (
    AuthError,
    Chunk,
    ConfigError,
    MetadataError,
    NodeUnavailable,
    PoolClient,
    PoolConfig,
    ProtocolError,
    SyncPoolClient,
)

REDIS_USER = "kvpool"
REDIS_PASSWORD = "s3cret-redis"
TOKEN = "pool-token-7d1e-0123456789abcdef"
TIMEOUT_S = 10.0


# -- a private CA, made here ---------------------------------------------------------
def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _make_ca(directory: Path, label: str) -> tuple[Path, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(label))
        .issuer_name(_name(label))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _write_cert(directory / f"{label}.pem", cert), cert, key


def _make_leaf(
    directory: Path, label: str, names: list[x509.GeneralName], ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(label))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _write_cert(directory / f"{label}.crt", cert), _write_key(directory / f"{label}.key", key)


@dataclass
class Pki:
    ca: Path
    other_ca: Path  # a CA that signed nothing here: trusting it alone must fail
    redis_cert: Path
    redis_key: Path
    node_cert: Path
    node_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, ca_cert, ca_key = _make_ca(directory, "kvpool-test-ca")
    other_ca, _, _ = _make_ca(directory, "some-other-ca")
    redis_cert, redis_key = _make_leaf(
        directory, "redis", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))], ca_cert, ca_key
    )
    node_cert, node_key = _make_leaf(directory, "node", [x509.DNSName("localhost")], ca_cert, ca_key)
    return Pki(ca, other_ca, redis_cert, redis_key, node_cert, node_key)


@pytest.fixture(scope="module")
def secure_redis(processes: None, pki: Pki) -> Iterator[EmbeddedRedis]:
    """redis-server over TLS only, whose default user is off: only the ACL user gets in."""
    acl = ["--user", REDIS_USER, "on", f">{REDIS_PASSWORD}", "~*", "&*", "+@all", "--user", "default", "off"]
    with EmbeddedRedis(tls=(pki.redis_cert, pki.redis_key, pki.ca), args=acl) as server:
        yield server


def _secure_url(pki: Pki, redis: EmbeddedRedis, namespace: str, *, token: str = TOKEN, **options: str) -> str:
    query = {"tls": "on", "tls_ca": str(pki.ca), "redis_user": REDIS_USER, "redis_password": REDIS_PASSWORD}
    query.update(options)
    auth = f":{token}@" if token else ""
    tail = "&".join(f"{k}={v}" for k, v in query.items() if v)
    return f"kvpool://{auth}127.0.0.1:{redis.port}/{namespace}?{tail}"


@pytest.fixture
def secure_node(node_factory, secure_redis: EmbeddedRedis, pki: Pki, tmp_path: Path):
    """Start a node that serves TLS, needs the token, and reaches Redis as the ACL user over TLS."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    password_file = tmp_path / "redis-password"
    password_file.write_text(REDIS_PASSWORD)

    def spawn(*extra: str, tls: bool = True):
        tls_args = ["--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key)] if tls else []
        return node_factory(
            "--host",
            "localhost",
            "--token-file",
            str(token_file),
            "--redis-ca",
            str(pki.ca),
            "--redis-password-file",
            str(password_file),
            *tls_args,
            *extra,
            redis_url=f"rediss://{REDIS_USER}@127.0.0.1:{secure_redis.port}/0",
        )

    return spawn


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S * 2))


# -- TLS to nodes and Redis, ACL user ------------------------------------------------------
def test_tls_pool_round_trips_bytes_with_a_token_and_a_redis_acl_user(secure_node, secure_redis, pki, namespace):
    node = secure_node()
    with SyncPoolClient(PoolConfig.from_url(_secure_url(pki, secure_redis, namespace))) as client:
        [info] = client.nodes()
        assert info.tls is True and info.host == "localhost"
        client.put([Chunk("secret-key", b"kv bytes" * 1000), Chunk("big", bytes(range(256)) * 40_000)])
        fetched = client.get(["secret-key", "big"])
        assert [bytes(f.data) for f in fetched] == [b"kv bytes" * 1000, bytes(range(256)) * 40_000]
        assert client.node_stats(info)["counters"].get("tls_failures", 0) == 0
    assert node.alive()


def test_concurrent_puts_and_gets_share_one_tls_connection_without_mixing_bytes(
    secure_node, secure_redis, pki, namespace
):
    secure_node()
    url = _secure_url(pki, secure_redis, namespace, connections_per_node="1")
    payloads = {f"c{i}": bytes([i]) * (256 * 1024 + i) for i in range(32)}

    async def traffic() -> list[bytes | None]:
        client = PoolClient(PoolConfig.from_url(url))
        try:
            keys = sorted(payloads)
            # writes and reads in flight together on one TLS socket: the reader task and senders interleave
            await asyncio.gather(*(client.put([Chunk(k, payloads[k])]) for k in keys[:16]))
            puts = [client.put([Chunk(k, payloads[k])]) for k in keys[16:]]
            gets = [client.get([k]) for k in keys[:16]]
            results = await asyncio.gather(*puts, *gets)
            got = [r[0] for r in results[len(puts) :]] + [r[0] for r in [await client.get([k]) for k in keys[16:]]]
            return [None if f is None else bytes(f.data) for f in got]
        finally:
            await client.close()

    assert _run(traffic()) == [payloads[k] for k in sorted(payloads)]


def test_plaintext_client_to_a_tls_node_is_told_to_use_tls(secure_node, secure_redis, pki, namespace):
    node = secure_node()

    async def plaintext_hello() -> None:
        sock = await FrameSocket.connect("localhost", node.port, TIMEOUT_S)
        try:
            meta = encode_json({"client": "kvpool"})
            await sock.send([encode_header(Op.HELLO, 1, meta, 0), meta])
            header, reply = await sock.recv_frame_head()
            assert header.is_response and header.request_id == 1
            raise error_for_status(header.status, bytes(reply).decode())
        finally:
            sock.close()

    with pytest.raises(ProtocolError, match="serves TLS only: add tls=on"):
        _run(plaintext_hello())
    with SyncPoolClient(PoolConfig.from_url(_secure_url(pki, secure_redis, namespace))) as client:
        assert client.node_stats(client.nodes()[0])["counters"]["tls_failures"] == 1


def test_tls_client_to_a_plaintext_node_gets_a_clear_error_not_a_hang(secure_node, secure_redis, pki, namespace):
    node = secure_node(tls=False)
    with SyncPoolClient(PoolConfig.from_url(_secure_url(pki, secure_redis, namespace))) as client:
        [info] = client.nodes()
        assert info.tls is False
        with pytest.raises(NodeUnavailable, match="does not serve TLS but the pool URL says tls=on"):
            client.node_stats(info)
        assert client.get(["anything"]) == [None]
    # Without the registry's word (a client that dials the node directly) the handshake fails, bounded.
    with pytest.raises(NodeUnavailable, match=r"TLS handshake with localhost:\d+ failed"):
        _run(FrameSocket.connect("localhost", node.port, TIMEOUT_S, client_tls_context(str(pki.ca))))


def _seconds_until_closed(sock: socket.socket, opened_at: float, wait_s: float) -> float | None:
    """Seconds from ``opened_at`` until the node closed ``sock`` (FIN, reset, TLS EOF); None if open after ``wait_s``."""
    sock.settimeout(wait_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass  # a reset, or a TLS connection ended without close_notify
    return time.monotonic() - opened_at


def test_connections_that_stop_before_or_inside_tls_are_closed_at_the_handshake_deadline(
    secure_node, secure_redis, pki, namespace
):
    # 3 s, not 1: the real client's own TLS handshake and HELLO below must fit in it on a loaded machine
    node = secure_node("--handshake-timeout-s", "3")
    opened_at = time.monotonic()
    silent = socket.create_connection(("localhost", node.port))
    record_byte = socket.create_connection(("localhost", node.port))
    record_byte.sendall(b"\x16")  # the first byte of a ClientHello: the node starts its handshake and waits
    tls_only = client_tls_context(str(pki.ca)).wrap_socket(
        socket.create_connection(("localhost", node.port)), server_hostname="localhost"
    )  # TLS done, then no HELLO
    try:
        for name, sock in (("silent", silent), ("one TLS byte", record_byte), ("TLS, no frame", tls_only)):
            closed_s = _seconds_until_closed(sock, opened_at, 10.0)
            assert closed_s is not None and closed_s >= 2.8, f"{name}: closed after {closed_s} s, deadline 3 s"
    finally:
        for sock in (silent, record_byte, tls_only):
            sock.close()
    with SyncPoolClient(PoolConfig.from_url(_secure_url(pki, secure_redis, namespace))) as client:
        client.put([Chunk("after", b"still served")])
        assert bytes(client.get(["after"])[0].data) == b"still served"
        counters = client.node_stats(client.nodes()[0])["counters"]
        # Not the peers' TLS failing: they stopped, and the deadline closed them.
        assert counters["handshake_timeouts"] == 3 and counters.get("tls_failures", 0) == 0


def test_a_node_certificate_from_another_ca_or_for_another_name_is_refused(secure_node, pki):
    node = secure_node()
    with pytest.raises(NodeUnavailable, match=r"certificate verify failed"):
        _run(FrameSocket.connect("localhost", node.port, TIMEOUT_S, client_tls_context(str(pki.other_ca))))
    # The node's certificate names localhost, not 127.0.0.1: host name verification is on.
    with pytest.raises(NodeUnavailable, match="mismatch"):
        _run(FrameSocket.connect("127.0.0.1", node.port, TIMEOUT_S, client_tls_context(str(pki.ca))))
    conn = _run(_connect_and_close(node.port, client_tls_context(str(pki.ca))))
    assert conn.tls


async def _connect_and_close(port: int, context: ssl.SSLContext) -> FrameSocket:
    conn = await FrameSocket.connect("localhost", port, TIMEOUT_S, context)
    conn.close()
    return conn


def test_redis_over_tls_with_the_wrong_ca_is_refused(secure_redis, pki, namespace):
    config = PoolConfig.from_url(_secure_url(pki, secure_redis, namespace, tls_ca=str(pki.other_ca)))
    with pytest.raises(MetadataError, match="certificate verify failed"):
        with SyncPoolClient(config):  # refused as it opens
            pass


def test_a_wrong_or_missing_redis_password_names_redis_authentication(secure_redis, pki, namespace):
    wrong = PoolConfig.from_url(_secure_url(pki, secure_redis, namespace, redis_password="guess"))
    with pytest.raises(MetadataError, match="Redis authentication refused") as caught:
        with SyncPoolClient(wrong):  # refused as it opens, not at the first call
            pass
    assert isinstance(caught.value, AuthError) and "guess" not in str(caught.value)
    anonymous = PoolConfig.from_url(_secure_url(pki, secure_redis, namespace, redis_user="", redis_password=""))
    with pytest.raises(MetadataError, match="Redis authentication refused"):
        with SyncPoolClient(anonymous):
            pass


def test_a_node_with_the_wrong_redis_password_does_not_start(capsys, secure_redis, pki, tmp_path):
    password_file = tmp_path / "redis-password"
    password_file.write_text("guess")
    code = main(
        [
            "node",
            "--shm-dir",
            "off",
            "--redis",
            f"rediss://{REDIS_USER}@127.0.0.1:{secure_redis.port}/0",
            "--redis-ca",
            str(pki.ca),
            "--redis-password-file",
            str(password_file),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Redis refused the password (" in err and str(password_file) in err and "guess" not in err


# -- the pool token -------------------------------------------------------------------------
def test_wrong_and_missing_tokens_over_tls_get_auth_errors_and_are_counted(secure_node, secure_redis, pki, namespace):
    secure_node()
    with SyncPoolClient(PoolConfig.from_url(_secure_url(pki, secure_redis, namespace))) as good:
        good.put([Chunk("private", b"for token holders")])
        info = good.nodes()[0]
        before = good.node_stats(info)["counters"].get("auth_failures", 0)
    with SyncPoolClient(
        PoolConfig.from_url(_secure_url(pki, secure_redis, namespace, token="guess-0123456789abcdef0123456789a"))
    ) as bad:
        with pytest.raises(AuthError):
            bad.node_stats(bad.nodes()[0])
        assert bad.get(["private"]) == [None]
    with SyncPoolClient(PoolConfig.from_url(_secure_url(pki, secure_redis, namespace, token=""))) as none:
        with pytest.raises(AuthError, match="requires a token"):
            none.node_stats(none.nodes()[0])
        assert none.get(["private"]) == [None]

    async def skip_auth() -> None:
        # A client that never authenticates: its first real request is refused and the connection closed.
        sock = await FrameSocket.connect("localhost", info.port, TIMEOUT_S, client_tls_context(str(pki.ca)))
        try:
            await sock.send([encode_header(Op.PING, 1, b"", 0)])
            header, reply = await sock.recv_frame_head()
            with pytest.raises(AuthError):
                raise error_for_status(header.status, bytes(reply).decode())
            with pytest.raises(NodeUnavailable, match="closed"):
                await sock.recv_frame_head()
        finally:
            sock.close()

    _run(skip_auth())
    with SyncPoolClient(PoolConfig.from_url(_secure_url(pki, secure_redis, namespace))) as good:
        # two wrong MACs (node_stats, then get on a new connection) and the request before AUTH count;
        # a client without a token stops at HELLO, so nothing of it reaches the node to refuse
        assert good.node_stats(info)["counters"]["auth_failures"] == before + 3


def test_the_token_never_crosses_the_wire(node_factory, pool_url, monkeypatch):
    node_factory(env={"KVPOOL_TOKEN": TOKEN})
    sent = bytearray()
    real_send = FrameSocket.send

    async def recording_send(self: FrameSocket, buffers) -> None:
        for buf in buffers:
            sent.extend(memoryview(buf).cast("B"))
        await real_send(self, buffers)

    monkeypatch.setattr(FrameSocket, "send", recording_send)
    url = pool_url.replace("kvpool://", f"kvpool://:{TOKEN}@")
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put([Chunk("k", b"v")])
        assert bytes(client.get(["k"])[0].data) == b"v"
    assert len(sent) > 0 and TOKEN.encode() not in sent


# -- configuration ---------------------------------------------------------------------------
def test_secrets_are_masked_and_tls_turns_redis_into_rediss() -> None:
    config = PoolConfig.from_url(
        f"kvpool://:{TOKEN}@redis.example:6380/ns?tls=on&tls_ca=/etc/kvpool/ca.pem"
        f"&redis_user=app&redis_password={REDIS_PASSWORD}"
    )
    assert config.redis_url == "rediss://app@redis.example:6380/0"
    assert (config.tls, config.tls_ca, config.redis_password) == (True, "/etc/kvpool/ca.pem", REDIS_PASSWORD)
    for shown in (repr(config), config.to_url(with_token=False), config.redis_url):
        assert REDIS_PASSWORD not in shown and TOKEN not in shown
    assert PoolConfig.from_url(config.to_url()) == config
    env = PoolConfig.from_url("kvpool://h:1/ns?redis_user=app", {"KVPOOL_REDIS_PASSWORD": "from-env"})
    assert env.redis_password == "from-env"
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url(f"kvpool://h:port/ns?redis_password={REDIS_PASSWORD}&tls=on")
    assert REDIS_PASSWORD not in str(caught.value) and "redis_password=***" in str(caught.value)


def test_a_ca_without_tls_is_refused_by_name() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url("kvpool://h:6379/ns?tls_ca=/tmp/ca.pem")
    assert caught.value.key == "tls_ca"
    with pytest.raises(ConfigError, match=r"cannot load CA certificates from /nonexistent/ca\.pem"):
        client_tls_context("/nonexistent/ca.pem")


def test_node_tls_flags_are_checked_before_anything_starts(capsys, pki, secure_redis) -> None:
    rediss = f"rediss://127.0.0.1:{secure_redis.port}/0"
    cases = [
        (["--redis", rediss, "--tls-cert", str(pki.node_cert)], "TLS needs both --tls-cert and --tls-key"),
        (
            ["--redis", "redis://127.0.0.1:1/0", "--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key)],
            "a TLS node needs a TLS Redis (rediss://)",
        ),
        (["--redis", "redis://127.0.0.1:1/0", "--redis-ca", str(pki.ca)], "only matters for a rediss:// Redis"),
        (
            ["--redis", rediss, "--redis-ca", str(pki.ca), "--tls-cert", str(pki.ca), "--tls-key", str(pki.ca)],
            "--tls-cert: cannot load",
        ),
    ]
    for args, message in cases:
        assert main(["node", "--shm-dir", "off", *args]) == 2  # usage errors: nothing was started
        assert message in capsys.readouterr().err
