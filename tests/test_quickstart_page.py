"""docs/quickstart.md and README.md's LMCache quick start, run as written: an engine gets a hit.

The commands come from the pages themselves, not from copies here:

- docs/quickstart.md section 1, its three ```` ```bash ```` blocks in order: ``kvpool up`` in a
  terminal of its own (foreground), ``export KVPOOL_URL=...`` and ``kvpool status`` in
  another terminal, and the second ``kvpool node`` in a third (foreground);
- section 2a's in-process command (``kvpool lmcache-config --url '...'``, which the page
  says "prints exactly this"), run in the second terminal: its output must be the page's
  YAML;
- README.md's "Using it with LMCache" block, run in the second terminal as well: its
  ``export`` and its ``kvpool lmcache-config > lmcache.yaml`` (its ``kvpool up`` is the
  quickstart's, already running: a second one would be a second pool);
- then the engine of README's last line: an LMCache engine given the ``lmcache.yaml``
  those commands wrote (``LMCACHE_CONFIG_FILE``, read by LMCache's own loader through
  ``bench.engine --lmcache-config``) stores eight chunks, and a fresh engine in another
  process finds them and reads them back byte for byte;
- then Ctrl-C (SIGINT to the foreground process group, as a terminal sends it) to the
  second node and to ``kvpool up``, and nothing may be left: no process, no file of
  theirs in /dev/shm, not the private Redis's directory.

What the test does in place of the reader: the ``pip install`` lines are skipped (this
checkout's ``.venv`` is installed already; its ``bin`` is on ``PATH`` and ``PYTHONPATH``
names this checkout, so ``kvpool`` runs this tree's code); the terminals run in a
temporary directory instead of the clone's top directory (so ``kvpool up``'s
``./.kvpool/nvme`` and ``lmcache.yaml`` do not land in the checkout); ``vllm serve``
becomes ``python -m bench.engine`` with the same config file (no GPU here). In the
commands themselves, the only changes are the rows of ``SUBSTITUTIONS``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from backend.launch.processes import ServerProcess
from tests.conftest import REPO

QUICKSTART = REPO / "docs" / "quickstart.md"
README = REPO / "README.md"

# Every change made to the pages' commands before they run, and why: (as on the page, as run, why).
# {port} and {redis_dir} are read from what `kvpool up` printed, {tmp} is the test's directory.
SUBSTITUTIONS: tuple[tuple[str, str, str], ...] = (
    ("127.0.0.1:PORT", "127.0.0.1:{port}", "the port of the pool URL `kvpool up` printed, as the page says"),
    (
        "127.0.0.1:6379",
        "127.0.0.1:{port}",
        "the page: 'The examples below write kvpool://127.0.0.1:6379/... where yours has its port'",
    ),
    (
        "/tmp/kvpool-redis-XXXX",
        "{redis_dir}",
        "the directory of the redis_password_file= in the pool URL `kvpool up` printed",
    ),
    ("--dram 256MiB", "--dram 64MiB", "the page's smallest for any model; the test's model has 2 MiB chunks"),
    ("--nvme-dir /mnt/nvme/kvpool", "--nvme-dir {tmp}/nvme", "the reader's NVMe disk; the test's is a tmp directory"),
)

START_TIMEOUT_S = 60.0  # `kvpool up` and the node: ready in a few seconds with 64 MiB arenas
BLOCK_TIMEOUT_S = 60.0
ENGINE_TIMEOUT_S = 120.0  # one engine imports torch and LMCache and takes LMCache's 5 GiB local CPU buffer
STOP_TIMEOUT_S = 15.0
CHUNKS = 8
DONE = "__quickstart_block_done__"
SHM = Path("/dev/shm")


# -- the pages -----------------------------------------------------------------------------------
def _section(text: str, heading: str) -> str:
    """``text`` from the line ``heading`` to the next heading of the same level or above."""
    start = text.index(f"\n{heading}\n") + 1
    depth = len(heading.split(" ", 1)[0])
    after = re.search(rf"^#{{1,{depth}}} ", text[start + len(heading) :], re.MULTILINE)
    return text[start : start + len(heading) + after.start()] if after else text[start:]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def _commands(block: str) -> list[str]:
    """The block's commands, one per logical line (continuations joined), comments kept, pip installs dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("pip install")]


def quickstart_pool_url_block() -> str:
    """What section 1 says `kvpool up` prints as its pool URL (the block under "Use the URL it prints, as printed")."""
    text = _section(QUICKSTART.read_text(), "## 1. Start a pool")
    found = re.search(r"\*\*Use the URL it prints, as printed:\*\*\n\n```\n(.*?)```", text, re.S)
    assert found, "section 1 no longer shows the pool URL `kvpool up` prints"
    return found.group(1)


