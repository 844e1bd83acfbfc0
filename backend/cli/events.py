"""The ``events`` verb: run the pool's KV events endpoint for routers (docs/fleet-events.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable

from backend.cli.exits import EXIT_OK
from backend.cli.options import add_url_option, pool_config
from backend.config.values import check_token, read_secret_file
from backend.errors import ConfigError

logger = logging.getLogger(__name__)


def add_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    events = verbs.add_parser(
        "events", help="publish what the pool holds as vLLM KV events (ZMQ PUB, CURVE with the pool token)"
    )
    add_url_option(events)
    events.add_argument("--model", required=True, help="the model whose blocks are published (LMCache's model name)")
    events.add_argument(
        "--publish", default="tcp://*:5557", metavar="ADDR", help="ZMQ PUB address (default %(default)s)"
    )
    events.add_argument("--replay", metavar="ADDR", help="ZMQ ROUTER address for replays and snapshots (default: none)")
    events.add_argument(
        "--identity", default="", help="the pod name in the topic kv@IDENTITY@MODEL (default kvpool-NAMESPACE)"
    )
    events.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="N",
        help="LMCache's chunk_size: tokens per chunk (default: the block size, else 256)",
    )
    events.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="N",
        help="tokens per block each event announces (default: the chunk size, one block a chunk); one that divides "
        "the chunk size announces each chunk that came with its token ids as chunk_size/N blocks",
    )
    events.add_argument("--medium", default="CPU", help="the medium every event names (default %(default)s)")
    events.add_argument(
        "--form",
        default="vllm-0.33",
        metavar="FORM",
        help="the wire of the routers' vLLM release: vllm-0.33 (vLLM 0.26.0 to 0.34.0; the default), vllm-0.25 "
        "(0.24.0 to 0.25.1), vllm-0.23 (0.22.0 to 0.23.0, arrays all the way down)",
    )
    events.add_argument(
        "--replay-batches", type=int, default=10_000, metavar="N", help="batches kept for replay (default %(default)s)"
    )
    events.add_argument(
        "--poll-interval-s",
        type=float,
        default=0.2,
        metavar="S",
        help="how often the nodes' rings are read (default %(default)s)",
    )
    events.add_argument(
        "--tenant",
        default="",
        metavar="NAME",
        help="publish only this tenant's blocks, to subscribers holding its token (needs --tenant-token-file)",
    )
    events.add_argument(
        "--tenant-token-file",
        default="",
        metavar="PATH",
        help="the file holding --tenant's token: its subscribers' CURVE keys derive from it (the URL keeps the "
        "pool token, which reads the nodes)",
    )
    events.add_argument(
        "--token-file-next",
        default="",
        metavar="PATH",
        help="during a rotation of the pool token: the next token, whose holders subscribe on --publish-next (and "
        "--replay-next); a tenant's endpoint takes --tenant-token-file-next instead",
    )
    events.add_argument(
        "--tenant-token-file-next",
        default="",
        metavar="PATH",
        help="during a rotation of --tenant's token: its next token (DIR/NAME.next on the nodes), whose holders "
        "subscribe on --publish-next (and --replay-next)",
    )
    events.add_argument("--publish-next", metavar="ADDR", help="ZMQ PUB address for the next token's subscribers")
    events.add_argument("--replay-next", metavar="ADDR", help="ZMQ ROUTER address for the next token's replays")
    events.add_argument(
        "--plain",
        action="store_true",
        help="no CURVE, so stock vLLM subscribers can connect: anyone who reaches the sockets reads what the pool "
        "holds; loopback addresses only, unless --plain-on-network",
    )
    events.add_argument(
        "--plain-on-network",
        action="store_true",
        help="let --plain bind addresses other machines reach (a network only the routers reach)",
    )
    events.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        metavar="N",
        help="the batches' data_parallel_rank (default %(default)s)",
    )


def _next_token_file(args: argparse.Namespace) -> tuple[str, str]:
    """The flag and file of the subscribers' next token during a rotation ("" for none): the pool's for an endpoint
    of no tenant, the tenant's for one of ``--tenant`` (its subscribers hold the tenant's token)."""
    if args.tenant:
        if args.token_file_next:
            raise ConfigError(
                "--token-file-next",
                f"the subscribers of tenant {args.tenant}'s endpoint hold its token, not the pool's: give its next "
                "token as --tenant-token-file-next",
            )
        return "--tenant-token-file-next", args.tenant_token_file_next
    if args.tenant_token_file_next:
        raise ConfigError("--tenant-token-file-next", "a tenant's next token needs that tenant's endpoint (--tenant)")
    return "--token-file-next", args.token_file_next


def _token(path: str, flag: str) -> str:
    """The token in ``flag``'s file, checked as a token ("" when the flag is not given)."""
    if not path:
        return ""
    token = read_secret_file(path, flag)
    check_token(token, flag, path)
    return token


def cmd_events(args: argparse.Namespace) -> int:
    from backend.events import DEFAULT_CHUNK_TOKENS, EndpointConfig, EventsEndpoint  # the events extra

    config = EndpointConfig(
        model=args.model,
        publish=args.publish,
        replay=args.replay,
        identity=args.identity,
        block_size=args.block_size or args.chunk_size or DEFAULT_CHUNK_TOKENS,
        chunk_size=args.chunk_size or 0,
        medium=args.medium,
        form=args.form,
        replay_batches=args.replay_batches,
        poll_interval_s=args.poll_interval_s,
        data_parallel_rank=args.data_parallel_rank,
        tenant=args.tenant,
        publish_next=args.publish_next,
        replay_next=args.replay_next,
        plain=args.plain,
        plain_on_network=args.plain_on_network,
    )
    tenant_token = _token(args.tenant_token_file, "--tenant-token-file")
    next_flag, next_file = _next_token_file(args)
    next_token = _token(next_file, next_flag)
    endpoint = EventsEndpoint(pool_config(args), config, tenant_token, next_token)

    async def serve() -> None:
        endpoint.bind()
        print(f"events: publishing {endpoint.topic.decode()} on {endpoint.publish_address}", flush=True)
        if endpoint.replay_address:
            print(f"events: replay on {endpoint.replay_address}", flush=True)
        if endpoint.next_publish_address:
            print(f"events: publishing to the next token's holders on {endpoint.next_publish_address}", flush=True)
        if endpoint.next_replay_address:
            print(f"events: the next token's replay on {endpoint.next_replay_address}", flush=True)
        task = asyncio.create_task(endpoint.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(serve())
    finally:
        endpoint.close()
    print("events: stopped", file=sys.stderr)
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"events": cmd_events}
