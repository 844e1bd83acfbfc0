"""One LMCache engine in its own process: stores or reads chunks through kvpool.

    python -m bench.engine put URL --chunks N   # engine A: store N chunks
    python -m bench.engine get URL --chunks N   # engine B: find them, read them, verify every byte
    python -m bench.engine get --lmcache-config lmcache.yaml   # LMCache configured by that file instead

``--form remote_url`` configures LMCache with ``remote_url`` instead of the plugin entry;
``--lmcache-config FILE`` takes the whole LMCache config from the file an engine would be
given (``LMCACHE_CONFIG_FILE``, what ``kvpool lmcache-config`` writes), so a machine can
check its engine's config before vLLM runs there; its memory settings are cut to what this
run's chunks need (``_held_memory``), so the check does not take an engine's CPU buffer.

LMCache's side is built by LMCache's own code (``backend.lmcache.stack``). Prints one
JSON line with what it saw; exits 1 if any byte read back differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml

from backend.lmcache.config import FORMS, PLUGIN_FORM
from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config

FIRST_HASH = 0x5EED
GIB = 1024**3
MIN_LOCAL_CPU_BYTES = 64 * 1024 * 1024  # LMCache's CPU buffer is never made smaller than this


def _held_memory(config: dict, chunks: int, layers: int, heads: int, head_size: int) -> dict[str, object]:
    """LMCache's memory settings for this run, whatever an engine's config file asks for (``kvpool
    lmcache-config`` writes an engine's 5 GiB): a CPU buffer of twice the chunks it moves, no reserve, no
    huge pages, so checking a config costs what the check needs and not what serving would."""
    chunk_bytes = 2 * 2 * layers * int(config.get("chunk_size", 256)) * heads * head_size  # K and V, bfloat16
    cpu_bytes = max(MIN_LOCAL_CPU_BYTES, 2 * chunks * chunk_bytes)
    return {
        "max_local_cpu_size": min(float(config.get("max_local_cpu_size", 5.0)), cpu_bytes / GIB),
        "reserve_local_cpu_size": 0.0,
        "local_cpu_use_hugepages": False,
        "enable_lazy_memory_allocator": False,
    }


def run(
    role: str,
    url: str,
    chunks: int,
    layers: int,
    heads: int,
    head_size: int,
    local_cpu_gib: float,
    form: str = PLUGIN_FORM,
    lmcache_config: str | None = None,
) -> dict:
    if lmcache_config is not None:
        config = yaml.safe_load(Path(lmcache_config).read_text())
        config.update(_held_memory(config, chunks, layers, heads, head_size))
    else:
        config = kvpool_lmcache_config(url, form=form, local_cpu_gib=local_cpu_gib)
    stack = LMCacheStack(config, num_layers=layers, hidden=(heads, head_size))
    keys = [stack.key(FIRST_HASH + i) for i in range(chunks)]
    total_bytes = stack.chunk_bytes * chunks
    report: dict[str, object] = {
        "role": role,
        "chunks": chunks,
        "chunk_bytes": stack.chunk_bytes,
        "remote_backend": type(stack.remote).__name__,
        "backends": list(stack.backends),
    }
    if role == "put":
        objs = [stack.make_object(i) for i in range(chunks)]
        start = time.perf_counter()
        stack.put(keys, objs)
        report["seconds"] = time.perf_counter() - start
        stack.release(objs)
        report["hit_prefix"] = stack.contains_prefix(keys)
    else:
        start = time.perf_counter()
        report["hit_prefix"] = stack.contains_prefix(keys)
        report["lookup_ms"] = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        got = stack.get(keys)
        report["seconds"] = time.perf_counter() - start
        report["hits"] = sum(1 for g in got if g is not None)
        report["identical"] = sum(
            1
            for i, g in enumerate(got)
            if g is not None and torch.equal(g.tensor.view(torch.uint8), stack.expected_tensor(i).view(torch.uint8))
        )
        first = next((g for g in got if g is not None), None)
        if first is not None:
            report["shape"] = list(first.get_shape())
            report["dtype"] = str(first.get_dtype())
            report["fmt"] = first.get_memory_format().name
        stack.release(got)
        report["shm_get_bytes"] = stack.connector().client.counters["shm_get_bytes"]
    report["gb_per_s"] = total_bytes / float(report["seconds"]) / 1e9  # type: ignore[arg-type]
    start = time.monotonic()
    stack.close()
    report["close_s"] = round(time.monotonic() - start, 3)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("put", "get"))
    parser.add_argument("url", nargs="?", help="the pool URL (or give --lmcache-config)")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--local-cpu-gib", type=float, default=1.0)
    parser.add_argument("--form", choices=FORMS, default=PLUGIN_FORM, help="how LMCache is told about kvpool")
    parser.add_argument(
        "--lmcache-config", metavar="FILE", help="LMCache's config file (as LMCACHE_CONFIG_FILE), instead of a URL"
    )
    args = parser.parse_args(argv)
    if (args.url is None) == (args.lmcache_config is None):
        parser.error("give one of the pool URL and --lmcache-config FILE")
    report = run(
        args.role,
        args.url or "",
        args.chunks,
        args.layers,
        args.heads,
        args.head_size,
        args.local_cpu_gib,
        args.form,
        args.lmcache_config,
    )
    print(json.dumps(report), flush=True)
    if args.role == "get" and report["identical"] != report["hits"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
