"""A fleet on one machine: hosts as network namespaces on a bridge, with real links between them.

    with HostBed(["redis", "node1", "engine"]) as bed:
        redis = bed.start_redis("redis")
        node = bed.start_node("node1", redis.url, dram="256MiB")
        bed.partition("engine", "node1")        # a blackhole: packets vanish, no RST, no FIN
        bed.heal("engine", "node1")
        out = bed.run_python("engine", "print(1)")

Each host is a network namespace ``kvp-<owner pid>-<name>`` with one ``eth0`` on the
bridge ``br0`` of a switch namespace ``kvp-<owner pid>-sw`` (nothing in the machine's
own network changes), an address in 198.18.0.0/15 (the benchmarking range, RFC 2544:
never a range that exists outside), its own hostname (a UTS namespace) and its own
``/dev/shm`` (a mount namespace with a private tmpfs), so a client on another host
cannot map a node's arena and reads over TCP, as on real hosts. A holder process per
host (``sleep infinity`` inside those namespaces) keeps them; every process of the
host is started with ``nsenter -t HOLDER -n -u -m``.

The links, all shaped in the switch, so no host's own sockets see an error:

* ``set_rate(host, gbit)``: a ``tbf`` on both ends of the host's link;
* ``partition(a, b)`` / ``heal(a, b)``: ``nft`` drop rules on the bridge between the
  two hosts (both ways), removed by ``heal``: a silent link, only timeouts tell;
* ``set_loss(host, one_in)``: drop one packet in ``one_in`` each way on the host's
  link (``numgen random mod N 0``);
* delay: this kernel has no ``netem``, so a service is exposed through
  :class:`DelayProxy` on its host (``expose``): every byte is held ``delay_ms`` in
  each direction and then sent, without waiting for the previous one (pipelined: a
  delay, not a throughput cap).

Teardown kills every process inside the bed's namespaces (they were all started by the
bed) and deletes the namespaces, which takes their veths, bridge, qdiscs and nft rules
with them; it runs on ``close``, at exit, and, for a run that was killed, at the start
of the next bed (namespaces whose owner pid is gone). Root and the ``ip``, ``nft``,
``tc``, ``unshare`` and ``nsenter`` tools are required: :func:`missing` says what
is not there, and :class:`HostBed` raises :class:`BedUnavailable` with it.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import ipaddress
import json
import os
import queue
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.launch.nodes import NodeProcess
from backend.launch.processes import REPO, ServerProcess

__all__ = [
    "HostBed",
    "Host",
    "BedUnavailable",
    "DelayProxy",
    "RedisHost",
    "missing",
    "remove_leftovers",
    "PREFIX",
    "SUBNET",
]

PREFIX = "kvp-"  # every namespace of a bed: kvp-<owner pid>-<name>
SUBNET = ipaddress.ip_network("198.18.0.0/24")  # inside 198.18.0.0/15, the benchmarking range
FIRST_HOST = 10  # host addresses from 198.18.0.10
TOOLS = ("ip", "nft", "tc", "unshare", "nsenter")
SHM_SIZE = "4g"  # each host's private /dev/shm (tmpfs: pages are taken only when written)
HOLDER_START_TIMEOUT_S = 10.0
REDIS_START_TIMEOUT_S = 10.0
TBF_BURST_BYTES = 4 << 20  # a burst this size keeps one large write at the rate, not below it
TBF_LATENCY_MS = 50
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")  # fits interface names: v-<name> <= 15 characters
_CLEANUP_LOCK = threading.Lock()


class BedUnavailable(RuntimeError):
    """The machine cannot host a bed (not root, a tool missing, namespaces refused): the reason is the message."""


def missing() -> str | None:
    """Why no bed can be built here, or None when it can."""
    if os.geteuid() != 0:
        return "the host bed needs root (network, mount and UTS namespaces, nft, tc): run as root"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"the host bed needs {', '.join(absent)}: apt-get install -y iproute2 nftables util-linux"
    return None


def _run(*argv: str, input_text: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(argv, input=input_text, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise BedUnavailable(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}")
    return proc.stdout


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list", check=False).splitlines() if line.strip()]


def _destroy_namespace(netns: str) -> None:
    """Kill what runs in ``netns`` (the bed started all of it) and delete it with its links."""
    for _ in range(3):
        pids = [int(p) for p in _run("ip", "netns", "pids", netns, check=False).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
    _run("ip", "netns", "del", netns, check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of beds whose owner process is gone (a killed run); returns their names."""
    removed = []
    for netns in _namespaces():
        match = re.match(rf"^{PREFIX}(\d+)-", netns)
        if match and not _alive(int(match.group(1))):
            _destroy_namespace(netns)
            removed.append(netns)
    return removed


