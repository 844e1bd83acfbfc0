"""``kvpool doctor --node``: what a node started with these options would meet on this host.

Its secrets, its Redis (reach, password, version, clock, memory, the namespace), the room
for its DRAM arena in the shared-memory directory, its NVMe directory, and the address it
would advertise: each checked without starting a node, allocating the arena or writing
more than a probe file. A node host has only the core install: nothing here imports
LMCache or torch (``tests/test_troubleshooting.py`` checks it).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from backend.client import PoolClient
from backend.config import format_size, pool_config_of_redis
from backend.config.values import read_secret_file
from backend.doctor.findings import (
    NOT_ADVERTISED,
    NVME_NOT_WRITABLE,
    SECRET_FILE,
    SHM_TOO_SMALL,
    WRONG_NAMESPACE,
    Finding,
)
from backend.doctor.pool import check_redis
from backend.errors import ConfigError, MetadataError
from backend.metadata import LiveNamespaces
from backend.node.store.tiers import ARENA_MIN_SLACK_BYTES, ARENA_SLACK

__all__ = ["arena_bytes", "check_node_host"]

PROBE_BYTES = 4096  # what the NVMe probe writes (and fsyncs, and removes)
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def arena_bytes(dram_bytes: int) -> int:
    """The size of the DRAM arena a node of ``dram_bytes`` maps (as ``backend.node.store.tiers`` sizes it)."""
    return dram_bytes + max(int(dram_bytes * ARENA_SLACK), ARENA_MIN_SLACK_BYTES)


async def check_node_host(values: Mapping[str, Any]) -> list[Finding]:
    """Every check of a node started with ``values`` (``backend.config.node_options``) on this host."""
    found, secrets = _secrets(values)
    found += await _redis(values, secrets)
    found.append(_shm(values))
    found.append(_nvme(values))
    found += _advertise(values)
    return found


def _secrets(values: Mapping[str, Any]) -> tuple[list[Finding], dict[str, str]]:
    """The token and Redis password files: each readable and not empty; the secrets read."""
    found = []
    secrets = {"token": values["token"], "redis_password": values["redis_password"]}
    for name, flag in (("token", "--token-file"), ("redis_password", "--redis-password-file")):
        path = values[f"{name}_file"]
        if path is None:
            continue
        try:
            secrets[name] = read_secret_file(path, flag)
        except ConfigError as exc:
            found.append(
                Finding.failed(
                    flag,
                    str(exc),
                    f"make {path} a file holding the secret, readable by the user the node runs as (uid {os.getuid()} "
                    "here); mode 0600, or 0440 with that user's group",
                    SECRET_FILE,
                )
            )
            continue
        found.append(Finding.passed(flag, f"{path} is readable"))
    return found, secrets


async def _redis(values: Mapping[str, Any], secrets: Mapping[str, str]) -> list[Finding]:
    """The node's Redis with its credentials, and who else is in its namespace."""
    if not values["redis"]:
        return [
            Finding.failed("Redis", "no --redis URL (nor KVPOOL_REDIS, nor redis: in --config)", "give --redis URL")
        ]
    try:
        config = pool_config_of_redis(
            values["redis"],
            values["namespace"],
            redis_password=secrets["redis_password"],
            tls_ca=str(values["redis_ca"] or ""),
        )
    except ConfigError as exc:
        return [Finding.failed("Redis", str(exc), "fix the --redis URL")]
    client = PoolClient(config)
    try:
        found, _, answered = await check_redis(client)
        if answered:
            found.append(await _namespace(client))
        return found
    finally:
        await client.close()


async def _namespace(client: PoolClient) -> Finding:
    """Who is in the node's namespace: an empty one while other namespaces have nodes is worth a word."""
    namespace = client.config.namespace
    try:
        alive = [n for n in await client.index.nodes() if n.alive]
        if alive:
            count = f"{len(alive)} live node{'s' if len(alive) > 1 else ''}"
            return Finding.passed("namespace", f"{namespace!r} has {count}; this one would join them")
        spaces = await client.index.live_namespaces()
    except MetadataError as exc:
        return Finding.failed("namespace", str(exc))
    if spaces.live:
        return Finding.warned(
            "namespace",
            f"{namespace!r} has no live node; namespaces with live nodes: {LiveNamespaces(spaces.live).describe()}",
            "engines must name this node's namespace in their pool URL; if it should join those nodes, give "
            "--namespace with their namespace",
            WRONG_NAMESPACE,
        )
    return Finding.passed("namespace", f"{namespace!r}: this would be its first live node")