def quickstart_steps() -> tuple[str, str, str, str, str]:
    """(kvpool up, export + status, the second node, 2a's in-process command, 2a's YAML) as the page shows them."""
    text = QUICKSTART.read_text()
    up, status, node = ("\n".join(_commands(b)) for b in _bash_blocks(_section(text, "## 1. Start a pool")))
    inproc = _section(text, "### 2a. In-process mode")
    found = re.search(
        r"`(kvpool lmcache-config --url '[^`]+')` prints exactly this:\n\n```yaml\n(.*?)```", inproc, re.S
    )
    assert found, "section 2a no longer shows its command and the YAML it prints"
    return up, status, node, found.group(1), found.group(2)


def readme_steps() -> tuple[str, list[str], str]:
    """README's LMCache quick start: (its `kvpool up`, the commands of the second terminal, the engine's line)."""
    (block,) = _bash_blocks(_section(README.read_text(), "## Using it with LMCache"))
    up, *middle, engine = _commands(block)
    return up, middle, engine


def substitute(command: str, values: dict[str, str]) -> str:
    for page, run, _why in SUBSTITUTIONS:
        if page in command:  # `kvpool up`'s command is run before its port is known
            command = command.replace(page, run.format(**values))
    return command


# -- terminals ------------------------------------------------------------------------------------
class Terminal:
    """One ``bash`` fed blocks as a reader types them (exports carry from block to block); ``set -e``: a
    failing command ends it, and the block fails the test with what the terminal showed."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._send("set -e -o pipefail")

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def run(self, block: str) -> list[str]:
        """Run ``block``; the lines it printed."""
        self._send(f"{block}\necho {DONE}")
        out: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=BLOCK_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"no end within {BLOCK_TIMEOUT_S} s of:\n{block}\n" + "\n".join(out)) from None
            if line is None:
                raise AssertionError(f"a command failed:\n{block}\n--- the terminal showed ---\n" + "\n".join(out))
            if line == DONE:
                return out
            out.append(line)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(10)


class Foreground(ServerProcess):
    """A command run in the foreground of a terminal of its own: its own process group, which Ctrl-C signals."""

    def __init__(self, name: str, command: str, ready: str, cwd: Path) -> None:
        argv = ["bash", "--noprofile", "--norc", "-c", command]
        super().__init__(name, argv, re.compile(ready), cwd=cwd, preexec_fn=os.setpgrp)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> re.Match[str]:
        """Its ready line; fails as soon as the command exits without printing it (a refused start)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.1) and time.monotonic() < deadline:
            if not self._pump_thread.is_alive():  # its output ended: it exited
                raise AssertionError(f"{self.name} exited {self.wait_exit()} before it was ready:\n{self.tail(30)}")
        return super().wait_ready(0)

    def ctrl_c(self) -> int:
        """SIGINT to the process group, as the terminal sends it; the exit status."""
        os.killpg(self.pid, signal.SIGINT)
        return self.wait_exit(STOP_TIMEOUT_S)

    def kill_group(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)


