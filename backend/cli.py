"""The ``kvpool`` admin CLI: parses, calls the library, prints. Nothing imports it."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from backend import __version__
from backend.client import PoolClient
from backend.config import DEFAULT_NAMESPACE, PoolConfig, format_size, parse_size
from backend.embedded import EmbeddedRedis
from backend.errors import ConfigError, KVPoolError
from backend.lmcache_config import lmcache_config, render_env, render_yaml
from backend.metadata import MetadataStore, NodeInfo
from backend.node.server import NodeConfig, PoolNode

__all__ = ["main", "build_parser"]

logger = logging.getLogger("kvpool")

DEFAULT_UP_NVME_DIR = Path(".kvpool") / "nvme"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="Run and manage a kvpool KV-cache pool.")
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    up = verbs.add_parser("up", help="run a pool in the foreground: a private redis-server plus one node")
    up.add_argument("--redis", metavar="URL", help="use this Redis instead of starting a private one")
    _node_options(up, dram_default="1GiB", nvme_dir_default=DEFAULT_UP_NVME_DIR, nvme_default="8GiB")

    node = verbs.add_parser("node", help="run a node that joins an existing pool")
    node.add_argument("--redis", metavar="URL", required=True, help="the pool's metadata Redis, redis://HOST:PORT")
    _node_options(node, dram_default="4GiB", nvme_dir_default=None, nvme_default="100GiB")

    status = verbs.add_parser("status", help="is the pool healthy: Redis, nodes, capacity, objects")
    _url_option(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    cfg = verbs.add_parser("lmcache-config", help="print the LMCache config that enables kvpool")
    _url_option(cfg)
    cfg.add_argument("--format", choices=("yaml", "env"), default="yaml", help="YAML file or LMCACHE_* variables")
    cfg.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size in tokens (default 256)")
    cfg.add_argument("--local-cpu-gib", type=float, default=5.0, help="LMCache local CPU buffer (default 5.0)")
    return parser


def _url_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=os.environ.get("KVPOOL_URL"), metavar="kvpool://...",
        help="pool URL (default: $KVPOOL_URL)",
    )  # fmt: skip


def _node_options(
    parser: argparse.ArgumentParser, dram_default: str, nvme_dir_default: Path | None, nvme_default: str
) -> None:
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE, help=f"pool namespace (default {DEFAULT_NAMESPACE})")
    parser.add_argument("--dram", default=dram_default, help=f"DRAM tier size (default {dram_default})")
    where = f"default {nvme_dir_default}" if nvme_dir_default else "default: no NVMe tier"
    parser.add_argument("--nvme-dir", type=Path, default=nvme_dir_default, help=f"NVMe tier directory ({where})")
    parser.add_argument("--nvme", default=nvme_default, help=f"NVMe tier size; 0 turns it off (default {nvme_default})")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    parser.add_argument(
        "--advertise", default="", help="address clients should use (default: --host, or the hostname for 0.0.0.0)"
    )
    parser.add_argument(
        "--node-id", default="", help="stable node id (default: kept in the NVMe dir, else HOSTNAME-PORT)"
    )
    parser.add_argument("--cluster", default="", help="cluster label for same-cluster reads")
    parser.add_argument("--token-file", type=Path, help="file holding the pool token (or set KVPOOL_TOKEN)")


def _node_config(args: argparse.Namespace, redis_url: str) -> NodeConfig:
    token = os.environ.get("KVPOOL_TOKEN", "")
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError("--token-file", f"cannot read {args.token_file}: {exc.strerror}") from None
        if not token:
            raise ConfigError("--token-file", f"{args.token_file} is empty; a node without a token accepts anyone")
    PoolConfig(namespace=args.namespace, cluster=args.cluster)  # validates both
    dram_bytes = parse_size(args.dram, name="--dram")
    if dram_bytes <= 0:
        raise ConfigError("--dram", f"{args.dram!r} is not a positive size")
    nvme_bytes = parse_size(args.nvme, name="--nvme") if args.nvme_dir is not None else 0
    return NodeConfig(
        redis_url=redis_url, namespace=args.namespace, dram_bytes=dram_bytes,
        nvme_dir=args.nvme_dir if nvme_bytes else None, nvme_bytes=nvme_bytes,
        host=args.host, port=args.port, advertise_host=args.advertise, node_id=args.node_id,
        token=token, cluster=args.cluster,
    )  # fmt: skip


def _pool_url(node: PoolNode, redis_url: str, namespace: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(redis_url)
    auth = ":TOKEN@" if node.config.token else ""
    return f"kvpool://{auth}{parts.hostname}:{parts.port or 6379}/{namespace}"


async def _serve(node: PoolNode) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.request_stop)
    try:
        await node.wait_stopped()
    finally:
        await node.stop()


def cmd_node(args: argparse.Namespace) -> int:
    config = _node_config(args, args.redis)

    async def run() -> None:
        node = PoolNode(config)
        await node.start()
        print(f"kvpool node {node.node_id} ready at {node.advertise_host}:{node.port} (epoch {node.epoch})", flush=True)
        await _serve(node)

    asyncio.run(run())
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    redis = None if args.redis else EmbeddedRedis().start()
    redis_url = args.redis or (redis.url if redis else "")
    try:
        config = _node_config(args, redis_url)

        async def run() -> None:
            node = PoolNode(config)
            await node.start()
            url = _pool_url(node, redis_url, config.namespace)
            nvme = f"NVMe {format_size(config.nvme_bytes)} at {config.nvme_dir}" if config.nvme_dir else "no NVMe"
            print(f"kvpool pool is up: redis {redis_url}, node {node.node_id} at {node.advertise_host}:{node.port}, "
                  f"DRAM {format_size(config.dram_bytes)}, {nvme}")  # fmt: skip
            print(f"\nPool URL:\n  {url}\n\nLMCache config (LMCACHE_CONFIG_FILE):\n")
            print(render_yaml(lmcache_config(url)))
            print("Ctrl-C stops the pool.", flush=True)
            await _serve(node)

        asyncio.run(run())
    finally:
        if redis is not None:
            redis.cleanup()
    print("kvpool pool stopped.")
    return 0


def _config(args: argparse.Namespace) -> PoolConfig:
    if not args.url:
        raise ConfigError("--url", "no pool URL: pass --url kvpool://HOST:PORT/NS or set KVPOOL_URL")
    return PoolConfig.from_url(args.url, os.environ)


async def pool_status(config: PoolConfig) -> dict[str, Any]:
    """Everything ``kvpool status`` shows, as data."""
    meta = MetadataStore(config.redis_url, config.namespace, config.timeout_s)
    client = PoolClient(config)
    try:
        rtt_ms = await meta.ping()
        nodes: list[NodeInfo] = await meta.nodes()
        alive = [n for n in nodes if n.alive]
        hits = gets = 0
        for node in alive:
            try:
                stats = await client.node_stats(node)
            except KVPoolError:
                continue  # the registry's figures (up to a heartbeat old) stand
            counters = stats.get("counters", {})
            hits += int(counters.get("hits", 0))
            gets += int(counters.get("gets", 0))
            node.used_bytes = sum(int(t["used_bytes"]) for t in stats["tiers"].values())
            node.object_count = int(stats["objects"])
        return {
            "redis": {"url": config.redis_url, "reachable": True, "rtt_ms": round(rtt_ms, 3)},
            "namespace": config.namespace,
            "nodes": {"alive": len(alive), "dead": len(nodes) - len(alive)},
            "capacity_bytes": sum(n.capacity_bytes for n in alive),
            "used_bytes": sum(n.used_bytes for n in alive),
            "free_bytes": sum(n.free_bytes for n in alive),
            "objects": sum(n.object_count for n in alive),
            "gets": gets,
            "hits": hits,
            "hit_rate": round(hits / gets, 4) if gets else None,
            "node_list": [
                {
                    "node_id": n.node_id,
                    "address": n.address,
                    "alive": n.alive,
                    "epoch": n.epoch,
                    "capacity_bytes": n.capacity_bytes,
                    "used_bytes": n.used_bytes,
                    "objects": n.object_count,
                }
                for n in nodes
            ],
        }
    finally:
        await client.close()
        await meta.close()


def cmd_status(args: argparse.Namespace) -> int:
    status = asyncio.run(pool_status(_config(args)))
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    hit_rate = "n/a" if status["hit_rate"] is None else f"{status['hit_rate'] * 100:.1f}%"
    print(f"Redis       {status['redis']['url']} reachable ({status['redis']['rtt_ms']:.2f} ms)")
    print(f"Namespace   {status['namespace']}")
    print(f"Nodes       {status['nodes']['alive']} alive, {status['nodes']['dead']} dead")
    print(f"Capacity    {format_size(status['used_bytes'])} used of {format_size(status['capacity_bytes'])} "
          f"({format_size(status['free_bytes'])} free)")  # fmt: skip
    print(f"Objects     {status['objects']}")
    print(f"Hit rate    {hit_rate} ({status['hits']} of {status['gets']} node gets since start)")
    for n in status["node_list"]:
        state = "alive" if n["alive"] else "DEAD"
        print(f"  {n['node_id']:<24} {n['address']:<22} {state:<5} epoch {n['epoch']:<4} "
              f"{format_size(n['used_bytes'])} / {format_size(n['capacity_bytes'])}, {n['objects']} objects")  # fmt: skip
    return 0


def cmd_lmcache_config(args: argparse.Namespace) -> int:
    config = _config(args)  # validates the URL before printing it
    data = lmcache_config(args.url, chunk_size=args.chunk_size, local_cpu_gib=args.local_cpu_gib)
    del config
    print(render_env(data) if args.format == "env" else render_yaml(data), end="")
    return 0


COMMANDS = {"up": cmd_up, "node": cmd_node, "status": cmd_status, "lmcache-config": cmd_lmcache_config}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("KVPOOL_DEBUG", "").lower() in {"1", "true", "on", "yes"}
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return COMMANDS[args.verb](args)
    except KVPoolError as exc:
        if debug:
            raise
        print(f"kvpool: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
