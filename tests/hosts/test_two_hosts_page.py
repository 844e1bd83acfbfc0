"""docs/two-hosts.md as written: its commands, taken from the page, run on three hosts of the bed.

The page marks the blocks a host runs (```` ```bash host-a ````, ``host-b``, ``host-c``);
this test runs them in the page's order, each host's in one shell of its own (exports and
``umask`` carry from block to block, as in a terminal; ``set -e``: a failing command ends
the shell and the test), with the page's ``HOST_A``/``HOST_B``/``HOST_C`` set to the hosts'
addresses and ``HOME`` a directory of the host's own. What the page does not run on a
host, the test does in its place: the block that copies the two secret files from A to B
and C over SSH (there is no SSH here: the files are copied), the installs (the checkout's
``.venv`` is on ``PATH``) and vLLM (no GPU).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

PAGE = REPO / "docs" / "two-hosts.md"
HOSTS = {"a": "hosta", "b": "hostb", "c": "hostc"}
BLOCK_TIMEOUT_S = 240.0  # a block that starts a node waits up to 60 s for it in the page itself
DONE = "__two_hosts_block_done__"
SECRETS = ("token", "redis-password")


def page_blocks() -> Iterator[tuple[str, str]]:
    """(marker, text) of every fenced block of the page whose info string names a host, or ``copy``, in order."""
    for match in re.finditer(r"^```bash(?: ([a-z-]+))?\n(.*?)^```$", PAGE.read_text(), re.MULTILINE | re.DOTALL):
        marker, text = match.group(1), match.group(2)
        if marker:
            yield marker, text
        elif "scp " in text:
            yield "copy", text


class Shell:
    """One ``bash`` on a host of the bed, fed blocks of the page; its output read line by line."""

    def __init__(self, bed, host: str, env: dict[str, str]) -> None:
        self.process = bed.popen(host, ["bash", "--noprofile", "--norc"], env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.send("set -e -o pipefail")

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def run(self, block: str) -> list[str]:
        """Run ``block``; its output lines. Fails the test, with the shell's output, if a command failed."""
        self.send(block.rstrip("\n") + f"\necho {DONE}")
        out: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=BLOCK_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(
                    f"no end of block within {BLOCK_TIMEOUT_S} s:\n{block}\n" + "\n".join(out)
                ) from None
            if line is None:
                raise AssertionError(f"a command failed (the shell ended):\n{block}\n--- output ---\n" + "\n".join(out))
            if line == DONE:
                self.output += out
                return out
            out.append(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # type: ignore[union-attr]
            self.process.wait(10)


def _copy_secrets(homes: dict[str, Path]) -> None:
    """What the page's ``scp`` block does: A's two secret files into B's and C's ``~/.kvpool``, mode 0600."""
    for host in ("b", "c"):
        target = homes[host] / ".kvpool"
        target.mkdir(mode=0o700, exist_ok=True)
        for name in SECRETS:
            shutil.copy2(homes["a"] / ".kvpool" / name, target / name)
            (target / name).chmod(0o600)


def test_the_page_marks_blocks_for_every_host_and_the_copy_between_them():
    markers = [marker for marker, _ in page_blocks()]
    assert markers[:5] == ["host-a", "copy", "host-a", "host-b", "host-c"], markers
    assert set(markers) == {"host-a", "host-b", "host-c", "copy"}, markers
    text = PAGE.read_text()
    assert "--redis-password-file" in text and "--token-file" in text and "--advertise" in text


def test_the_two_hosts_page_run_as_written_gives_the_engine_on_host_c_hits_from_the_nodes_on_a_and_b(
    bed_factory, tmp_path
):
    bed = bed_factory(list(HOSTS.values()))
    addresses = {key: bed.hosts[name].address for key, name in HOSTS.items()}
    homes = {key: tmp_path / name for key, name in HOSTS.items()}
    venv_bin = str(Path(sys.executable).parent)
    shells: dict[str, Shell] = {}
    for key, name in HOSTS.items():
        homes[key].mkdir()
        env = {
            "HOME": str(homes[key]),
            "PATH": f"{venv_bin}:{os.environ['PATH']}",
            "PYTHONPATH": str(REPO),  # `kvpool` runs this checkout's code, whatever the venv's editable install names
            "HOST_A": addresses["a"],
            "HOST_B": addresses["b"],
            "HOST_C": addresses["c"],
            "LMCACHE_TRACK_USAGE": "false",
        }
        shells[key] = Shell(bed, name, env)
    outputs: dict[str, list[str]] = {key: [] for key in HOSTS}
    try:
        for marker, block in page_blocks():
            if marker == "copy":
                _copy_secrets(homes)
                continue
            key = marker.removeprefix("host-")
            outputs[key] += shells[key].run(block)
    finally:
        for shell in shells.values():
            shell.close()

    assert any(line.strip() == "PONG" for line in outputs["a"]), outputs["a"]
    ready = [line for line in outputs["a"] + outputs["b"] if " ready at " in line]
    assert [line.split(" ready at ")[1].split(" ")[0] for line in ready] == [
        f"{addresses['a']}:7400",
        f"{addresses['b']}:7400",
    ], ready
    c_output = outputs["c"]
    listed = "\n".join(c_output)
    assert f"{addresses['a']}:7400" in listed and f"{addresses['b']}:7400" in listed, listed
    reports = [json.loads(line) for line in c_output if line.startswith('{"role"')]
    put, get = (next(r for r in reports if r["role"] == role) for role in ("put", "get"))
    assert put["hit_prefix"] == 8 and "RemoteBackend-kvpool" in put["backends"], put
    assert get["hits"] == 8 and get["identical"] == 8, get  # read from A and B over the bridge: C has no node
    assert get["shm_get_bytes"] == 0
    # Stopped as the page says: each node left nothing in its host's /dev/shm, and Redis is down.
    for key in ("a", "b"):
        left = bed.run(HOSTS[key], ["sh", "-c", "ls -A /dev/shm"], timeout_s=30).stdout.split()
        assert not [f for f in left if f.startswith("kvpool-")], (key, left)
    assert not bed.wait_port(HOSTS["a"], 6379, timeout_s=1.0)
