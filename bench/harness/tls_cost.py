"""What TLS costs on the node protocol: put and get GB/s over loopback, plaintext vs TLS.

    python -m bench.harness.tls_cost                     # 64 chunks of 4 MiB, 5 rounds
    python -m bench.harness.tls_cost --chunks 16 --chunk-mib 1 --rounds 3

Each side gets its own redis-server and node process (``kvpool node --shm-dir off``,
so every byte crosses TCP); the TLS side has ``--tls-cert`` and a ``rediss://`` Redis,
with a self-signed certificate for localhost made by the ``openssl`` CLI. The client
is a ``PoolClient`` in this process. Every chunk read back is compared with what was
written; the median of the rounds is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from backend.embedded import EmbeddedRedis
from backend.launch.nodes import NodeProcess
from kvpool import Chunk, PoolClient, PoolConfig


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "localhost.crt", directory / "localhost.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def start_node(redis_url: str, extra: list[str]) -> NodeProcess:
    args = ["--redis", redis_url, "--host", "localhost", "--dram", "2GiB", "--shm-dir", "off", *extra]
    return NodeProcess(args).start()


async def measure(url: str, chunks: int, chunk_bytes: int, rounds: int) -> tuple[float, float]:
    """Median put and get GB/s over ``rounds`` rounds of ``chunks`` chunks in one batch."""
    client = PoolClient(PoolConfig.from_url(url))
    puts, gets = [], []
    try:
        for r in range(rounds):
            batch = [Chunk(f"r{r}-{i}", os.urandom(chunk_bytes)) for i in range(chunks)]
            started = time.perf_counter()
            await client.put(batch)
            puts.append(chunks * chunk_bytes / (time.perf_counter() - started) / 1e9)
            started = time.perf_counter()
            got = await client.get([c.key for c in batch])
            gets.append(chunks * chunk_bytes / (time.perf_counter() - started) / 1e9)
            if [None if f is None else bytes(f.data) for f in got] != [bytes(c.data) for c in batch]:
                raise SystemExit("a chunk read back differs from what was written")
            await client.delete([c.key for c in batch])
    finally:
        await client.close()
    return statistics.median(puts), statistics.median(gets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    chunk_bytes = int(args.chunk_mib * 1024 * 1024)
    with tempfile.TemporaryDirectory(prefix="kvpool-tls-") as tmp:
        cert, key = self_signed(Path(tmp))
        plain_redis = EmbeddedRedis().start()
        tls_redis = EmbeddedRedis(tls=(cert, key, cert)).start()
        nodes = []
        try:
            nodes.append(start_node(plain_redis.url, []))
            nodes.append(
                start_node(tls_redis.url, ["--redis-ca", str(cert), "--tls-cert", str(cert), "--tls-key", str(key)])
            )
            sides = {
                "plaintext": f"kvpool://127.0.0.1:{plain_redis.port}/default",
                "tls": f"kvpool://127.0.0.1:{tls_redis.port}/default?tls=on&tls_ca={cert}",
            }
            print(f"{args.chunks} chunks x {args.chunk_mib} MiB per batch, median of {args.rounds} rounds")
            for name, url in sides.items():
                put, get = asyncio.run(measure(url, args.chunks, chunk_bytes, args.rounds))
                print(f"{name:10s} put {put:6.2f} GB/s   get {get:6.2f} GB/s")
        finally:
            for node in nodes:
                node.stop()
            plain_redis.cleanup()
            tls_redis.cleanup()


if __name__ == "__main__":
    main()
