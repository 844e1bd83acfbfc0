"""``make demo``: a pool on the embedded default and an LMCache round trip through it.

1. ``kvpool up``: a private redis-server plus one pool node (DRAM tier).
2. Engine A (its own process, LMCache built from the printed config) stores chunks.
3. Engine B (a fresh process) looks them up, reads them, verifies every byte.
4. The pool is stopped with Ctrl-C (SIGINT), as a user would.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from bench.paths import REPO

URL_RE = re.compile(r"^\s*(kvpool://\S+)\s*$")
START_TIMEOUT_S = 60.0


def _engine(role: str, url: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.engine",
        role,
        url,
        "--chunks",
        str(args.chunks),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--head-size",
        str(args.head_size),
        "--local-cpu-gib",
        str(args.local_cpu_gib),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    if proc.returncode != 0 or not proc.stdout.strip():
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"engine {role} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=16, help="chunks engine A stores (default 16)")
    parser.add_argument("--layers", type=int, default=32, help="model layers (default 32: an 8B model)")
    parser.add_argument("--heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-size", type=int, default=128, help="head size (default 128)")
    parser.add_argument("--dram", default="2GiB", help="pool node DRAM tier (default 2GiB)")
    parser.add_argument("--local-cpu-gib", type=float, default=1.0, help="LMCache local buffer per engine")
    args = parser.parse_args()

    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    print(f"[demo] starting the pool: kvpool up --dram {args.dram}", flush=True)
    pool = subprocess.Popen(
        [sys.executable, "-m", "backend.cli", "up", "--dram", args.dram],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=env,
    )
    url = ""
    lines: list[str] = []
    found = threading.Event()

    def pump() -> None:
        nonlocal url
        assert pool.stdout is not None
        for line in pool.stdout:
            lines.append(line)
            match = URL_RE.match(line)
            if match and not url:
                url = match.group(1)
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not found.wait(START_TIMEOUT_S):
            raise SystemExit("kvpool up did not print a pool URL:\n" + "".join(lines[-20:]))
        print(f"[demo] pool is up at {url}", flush=True)

        a = _engine("put", url, args)
        size_mib = a["chunk_bytes"] / 2**20
        print(
            f"[demo] engine A stored {a['chunks']} chunks of {size_mib:.0f} MiB "
            f"(shape {[2, args.layers, 256, args.heads * args.head_size]}, bf16) "
            f"in {a['seconds']:.3f} s: {a['gb_per_s']:.2f} GB/s",
            flush=True,
        )

        b = _engine("get", url, args)
        print(
            f"[demo] engine B (fresh process) found a hit prefix of {b['hit_prefix']}/{b['chunks']} chunks "
            f"in {b['lookup_ms']:.1f} ms",
            flush=True,
        )
        print(
            f"[demo] engine B read {b['hits']}/{b['chunks']} chunks in {b['seconds']:.3f} s: "
            f"{b['gb_per_s']:.2f} GB/s; byte-identical: {b['identical']}/{b['hits']}; "
            f"shape {b.get('shape')}, {b.get('dtype')}, {b.get('fmt')}",
            flush=True,
        )
        mapped = b.get("shm_get_bytes", 0)
        if mapped:
            print(
                f"[demo] engine B runs on the node's host, so it copied {mapped / 2**20:.0f} MiB out of the "
                "node's shared-memory arena (no socket)",
                flush=True,
            )
        else:
            print("[demo] engine B read over TCP (no shared-memory arena reachable)", flush=True)
        ok = b["hits"] == b["chunks"] == b["identical"]
    finally:
        pool.send_signal(signal.SIGINT)
        try:
            pool.wait(30)
        except subprocess.TimeoutExpired:
            pool.kill()
            pool.wait()
    time.sleep(0.1)
    print(f"[demo] pool stopped (exit {pool.returncode})", flush=True)
    print(f"[demo] {'OK: engine B hit every chunk engine A stored' if ok else 'FAILED: see above'}")
    return 0 if ok and pool.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