def _shm(values: Mapping[str, Any]) -> Finding:
    """Room for the DRAM arena in the shared-memory directory (a container's /dev/shm is 64 MiB by default)."""
    directory: Path | None = values["shm_dir"]
    if directory is None:
        return Finding.passed("shared memory", "off (--shm-dir off): the DRAM tier is private memory")
    needed = arena_bytes(values["dram"])
    try:
        info = os.statvfs(directory)
    except OSError as exc:
        return Finding.failed("shared memory", f"cannot read {directory}: {exc.strerror}", cause=SHM_TOO_SMALL)
    free = info.f_bavail * info.f_frsize
    if free < needed:
        return Finding.failed(
            "shared memory",
            f"{directory} has {format_size(free)} free of {format_size(info.f_blocks * info.f_frsize)}; the DRAM "
            f"arena of --dram {format_size(values['dram'])} needs {format_size(needed)}: the node would fill it "
            "(other programs needing it there then fail) and keep the rest in private memory, read over TCP",
            f"make {directory} larger (docker run --shm-size, or a Kubernetes emptyDir of medium Memory there), "
            "lower --dram, or --shm-dir off (same-host engines then read over TCP)",
            SHM_TOO_SMALL,
        )
    return Finding.passed(
        "shared memory", f"{directory} has {format_size(free)} free; the arena needs {format_size(needed)}"
    )


def _nvme(values: Mapping[str, Any]) -> Finding:
    """The NVMe directory: there (or creatable), and writable by this user: a probe file written, synced, removed."""
    directory: Path | None = values["nvme_dir"]
    if directory is None or not values["nvme"]:
        return Finding.passed("NVMe directory", "no NVMe tier")
    fix = (
        f"give the directory to the user the node runs as (uid {os.getuid()} here; the image's is 10001: "
        f"chown -R 10001:10001 {directory}), and mount it read-write"
    )
    target = directory if directory.exists() else next((p for p in directory.parents if p.exists()), Path("/"))
    probe = target / f".kvpool-doctor-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        where = str(directory) if target == directory else f"{target} (where {directory} would be made)"
        reason = "a read-only file system" if exc.errno == errno.EROFS else exc.strerror
        return Finding.failed(
            "NVMe directory",
            f"uid {os.getuid()} cannot write in {where}: {reason}",
            fix,
            NVME_NOT_WRITABLE,
        )
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    info = os.statvfs(target)
    room = info.f_bavail * info.f_frsize
    wanted = f"{format_size(room)} free for --nvme {format_size(values['nvme'])}"
    if room < values["nvme"]:
        return Finding.warned(
            "NVMe directory",
            f"{directory} is writable, but {wanted}: the disk fills before the tier does, and writes to it fail",
            "lower --nvme to what the disk holds (less what else writes there)",
        )
    return Finding.passed("NVMe directory", f"{directory} is writable; {wanted}")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _advertise(values: Mapping[str, Any]) -> list[Finding]:
    """The address the node would publish: one clients elsewhere can reach, and one it listens on."""
    host: str = values["host"]
    advertise_host, advertise_port = values["advertise"]
    shown = advertise_host or (socket.gethostname() if host in WILDCARD_HOSTS else host)
    check = "advertised address"
    fix = "give --advertise ADDRESS (one engines on other hosts reach) and --host 0.0.0.0 (or that address)"
    if _is_loopback(host) and not _is_loopback(shown) and not advertise_port:
        return [
            Finding.failed(
                check,
                f"the node would listen on {host} only, but advertise {shown}: clients dialling {shown} are refused",
                fix,
                NOT_ADVERTISED,
            )
        ]
    if _is_loopback(shown):
        return [
            Finding.warned(
                check,
                f"{shown}: only clients on this host can reach it",
                fix + " when engines run on other hosts",
                NOT_ADVERTISED,
            )
        ]
    try:
        resolved = {str(info[4][0]) for info in socket.getaddrinfo(shown, None, type=socket.SOCK_STREAM)}
    except OSError as exc:
        return [Finding.failed(check, f"{shown} does not resolve on this host: {exc}", fix, NOT_ADVERTISED)]
    if all(_is_loopback(address) for address in resolved):
        return [
            Finding.warned(
                check,
                f"{shown} resolves to {', '.join(sorted(resolved))} here, a loopback address (/etc/hosts): other "
                "hosts may resolve it to another address, or not at all",
                fix,
                NOT_ADVERTISED,
            )
        ]
    if not advertise_port and not any(_is_local(address) for address in resolved):
        return [
            Finding.warned(
                check,
                f"{shown} ({', '.join(sorted(resolved))}) is not an address of this host: clients reach the node "
                "there only through a forwarder (NAT, a container's published port)",
                "give --advertise HOST:PORT of the forwarder, or an address of this host",
                NOT_ADVERTISED,
            )
        ]
    return [Finding.passed(check, f"{shown} ({', '.join(sorted(resolved))})")]


def _is_local(address: str) -> bool:
    """Whether ``address`` is one of this host's (a socket can bind it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True
