"""The kvpool CLI as a user runs it: real processes, real pool."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from backend.embedded import free_port
from backend.lmcache.config import remote_url_pool_config
from backend.node.memory.arena import room_of
from kvpool import Chunk, KVPoolError, PoolConfig, SyncPoolClient
from tests.conftest import REPO
from tests.support.cli import QUICKSTART_PASSWORD_FILE, QUICKSTART_URL, kvpool, quickstart_url


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("form", [[], ["--form", "remote_url"]], ids=["plugin", "remote_url"])
def test_lmcache_config_prints_exactly_what_the_quickstart_shows(form, tmp_path):
    doc = (REPO / "docs" / "quickstart.md").read_text()
    command = " ".join(["kvpool lmcache-config", *form, f"--url '{QUICKSTART_URL}'"])
    block = re.search(re.escape(f"`{command}` prints exactly this:") + r"\n\n```yaml\n(.*?)```", doc, re.S)
    assert block is not None, command
    url, password_file = quickstart_url(tmp_path)
    # --offline: no pool runs at that address here; with one running, the checked output is the same.
    out = kvpool("lmcache-config", *form, "--url", url, "--offline")
    assert out.returncode == 0, out.stderr
    assert out.stdout.replace(password_file, QUICKSTART_PASSWORD_FILE) == block.group(1)


def _as_lmcache_reads_it(env_lines: str) -> dict:
    """Export ``env_lines`` (``export LMCACHE_...=...``) into a fresh process and load LMCache's config there."""
    env = {}
    for line in env_lines.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = subprocess.run(["sh", "-c", f"printf %s {value}"], capture_output=True, text=True).stdout
    code = (
        "import json\nfrom lmcache.v1.config import load_engine_config_with_overrides\n"
        "c = load_engine_config_with_overrides()\n"
        "print(json.dumps({'plugins': c.remote_storage_plugins, 'extra': c.extra_config, 'remote_url': c.remote_url}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, **env}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.usefixtures("processes")
def test_lmcache_config_env_format_is_read_back_by_lmcache():
    out = kvpool("lmcache-config", "--url", "kvpool://10.1.2.3:6380/prod", "--format", "env", "--offline")
    assert out.returncode == 0
    seen = _as_lmcache_reads_it(out.stdout)
    assert seen["plugins"] == ["kvpool"]
    assert seen["remote_url"] is None
    assert seen["extra"]["remote_storage_plugin.kvpool.url"] == "kvpool://10.1.2.3:6380/prod"
    assert seen["extra"]["remote_storage_plugin.kvpool.class_name"] == "KVPoolConnectorAdapter"


@pytest.mark.usefixtures("processes")
def test_lmcache_config_remote_url_env_is_one_lmcache_remote_url_naming_the_same_pool():
    url = "kvpool://10.1.2.3:6380/prod?redis_mode=cluster&redis_hosts=10.1.2.4:6380,10.1.2.5:6380&replicas=2"
    out = kvpool("lmcache-config", "--url", url, "--form", "remote_url", "--format", "env", "--offline")
    assert out.returncode == 0
    assert "export LMCACHE_REMOTE_URL='external://10.1.2.3:6380/kvpool.lmcache_connector/" in out.stdout
    seen = _as_lmcache_reads_it(out.stdout)
    assert not seen["plugins"] and not (seen["extra"] or {})  # never both forms
    assert remote_url_pool_config(seen["remote_url"]) == PoolConfig.from_url(url)


@pytest.mark.usefixtures("processes")
def test_lmcache_config_remote_url_form_leaves_inline_secrets_out_and_refuses_mp_mode():
    out = kvpool(
        "lmcache-config", "--url", "kvpool://:tok3n-0123456789abcdef@h:6379/ns", "--form", "remote_url", "--offline"
    )
    assert out.returncode == 0 and "tok3n-0123456789abcdef" not in out.stdout and "KVPOOL_TOKEN" in out.stderr
    mp = kvpool("lmcache-config", "--url", "kvpool://h:6379/ns", "--mode", "mp", "--form", "remote_url")
    assert mp.returncode == 2 and "--form" in mp.stderr and mp.stderr.strip().count("\n") == 0


@pytest.mark.usefixtures("processes")
def test_bad_url_is_one_line_naming_the_problem_and_exit_2():
    out = kvpool("lmcache-config", "--url", "redis://127.0.0.1:6379/x")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "scheme" in out.stderr and "kvpool://" in out.stderr


@pytest.mark.usefixtures("processes")
def test_usage_errors_exit_2():
    assert kvpool("frobnicate").returncode == 2
    assert kvpool("node", "--dram", "1GiB").returncode == 2  # --redis is required
    bad_size = kvpool("node", "--redis", "redis://127.0.0.1:1", "--dram", "lots")
    assert bad_size.returncode == 2 and "--dram" in bad_size.stderr


@pytest.mark.usefixtures("processes")
def test_status_with_unreachable_redis_is_one_line_and_exit_1():
    out = kvpool("status", "--url", f"kvpool://127.0.0.1:{free_port()}/x?progress_timeout_s=0.3")
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "Redis" in out.stderr


def test_status_json_reports_nodes_objects_and_bytes(node_factory, pool_url):
    node_factory(dram="64MiB")
    node_factory(dram="32MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put([Chunk(f"s@{i}", bytes(1000 + i)) for i in range(5)])
        client.get(["s@0", "s@1", "nope"])
    out = kvpool("status", "--url", pool_url, "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["nodes"] == {"alive": 2, "dead": 0, "draining": 0}
    assert status["objects"] == 5
    # DRAM counts each chunk at the room it takes (docs/operations.md): 1,000-1,004 bytes sit in 1 KiB cells
    assert status["used_bytes"] == sum(room_of(1000 + i) for i in range(5)) == 5 * 1024
    assert status["capacity_bytes"] == 96 * 2**20
    assert status["hits"] == 2 and status["gets"] == 2  # "nope" never reached a node
    human = kvpool("status", "--url", pool_url)
    assert "2 alive, 0 dead" in human.stdout


@pytest.mark.usefixtures("processes")
def test_up_prints_the_url_serves_and_stops_cleanly_on_ctrl_c(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.cli", "up", "--dram", "64MiB", "--nvme-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.strip().startswith("kvpool://") and not url:
                url.append(line.strip())
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert found.wait(30), "".join(lines)
        with SyncPoolClient(PoolConfig.from_url(url[0])) as client:
            client.put([Chunk("u", b"hello")])
            assert bytes(client.get(["u"])[0].data) == b"hello"
        assert "remote_storage_plugins" in "".join(lines)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "kvpool pool stopped." in "".join(lines)
    port = int(url[0].split(":")[2].split("/")[0])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # the private redis-server is gone


def test_public_api_is_what_the_readme_lists():
    import kvpool

    readme = (REPO / "README.md").read_text()
    listed = set(re.findall(r"`(\w+)`", readme.split("The public Python API is")[1].split("\n\n")[0]))
    errors = {name for name in kvpool.__all__ if name.endswith("Error") or name == "NodeUnavailable"}
    assert set(kvpool.__all__) - errors == listed
    for name in kvpool.__all__:
        assert hasattr(kvpool, name)


def test_check_exits_0_when_clean_3_when_it_finds_problems_and_1_when_redis_is_unreachable(
    node_factory, pool_url, redis_server, namespace
):
    """A cron job runs `kvpool check` and alerts on its exit status (docs/cli.md)."""
    import asyncio

    from backend.metadata import Location, MetadataStore

    node = node_factory(dram="16MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put([Chunk(f"c@{i}", bytes(100)) for i in range(5)])
    clean = kvpool("check", "--url", pool_url)
    assert clean.returncode == 0 and "clean" in clean.stdout, clean.stdout + clean.stderr

    async def orphan() -> None:  # an index entry pointing at a live node that never had the bytes
        store = MetadataStore(redis_server.url, namespace)
        try:
            await store.index.commit([("ghost", Location(node.node_id, node.epoch, "dram", 10, 1))])
        finally:
            await store.close()

    asyncio.run(orphan())
    found = kvpool("check", "--url", pool_url)
    assert found.returncode == 3 and "run `kvpool check --fix`" in found.stdout
    assert kvpool("check", "--url", pool_url, "--json").returncode == 3
    fixed = kvpool("check", "--url", pool_url, "--fix")
    assert fixed.returncode == 3 and "fixed: removed 1 index entries" in fixed.stdout  # it was found, then fixed
    assert kvpool("check", "--url", pool_url).returncode == 0
    unreachable = kvpool("check", "--url", f"kvpool://127.0.0.1:{free_port()}/x?progress_timeout_s=0.3")
    assert unreachable.returncode == 1 and "Redis" in unreachable.stderr


@pytest.mark.usefixtures("processes")
def test_usage_errors_found_inside_a_verb_exit_2_with_one_line_naming_the_flag():
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_URL"}
    url = "kvpool://127.0.0.1:1/x"
    cases = [
        (["ls", "--url", url, "--limit", "0"], "--limit"),
        (["evict", "--url", url, "k", "--model", "m"], "evict"),
        (["drain", "--url", url, "n", "--batch", "0"], "--batch"),
        (["status"], "--url"),
        (["lmcache-config", "--url", url, "--format", "args"], "--format"),
        (["node", "--redis", "redis://127.0.0.1:1", "--pair-timeout-s", "0"], "--pair-timeout-s"),
    ]
    for args, flag in cases:
        out = subprocess.run(
            [sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=60, env=env
        )
        assert out.returncode == 2, (args, out.returncode, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and flag in out.stderr, (args, out.stderr)


def test_ls_into_a_pipe_closed_early_exits_quietly(node_factory, pool_url):
    """`kvpool ls | head` must not end in a BrokenPipeError traceback."""
    node_factory(dram="64MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put([Chunk(f"pipe@{i:05d}", b"x") for i in range(3000)])  # far more than a pipe buffer of lines
    script = f"set -o pipefail; {sys.executable} -m backend.cli ls --url {pool_url} | head -n 1; echo status=$?"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.count("\n") == 2 and out.stdout.startswith("pipe@"), out.stdout
    assert "status=141" in out.stdout  # 128 + SIGPIPE, as `cat` would exit
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr and "Exception" not in out.stderr, (
        out.stderr
    )


def test_pyproject_asks_for_the_python_the_code_needs():
    """asyncio.timeout (3.11) is used throughout; pip must not install kvpool on 3.10."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"
    assert project["tool"]["mypy"]["python_version"] == "3.11"


# -- Round 3: usage and connection errors are one line, never a traceback ----------------------------


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("verb", [["status"], ["lmcache-config"]])
def test_a_malformed_url_is_one_line_naming_the_url_and_exit_2(verb):
    out = kvpool(*verb, "--url", "kvpool://:s3cret@[::1/default")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "url: malformed URL kvpool://:***@[::1/default" in out.stderr and "s3cret" not in out.stderr


@pytest.mark.usefixtures("processes")
def test_redis_mode_cluster_against_a_redis_that_is_not_one_is_one_line_and_exit_1(redis_server):
    for port in (redis_server.port, free_port()):  # not a cluster; nothing listening
        out = kvpool("status", "--url", f"kvpool://127.0.0.1:{port}/x?redis_mode=cluster&progress_timeout_s=0.5")
        assert out.returncode == 1, out.stderr
        assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
        assert "Redis" in out.stderr and "cluster" in out.stderr
    node = kvpool("node", "--redis", f"redis+cluster://127.0.0.1:{redis_server.port}", "--dram", "8MiB")
    assert node.returncode == 1 and "Traceback" not in node.stderr, node.stderr[-2000:]
    assert "Cluster" in node.stderr.strip().splitlines()[-1]


@pytest.mark.usefixtures("processes")
def test_an_unknown_flag_before_the_verb_is_named():
    out = kvpool("--bogus")
    assert out.returncode == 2
    assert "unrecognized arguments: --bogus" in out.stderr and "required" not in out.stderr
    assert "required: VERB" in kvpool().stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["nodee"], "argument VERB: invalid choice: 'nodee'; did you mean node or nodes? (choose from 'up', 'node', "),
        (["quota", "sett"], "invalid choice: 'sett'; did you mean set? (choose from 'list', 'set', 'clear')"),
        (["node", "--dramm", "8MiB"], "unrecognized arguments: --dramm 8MiB; did you mean --dram?"),
        (["ls", "--limt=3"], "unrecognized arguments: --limt=3; did you mean --limit?"),
        (["node", "--channel", "ncl"], "argument --channel: invalid choice: 'ncl'; did you mean nccl?"),
        (
            ["node", "--pair-timeout-ms", "500"],
            "unrecognized arguments: --pair-timeout-ms 500; did you mean --pair-timeout-s? (--pair-timeout-ms was its "
            "name before 0.1, in milliseconds: give seconds)",
        ),
        (["node", "--dead-node-grace-ms", "5"], "did you mean --dead-node-grace-s? (--dead-node-grace-ms was its"),
        (["up", "--handshake-timeout-ms", "5"], "did you mean --handshake-timeout-s? (--handshake-timeout-ms was its"),
        (
            ["node", "--redis", "redis://127.0.0.1:1", "--eviction", "prefix-freq"],
            "kvpool: error: --eviction: 'prefix-freq' is not one of lru, prefix, prefix-recency; did you mean prefix? "
            "(prefix-freq was its name before 0.1)",
        ),
    ],
)
def test_an_unknown_verb_flag_or_value_exits_2_naming_the_close_one(args, said, capsys):
    """A typo, or a name of before 0.1, is refused (nothing starts) with the name to give instead."""
    from backend.cli import main

    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own refusals exit; the config's are returned
        code = int(str(exc.code))
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert said in stderr, stderr


def test_admin_verbs_keep_stderr_for_warnings_and_errors(node_factory, pool_url):
    # A drain reads through the same-host arena, which the client logs at INFO: a server's
    # progress note, not something a one-shot verb should print.
    source = node_factory(shm=True, dram="32MiB")
    node_factory(shm=True, dram="32MiB")
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put([Chunk(f"quiet@{i}", bytes([i]) * 4096) for i in range(16)])
    out = kvpool("drain", source.node_id, "--url", pool_url)
    assert out.returncode == 0, out.stderr
    assert "moved" in out.stdout or "drained" in out.stdout, out.stdout
    assert out.stderr == ""
    debug = kvpool("--debug", "undrain", source.node_id, "--url", pool_url)
    assert debug.returncode == 0 and "DEBUG" in debug.stderr  # --debug still shows everything


def test_a_token_pool_tells_a_client_without_the_token_how_to_give_it(node_factory, pool_url, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789abcdef0123\n")
    node_factory("--token-file", str(token))
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client, pytest.raises(KVPoolError) as refused:
        client.put([Chunk("k@0", b"x")])
    assert "token_file=PATH" in str(refused.value) and ":TOKEN@" not in str(refused.value)


def test_the_events_token_files_are_read_and_checked_the_same_way(tmp_path):
    from backend.cli.events import _token
    from backend.errors import ConfigError

    good, short = tmp_path / "good", tmp_path / "short"
    good.write_text("tenant-token-0123456789abcdef0123\n")
    short.write_text("short\n")
    good.chmod(0o600)
    short.chmod(0o600)
    assert _token("", "--tenant-token-file") == ""  # not given: no token
    for flag in ("--tenant-token-file", "--token-file-next"):
        assert _token(str(good), flag) == "tenant-token-0123456789abcdef0123"
        with pytest.raises(ConfigError) as refused:
            _token(str(short), flag)
        assert refused.value.key == flag


# -- errors that name the fix and the file -----------------------------------------------------------
@pytest.mark.usefixtures("processes")
def test_redis_not_running_names_the_url_and_a_stale_kvpool_url_from_the_environment():
    port = free_port()
    url = f"kvpool://127.0.0.1:{port}/x?progress_timeout_s=0.3"
    given = kvpool("status", "--url", url)
    assert given.returncode == 1 and given.stderr.count("\n") == 1, given.stderr
    assert f"Redis at redis://127.0.0.1:{port}/0 is unreachable" in given.stderr
    assert "KVPOOL_URL" not in given.stderr  # --url was given: nothing from the environment to suspect
    for verb in ("status", "nodes", "ls", "stats"):
        out = kvpool(verb, "--json", env={"KVPOOL_URL": url})
        assert out.returncode == 1, (verb, out.stdout, out.stderr)
        error = json.loads(out.stdout)  # --json: a JSON error object on stdout, not nothing
        assert error["type"] == "RedisUnreachableError" and error["exit_code"] == 1, error
        assert f"127.0.0.1:{port}" in error["error"]
        assert "KVPOOL_URL came from the environment and may be stale from an earlier `kvpool up`" in error["error"]
        assert out.stderr.count("\n") == 1 and "may be stale" in out.stderr


@pytest.mark.usefixtures("processes")
def test_a_usage_error_of_a_json_verb_is_a_json_error_and_exit_2():
    out = kvpool("ls", "--json", "--limit", "0", "--url", "kvpool://127.0.0.1:1/x")
    assert out.returncode == 2 and json.loads(out.stdout) == {
        "error": "--limit: must be a positive number",
        "type": "ConfigError",
        "exit_code": 2,
    }


def test_a_wrong_redis_password_names_the_file_it_read_in_every_verb(redis_factory, tmp_path):
    from backend.embedded import EmbeddedRedis

    server = EmbeddedRedis().start(password="the-right-password")
    redis_factory.append(server)
    wrong = tmp_path / "redis-password"
    wrong.write_text("a-wrong-password\n")
    wrong.chmod(0o600)
    url = f"kvpool://127.0.0.1:{server.port}/x?redis_password_file={wrong}"
    for verb in (["status"], ["nodes"], ["ls"], ["stats"], ["drain", "some-node"], ["evict", "k"]):
        out = kvpool(*verb, "--url", url)
        assert out.returncode == 1 and out.stderr.count("\n") == 1, (verb, out.stderr)
        assert f"refused the password in {wrong}" in out.stderr, (verb, out.stderr)
        assert "set redis_password_file=PATH" not in out.stderr and "a-wrong-password" not in out.stdout + out.stderr
    out = kvpool("status", "--json", "--url", url)
    error = json.loads(out.stdout)
    assert out.returncode == 1 and error["type"] == "RedisAuthError" and str(wrong) in error["error"]
    missing = kvpool("status", "--url", f"kvpool://127.0.0.1:{server.port}/x")
    assert missing.returncode == 1 and "asks for a password and none was given" in missing.stderr
    assert "add redis_password_file=PATH" in missing.stderr


def test_drain_of_an_unknown_node_lists_the_live_node_ids(node_factory, pool_url):
    node = node_factory()
    out = kvpool("drain", "no-such-node", "--url", pool_url)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "node 'no-such-node' is not alive" in out.stderr and f"live nodes: {node.node_id}" in out.stderr
    typo = kvpool("drain", node.node_id[:-1], "--url", pool_url, "--json")
    assert typo.returncode == 1 and f"did you mean {node.node_id}?" in json.loads(typo.stdout)["error"]


def test_operations_md_shows_the_columns_kvpool_ls_prints(node_factory, pool_url):
    node_factory()
    with SyncPoolClient(PoolConfig.from_url(pool_url)) as client:
        client.put([Chunk("model@1@0@abc", b"x" * 4096)])
    section = (REPO / "docs" / "operations.md").read_text().split("## Where does a key live?")[1].split("\n## ")[0]
    shown = re.search(r"```\n(\S+@\S+  .*)\n```", section)
    assert shown is not None and not re.search(r"\bage\b", section)
    printed = kvpool("ls", "--url", pool_url)
    assert printed.returncode == 0, printed.stderr
    [line] = printed.stdout.splitlines()
    columns, doc_columns = line.split("  "), shown.group(1).split("  ")
    assert len(columns) == len(doc_columns), (line, shown.group(1))
    shape = [r"\S+@\S+", r"\S+", r"\S+", r"dram|nvme", r"\d+ B|\d+\.\d (KiB|MiB|GiB)", r"epoch \d+"]
    for pattern, got, doc in zip(shape, columns, doc_columns, strict=True):  # key, node, host, tier, size, epoch
        assert re.fullmatch(pattern, got) and re.fullmatch(pattern, doc), (pattern, got, doc)
