"""Which kvpool builds talk to each other: a node of one commit and clients of others, on one Redis.

    python -m bench.compat NODE_REF CLIENT_REF [CLIENT_REF ...]

Each ref is a git commit (or ``.`` for the working tree); its tree is taken with ``git
archive`` into a temporary directory and run from there with this Python (so the
commits must be importable with this environment's packages). The node runs with
``--shm-dir off`` (every client reads over TCP); each client puts four chunks of its own
and gets them back, then each client reads the others' chunks. One JSON line per
client and pair: what the put said, and how many of the four the reader found.
docs/upgrade.md's table was measured with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backend.embedded import EmbeddedRedis, free_port
from backend.launch.processes import REPO

NODE_START_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 120.0
CHUNKS = 4
NODE_ARGS = ("--namespace", "compat", "--dram", "64MiB", "--shm-dir", "off")

CLIENT = """
import json, sys
from backend.client.chunks import Chunk
from backend.client.sync import SyncPoolClient
from backend.config import PoolConfig
out = {}
with SyncPoolClient(PoolConfig.from_url(sys.argv[1])) as client:
    keys = json.loads(sys.argv[3])
    if sys.argv[2] == "put":
        try:
            client.put([Chunk(k, (k * 100).encode()) for k in keys])
            out["put"] = "ok"
        except Exception as exc:
            out["put"] = f"{type(exc).__name__}: {exc}"[:400]
    try:
        out["found"] = sum(g is not None for g in client.get(keys))
    except Exception as exc:
        out["get"] = f"{type(exc).__name__}: {exc}"[:400]
print(json.dumps(out))
"""


def tree(ref: str, into: Path) -> Path:
    """The source tree of ``ref`` (``.``: this checkout as it is)."""
    if ref == ".":
        return REPO
    target = into / ref.replace("/", "_")
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def _env(source: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(source), "KVPOOL_PREFAULT": "off", "LMCACHE_TRACK_USAGE": "false"}


def client(source: Path, url: str, action: str, keys: list[str]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, url, action, json.dumps(keys)],
        capture_output=True,
        text=True,
        cwd=source,
        env=_env(source),
        timeout=CLIENT_TIMEOUT_S,
    )
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {"error": proc.stderr.strip().splitlines()[-1:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("node", help="the node's commit (. for the working tree)")
    parser.add_argument("clients", nargs="+", help="the clients' commits")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvpool-compat-") as tmp, EmbeddedRedis() as redis:
        node_tree = tree(args.node, Path(tmp))
        port = free_port()
        log = Path(tmp) / "node.log"
        with log.open("w") as out:
            node = subprocess.Popen(
                [sys.executable, "-m", "backend.cli", "node", "--redis", redis.url, *NODE_ARGS, "--port", str(port)],
                cwd=node_tree,
                env=_env(node_tree),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + NODE_START_TIMEOUT_S
            while " ready at " not in log.read_text():
                if node.poll() is not None or time.monotonic() > deadline:
                    print(log.read_text()[-2000:], file=sys.stderr)
                    return 1
                time.sleep(0.2)
            url = f"kvpool://127.0.0.1:{redis.port}/compat"
            sources = [(ref, tree(ref, Path(tmp)) if ref != args.node else node_tree) for ref in args.clients]
            keys = {i: [f"compat-{i}-{n}" for n in range(CHUNKS)] for i in range(len(sources))}
            for i, (ref, source) in enumerate(sources):
                print(json.dumps({"node": args.node, "client": ref, **client(source, url, "put", keys[i])}), flush=True)
            for i, (ref, source) in enumerate(sources):
                for j, (writer, _) in enumerate(sources):
                    if i != j:
                        seen = client(source, url, "get", keys[j])
                        print(json.dumps({"node": args.node, "client": ref, "reads_from": writer, **seen}), flush=True)
        finally:
            node.terminate()
            node.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