# -- processes and /dev/shm -----------------------------------------------------------------------
def _stat(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (state, ppid, pgrp, ...); [] once the process is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _group(pgid: int) -> set[int]:
    return {pid for pid in _pids() if _stat(pid)[2:3] == [str(pgid)]}


def _children(pids: set[int]) -> set[int]:
    return {pid for pid in _pids() if _stat(pid)[1:2] and int(_stat(pid)[1]) in pids}


def _comm(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    return _stat(pid)[:1] not in ([], ["Z"])


def _shm_files(pids: set[int]) -> list[str]:
    """kvpool's files in /dev/shm (arenas, stages: ``kvpool-<pid>-...``) of any of ``pids``."""
    prefixes = tuple(f"kvpool-{pid}-" for pid in pids)
    return sorted(name for name in os.listdir(SHM) if name.startswith(prefixes))


# -- the walk -------------------------------------------------------------------------------------
def _pool_url(up_output: str) -> str:
    """The pool URL as a reader finds it: the line under ``Pool URL:``."""
    lines = up_output.splitlines()
    return lines[lines.index("Pool URL:") + 1].strip()


def _engine(role: str, config: Path, cwd: Path, env: dict[str, str]) -> tuple[dict, int]:
    """``python -m bench.engine ROLE --lmcache-config CONFIG`` in a process of its own: (its report, its pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.engine", role, "--lmcache-config", str(config), "--chunks", str(CHUNKS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
    )
    out, err = proc.communicate(timeout=ENGINE_TIMEOUT_S)
    assert proc.returncode == 0, f"engine {role} exited {proc.returncode}:\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1]), proc.pid


def test_the_substitutions_each_change_something_the_pages_show():
    pages = QUICKSTART.read_text() + README.read_text()
    assert [page for page, _, _ in SUBSTITUTIONS if page not in pages] == []


def test_readme_starts_the_pool_as_the_quickstart_does_and_exports_the_same_url():
    up, status, _node, _inproc, _yaml = quickstart_steps()
    readme_up, readme_middle, readme_engine = readme_steps()
    assert readme_up.split("#")[0].split() == ["kvpool", "up"]
    assert up.split()[:2] == ["kvpool", "up"]
    export = next(line for line in status.splitlines() if line.startswith("export KVPOOL_URL="))
    assert readme_middle[0].split("#")[0].strip() == export.split("#")[0].strip()
    assert "LMCACHE_CONFIG_FILE=" in readme_engine and "vllm serve" in readme_engine


@pytest.mark.usefixtures("processes")
def test_the_quickstart_run_as_written_gives_a_fresh_engine_hits_and_stops_clean(tmp_path):
    up_cmd, status_cmd, node_cmd, inproc_cmd, inproc_yaml = quickstart_steps()
    _, readme_cmds, engine_line = readme_steps()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),  # `kvpool` and `python -m bench.engine` run this checkout's code
        "LMCACHE_TRACK_USAGE": "false",
    }
    up = Foreground("kvpool up", substitute(up_cmd, {"tmp": str(tmp_path)}), r"^Ctrl-C stops the pool\.", tmp_path)
    node: Foreground | None = None
    terminal: Terminal | None = None
    engine_pids: set[int] = set()
    try:
        up.start(env)
        up.wait_ready(START_TIMEOUT_S)
        url = _pool_url(up.log)
        password_file = Path(parse_qs(urlsplit(url).query)["redis_password_file"][0])
        values = {"port": str(urlsplit(url).port), "redis_dir": str(password_file.parent), "tmp": str(tmp_path)}
        redis_pids = {pid for pid in _children(_group(up.pid)) if _comm(pid) == "redis-server"}
        assert redis_pids, up.log

        terminal = Terminal(tmp_path, env)
        status = terminal.run(substitute(status_cmd, values))
        assert any(re.match(r"Nodes\s+1 alive", line) for line in status), status

        node = Foreground("kvpool node", substitute(node_cmd, values), r" ready at ", tmp_path)
        node.start(env)
        node.wait_ready(START_TIMEOUT_S)

        printed = terminal.run(substitute(inproc_cmd, values))
        assert "\n".join(printed) + "\n" == substitute(inproc_yaml, values), "not what the quickstart shows"
        terminal.run("\n".join(substitute(command, values) for command in readme_cmds))
        config = tmp_path / re.search(r"LMCACHE_CONFIG_FILE=(\S+)", engine_line).group(1)  # type: ignore[union-attr]
        up_yaml = up.log.split("LMCache config (LMCACHE_CONFIG_FILE):\n\n", 1)[1].split("\nCtrl-C")[0]
        assert config.read_text().strip() == "\n".join(printed).strip() == up_yaml.strip()

        put, put_pid = _engine("put", config, tmp_path, env)
        get, get_pid = _engine("get", config, tmp_path, env)
        engine_pids = {put_pid, get_pid}
        assert put["hit_prefix"] == CHUNKS and "RemoteBackend-kvpool" in put["backends"], put
        assert get["hit_prefix"] == get["hits"] == get["identical"] == CHUNKS, get
        assert substitute(quickstart_pool_url_block(), values) in up.log, "the page's pool URL is not what was printed"
        # The test's own check, not a page command: the second node joined the pool the engines used.
        pool = json.loads("\n".join(terminal.run("kvpool status --json")))
        assert pool["nodes"]["alive"] == 2 and pool["objects"] == CHUNKS, pool

        pids = _group(up.pid) | _group(node.pid) | redis_pids
        assert _shm_files(pids), "no arena in /dev/shm while the pool runs: the check below would prove nothing"
        assert node.ctrl_c() == 0, node.tail()
        assert up.ctrl_c() == 0, up.tail()
        assert "kvpool pool stopped." in up.log
    finally:
        if terminal is not None:
            terminal.close()
        for foreground in (node, up):
            if foreground is not None:
                foreground.kill_group()
    assert [pid for pid in pids if _alive(pid)] == []
    assert _shm_files(pids | engine_pids) == []
    assert not password_file.parent.exists(), "kvpool up left its Redis's directory"