@dataclass
class Host:
    """One host of the bed: its namespace, address, hostname and the holder that keeps its namespaces."""

    name: str
    netns: str
    address: str
    holder: subprocess.Popen[bytes] | None = None
    proxies: list[DelayProxy] = field(default_factory=list)

    @property
    def prefix(self) -> list[str]:
        """Run a command on this host: prepend this."""
        assert self.holder is not None, f"host {self.name} is not up"
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-u", "-m", f"--wd={REPO}"]


class RedisHost(ServerProcess):
    """A redis-server on a host, listening on its address (and the host's loopback); no persistence."""

    def __init__(self, host: Host, port: int) -> None:
        argv = [
            *host.prefix,
            "redis-server",
            "--port",
            str(port),
            "--bind",
            f"{host.address} 127.0.0.1",
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--loglevel",
            "warning",
        ]
        super().__init__(f"redis on {host.name}", argv)
        self.host = host
        self.port = port
        self.address = host.address  # what clients dial: the host, or a delay proxy in front of it

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.port}/0"


class HostBed:
    """N hosts on one bridge; a context manager whose exit (or the process's) removes everything it made."""

    def __init__(self, names: Sequence[str], *, shm_size: str = SHM_SIZE) -> None:
        reason = missing()
        if reason:
            raise BedUnavailable(reason)
        for name in names:
            if not NAME_RE.match(name) or name == "sw":
                raise ValueError(f"host name {name!r}: 1-10 of a-z 0-9, starting with a letter, not 'sw'")
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {list(names)}")
        self.owner = f"{PREFIX}{os.getpid()}-"
        self.switch = self.owner + "sw"
        self.shm_size = shm_size
        base = int(SUBNET.network_address) + FIRST_HOST
        self.hosts = {
            name: Host(name, self.owner + name, str(ipaddress.ip_address(base + i))) for i, name in enumerate(names)
        }
        self.blocked: set[frozenset[str]] = set()
        self.loss: dict[str, int] = {}
        self.processes: list[ServerProcess] = []
        self._closed = False
        remove_leftovers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- building -------------------------------------------------------------------------------
    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            _run("ip", "netns", "add", host.netns)
            veth = f"v-{host.name}"
            _run(
                "ip",
                "-n",
                self.switch,
                "link",
                "add",
                veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host.netns,
            )
            _run("ip", "-n", self.switch, "link", "set", veth, "master", "br0", "up")
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/{SUBNET.prefixlen}", "dev", "eth0")
            _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            host.holder = self._holder(host)
        self._render_rules()

    def _holder(self, host: Host) -> subprocess.Popen[bytes]:
        """``sleep infinity`` in the host's network namespace and new UTS and mount namespaces (hostname, /dev/shm)."""
        script = (
            f"hostname {host.name} && mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm "
            "&& echo up && exec sleep infinity"
        )
        holder = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                host.netns,
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert holder.stdout is not None
        line = holder.stdout.readline()  # "up" once the namespaces are ready, EOF when a step failed
        if line.strip() != b"up":
            err = holder.stderr.read().decode() if holder.stderr else ""
            holder.kill()
            raise BedUnavailable(f"host {host.name}: cannot make its UTS and mount namespaces: {err.strip()}")
        return holder

    # -- links ----------------------------------------------------------------------------------
    def _render_rules(self) -> None:
        """The switch's nft table as the partitions and losses now say (replaced whole, so a heal leaves nothing)."""
        rules = []
        for pair in sorted(sorted(p) for p in self.blocked):
            a, b = (self.hosts[n].address for n in pair)
            rules += [f"ip saddr {a} ip daddr {b} drop", f"ip saddr {b} ip daddr {a} drop"]
        for name, one_in in sorted(self.loss.items()):
            veth = f"v-{name}"
            rules += [
                f'iifname "{veth}" numgen random mod {one_in} 0 drop',
                f'oifname "{veth}" numgen random mod {one_in} 0 drop',
            ]
        body = "\n".join(f"    {rule}" for rule in rules)
        table = (
            f"table bridge kvpbed {{\n  chain forward {{\n    type filter hook forward priority 0;\n{body}\n  }}\n}}\n"
        )
        _run("ip", "netns", "exec", self.switch, "nft", "delete", "table", "bridge", "kvpbed", check=False)
        _run("ip", "netns", "exec", self.switch, "nft", "-f", "-", input_text=table)

    def rules(self) -> str:
        """The switch's nft ruleset (for reports and for tests of the bed)."""
        return _run("ip", "netns", "exec", self.switch, "nft", "list", "ruleset")

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b``, both ways, silently (no RST, no FIN, no ICMP)."""
        self.blocked.add(frozenset((self.hosts[a].name, self.hosts[b].name)))
        self._render_rules()

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        """Remove the partition between ``a`` and ``b``; with no hosts, every partition."""
        if a is None or b is None:
            self.blocked.clear()
        else:
            self.blocked.discard(frozenset((a, b)))
        self._render_rules()

    @contextlib.contextmanager
    def blackhole(self, a: str, b: str) -> Iterator[None]:
        """A partition between ``a`` and ``b`` for the ``with`` block, healed when it ends (also on an error)."""
        self.partition(a, b)
        try:
            yield
        finally:
            self.heal(a, b)

    def set_loss(self, host: str, one_in: int | None) -> None:
        """Drop one packet in ``one_in`` at random, each way, on ``host``'s link; None: no loss."""
        if one_in is None:
            self.loss.pop(host, None)
        else:
            if one_in < 2:
                raise ValueError(f"one_in={one_in}: must be at least 2")
            self.loss[self.hosts[host].name] = one_in
        self._render_rules()

    def set_rate(self, host: str, gbit: float | None) -> None:
        """A ``tbf`` of ``gbit`` Gb/s on both ends of ``host``'s link (its sending and its receiving); None: none."""
        ends = [(self.hosts[host].netns, "eth0"), (self.switch, f"v-{host}")]
        for netns, dev in ends:
            _run("tc", "-n", netns, "qdisc", "del", "dev", dev, "root", check=False)
            if gbit is not None:
                rate = f"{int(gbit * 1000)}mbit"
                _run(
                    "tc",
                    "-n",
                    netns,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    str(TBF_BURST_BYTES),
                    "latency",
                    f"{TBF_LATENCY_MS}ms",
                )

    def qdiscs(self, host: str) -> str:
        return _run("tc", "-n", self.hosts[host].netns, "qdisc", "show", "dev", "eth0")

    # -- processes ------------------------------------------------------------------------------
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``."""
        return [*self.hosts[host].prefix, *argv]

    def run(
        self,
        host: str,
        argv: Sequence[str],
        *,
        timeout_s: float = 120,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to its end (its output captured)."""
        return subprocess.run(
            self.command(host, argv),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )

    def run_python(
        self, host: str, code: str, *args: str, timeout_s: float = 120, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Python ``code`` on ``host`` (this repository importable)."""
        return self.run(host, [sys.executable, "-c", code, *args], timeout_s=timeout_s, env=env)

    def popen(self, host: str, argv: Sequence[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` with pipes for stdin and stdout (stderr too, merged): a driven process."""
        return subprocess.Popen(
            self.command(host, argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )

    def start_redis(self, host: str, port: int = 6379, *, delay_ms: float | None = None) -> RedisHost:
        """A redis-server on ``host``; with ``delay_ms``, clients reach it through a delay proxy on that host."""
        server = RedisHost(self.hosts[host], port)
        server.start()
        self.processes.append(server)
        if not _wait_port_on(self, host, port, REDIS_START_TIMEOUT_S):
            raise RuntimeError(f"redis on {host} did not answer:\n{server.tail(20)}")
        if delay_ms is not None:
            server.port = self.expose(host, port, delay_ms)
        return server

    def start_node(
        self,
        host: str,
        redis_url: str,
        *extra: str,
        namespace: str = "kvpool",
        dram: str = "256MiB",
        port: int = 7000,
        delay_ms: float | None = None,
        shm: bool = True,
        env: dict[str, str] | None = None,
    ) -> NodeProcess:
        """A ``kvpool node`` on ``host``, reached at the host's address (through a delay proxy with ``delay_ms``).

        ``shm=True`` keeps its DRAM in an arena in the host's own /dev/shm, as deployed:
        a client on another host cannot map it.
        """
        from backend.config.node import ENV_PREFAULT

        address = self.hosts[host].address
        args = ["--redis", redis_url, "--namespace", namespace, "--dram", dram]
        if delay_ms is None:
            args += ["--host", address, "--port", str(port)]
        else:  # listen on the host's loopback; the proxy on the host's address adds the delay
            public = port + 1
            args += ["--host", "127.0.0.1", "--port", str(port), "--advertise", f"{address}:{public}"]
        if not shm:
            args += ["--shm-dir", "off"]
        full_env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", ENV_PREFAULT: "off", **(env or {})}
        node = NodeProcess([*args, *extra], full_env, command=self.command(host, [sys.executable, "-m", "backend.cli"]))
        self.processes.append(node)
        if delay_ms is not None:
            self.expose(host, port, delay_ms, public_port=port + 1)
        return node.start()

    def wait_port(self, host: str, port: int, timeout_s: float = REDIS_START_TIMEOUT_S) -> bool:
        """Whether ``port`` on ``host``'s loopback accepts a connection within ``timeout_s``."""
        return _wait_port_on(self, host, port, timeout_s)

    def expose(self, host: str, port: int, delay_ms: float, *, public_port: int | None = None) -> int:
        """Serve ``host``'s loopback ``port`` on its address through a :class:`DelayProxy`; the public port."""
        public = public_port or port + 1
        proxy = DelayProxy(self, host, public, port, delay_ms)
        self.hosts[host].proxies.append(proxy)
        return public

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process and delete every namespace of the bed (idempotent)."""
        with _CLEANUP_LOCK:
            if self._closed:
                return
            self._closed = True
        for process in self.processes:
            with contextlib.suppress(Exception):
                process.kill()
        for netns in [host.netns for host in self.hosts.values()] + [self.switch]:
            if netns in _namespaces():
                _destroy_namespace(netns)
        for host in self.hosts.values():
            if host.holder is not None:
                with contextlib.suppress(Exception):
                    host.holder.wait(5)
        atexit.unregister(self.close)

    def __enter__(self) -> HostBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def leftovers(self) -> list[str]:
        """This bed's namespaces that still exist (empty after close)."""
        return [n for n in _namespaces() if n.startswith(self.owner)]


class JsonLines:
    """A process on a host of the bed that answers one JSON line per JSON line it is sent (the
    tests' driver, the harness's worker). Lines not starting with ``{`` are its log."""

    def __init__(self, process: subprocess.Popen[str], *, echo: bool = False, close_wait_s: float = 10.0) -> None:
        self.process = process
        self.echo = echo  # print the log lines as they come
        self.close_wait_s = close_wait_s
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.lines.put(line)
                continue
            self.log.append(line)
            if self.echo:
                print(line, end="", flush=True)

    def tail(self, lines: int = 30) -> str:
        return "".join(self.log[-lines:])

    def send(self, op: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def receive(self, timeout_s: float) -> dict[str, Any]:
        """The next answer (of a command sent with ``send``)."""
        try:
            return dict(json.loads(self.lines.get(timeout=timeout_s)))
        except queue.Empty:
            raise RuntimeError(f"{self.process.args!r} gave no answer within {timeout_s} s:\n{self.tail()}") from None

    def call(self, op: str, timeout_s: float, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.receive(timeout_s)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(self.close_wait_s)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _wait_port_on(bed: HostBed, host: str, port: int, timeout_s: float) -> bool:
    code = (
        "import socket,sys,time\n"
        "end=time.monotonic()+float(sys.argv[2])\n"
        "while time.monotonic()<end:\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1',int(sys.argv[1])),0.5).close(); sys.exit(0)\n"
        "    except OSError: time.sleep(0.05)\n"
        "sys.exit(1)\n"
    )
    return bed.run_python(host, code, str(port), str(timeout_s), timeout_s=timeout_s + 10).returncode == 0


class DelayProxy:
    """``python -m bench.hosts.bed delay`` on a host: its address:``public_port`` to its loopback:``port``, each way delayed."""

    def __init__(self, bed: HostBed, host: str, public_port: int, port: int, delay_ms: float) -> None:
        address = bed.hosts[host].address
        argv = [sys.executable, "-m", "bench.hosts.bed", "delay", f"{address}:{public_port}", f"127.0.0.1:{port}"]
        self.server = ServerProcess(
            f"delay proxy on {host}", bed.command(host, [*argv, "--delay-ms", str(delay_ms)]), re.compile(r"^listening")
        )
        self.server.start()
        self.server.wait_ready(10)
        bed.processes.append(self.server)
        self.delay_ms = delay_ms


# -- the delay proxy itself (runs on a host: python -m bench.hosts.bed delay LISTEN UPSTREAM --delay-ms D) --------
# Bytes move with splice(2): socket -> pipe -> socket, in the kernel, never copied into Python. A direction's
# pipes are its in-flight store: a delayed piece waits in one until it is due, so their room bounds what is in
# flight (backpressure: the reader waits for room) and the rate (PIPES x PIPE_BYTES per delay, above any link here).
PIPE_BYTES = 1 << 20  # /proc/sys/fs/pipe-max-size's default; a pipe that cannot grow keeps its 64 KiB
PIPES = 8  # pieces go to the pipes in turn, so the writer finds them in order
SPLICE_BYTES = 4 << 20  # the most one splice moves in: fewer calls, fewer wake-ups
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named here for Pythons whose fcntl lacks it
WAKE_S = 0.1
PR_SET_TIMERSLACK = 29  # prctl(2)


def _pipe() -> tuple[int, int]:
    import fcntl

    read_fd, write_fd = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_fd, F_SETPIPE_SZ, PIPE_BYTES)
    return read_fd, write_fd


def _splice_all(src: int, dst: int, count: int) -> None:
    """Move exactly ``count`` bytes from the pipe ``src`` to the socket ``dst``."""
    while count:
        moved = os.splice(src, dst, count)
        if moved == 0:
            raise ConnectionError("splice moved nothing")
        count -= moved


class _Direction:
    """Bytes from ``src`` to ``dst``, each piece sent ``delay_s`` after it arrived.

    Without a delay, one thread splices each piece through at once. With one, a reader
    splices pieces into the pipe and notes when each is due; a writer sends each on
    time, without waiting for the previous one to be acknowledged (a delay, not a cap).
    """

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, done: threading.Event) -> None:
        self.src, self.dst, self.delay_s, self.done = src, dst, delay_s, done  # done: the link broke
        self.finished = threading.Event()  # the FIN went through
        self.pipes = [_pipe() for _ in range(PIPES if delay_s > 0 else 1)]  # (read end, write end)
        self.queue: collections.deque[tuple[float, int, int]] = collections.deque()  # (due, pipe, bytes; 0: FIN)
        self.cond = threading.Condition()
        targets = [self._forward] if delay_s <= 0 else [self._read, self._write]
        self.threads = [threading.Thread(target=t, daemon=True) for t in targets]
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        """Close the pipe once both threads are gone (a thread still in a splice keeps it: a rare leak, no reuse)."""
        for thread in self.threads:
            thread.join(10 * WAKE_S)
        if any(thread.is_alive() for thread in self.threads):
            return
        for fd in (fd for pipe in self.pipes for fd in pipe):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _broken(self) -> None:
        self.done.set()
        with self.cond:
            self.cond.notify_all()

    def _forward(self) -> None:
        src, dst = self.src.fileno(), self.dst.fileno()
        read_fd, write_fd = self.pipes[0]
        try:
            while not self.done.is_set():
                moved = os.splice(src, write_fd, SPLICE_BYTES)
                if moved == 0:  # the sender closed its side: pass the FIN on
                    self.dst.shutdown(socket.SHUT_WR)
                    self.finished.set()
                    return
                _splice_all(read_fd, dst, moved)
        except (OSError, ConnectionError):
            self._broken()

    def _read(self) -> None:
        # A splice from a socket holds the pipe's lock while it waits for data, which would stall the writer's
        # splice out of the same pipe (a request that waits for its answer would never be sent): wait with
        # poll, outside the lock, and splice only what is there (SPLICE_F_NONBLOCK).
        src = self.src.fileno()
        readable = select.poll()
        readable.register(src, select.POLLIN)
        writable = []
        for _, write_fd in self.pipes:
            writable.append(select.poll())
            writable[-1].register(write_fd, select.POLLOUT)
        turn = 0
        try:
            while not self.done.is_set():
                if not writable[turn].poll(WAKE_S * 1000) or not readable.poll(WAKE_S * 1000):
                    continue
                try:
                    moved = os.splice(src, self.pipes[turn][1], SPLICE_BYTES, flags=os.SPLICE_F_NONBLOCK)
                except BlockingIOError:
                    continue
                with self.cond:
                    self.queue.append((time.monotonic() + self.delay_s, turn, moved))
                    self.cond.notify()
                if moved == 0:
                    return
                turn = (turn + 1) % len(self.pipes)
        except OSError:
            self._broken()

    def _write(self) -> None:
        dst = self.dst.fileno()
        try:
            while not self.done.is_set():
                with self.cond:
                    while not self.queue and not self.done.is_set():
                        self.cond.wait(WAKE_S)
                    if not self.queue:
                        return
                    due, pipe, count = self.queue.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if count == 0:  # the sender closed its side: pass the FIN on
                    self.dst.shutdown(socket.SHUT_WR)
                    self.finished.set()
                    return
                _splice_all(self.pipes[pipe][0], dst, count)
        except (OSError, ConnectionError):
            self._broken()


def _link(client: socket.socket, upstream_addr: tuple[str, int], delay_s: float) -> None:
    try:
        upstream = socket.create_connection(upstream_addr, timeout=5)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for sock in (client, upstream):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    done = threading.Event()
    ways = [_Direction(client, upstream, delay_s, done), _Direction(upstream, client, delay_s, done)]
    while not done.wait(0.5) and not all(way.finished.is_set() for way in ways):
        pass
    for sock in (client, upstream):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    for way in ways:
        way.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _fine_timers() -> None:
    """Sleeps that end on time: the default 50 us timer slack would add itself to every delayed piece."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)


def serve_delay(listen: str, upstream: str, delay_ms: float) -> None:
    """Accept on ``listen`` and forward each connection to ``upstream``, ``delay_ms`` each way."""
    _fine_timers()
    listener = socket.create_server(_address(listen), backlog=512)
    print(f"listening on {listen} -> {upstream} (+{delay_ms} ms each way)", flush=True)
    target = _address(upstream)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_link, args=(client, target, delay_ms / 1000), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hosts.bed", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    delay = sub.add_parser("delay", help="a delay proxy: LISTEN to UPSTREAM, every byte held DELAY_MS each way")
    delay.add_argument("listen", metavar="HOST:PORT")
    delay.add_argument("upstream", metavar="HOST:PORT")
    delay.add_argument("--delay-ms", type=float, default=0.0)
    sub.add_parser("cleanup", help="remove the namespaces of beds whose owner is gone (a killed run)")
    sub.add_parser("check", help="say whether a bed can be built here")
    args = parser.parse_args(argv)
    if args.verb == "delay":
        serve_delay(args.listen, args.upstream, args.delay_ms)
    elif args.verb == "cleanup":
        for netns in remove_leftovers():
            print(f"removed {netns}")
    else:
        reason = missing()
        print(reason or "a host bed can be built here")
        return 1 if reason else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
