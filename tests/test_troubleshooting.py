"""docs/troubleshooting.md, entry by entry: each failure caused for real, and the `kvpool` command that names it.

One pool is shared by most cases: a redis-server behind a password, a node that wants a
token, in namespace ``good``. A case breaks one thing on its own (a URL without the
password, a node advertising an address nobody can dial, a node whose clock is hours
off, ...) and checks that `kvpool doctor` (or `status`, `selftest`, `lmcache-config`)
names the cause, by the anchor of its troubleshooting entry. ``ENTRY_TESTS`` maps every
entry to the test that causes it; a test below fails when an entry has none.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from cryptography import x509

from backend.cli import main
from backend.doctor import CAUSES, SELFTEST_PREFIX
from backend.doctor.findings import Cause
from backend.embedded import EmbeddedRedis, free_port
from backend.launch.nodes import NodeProcess
from tests.conftest import REPO
from tests.faults.proxy import skewed_clock_env
from tests.security.test_tls_and_tokens import _make_ca, _make_leaf
from tests.support.waits import wait_until

PAGE = REPO / "docs" / "troubleshooting.md"
PASSWORD = "troubleshoot-redis-pw"
TOKEN = "troubleshoot-token-0123456789abcdef"
NODE_ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "KVPOOL_PREFAULT": "off"}

# Each entry of docs/troubleshooting.md (by anchor) and the test that causes it.
ENTRY_TESTS = {
    "every-lookup-misses": "test_every_lookup_misses_when_no_node_is_alive_anywhere_and_the_connector_says_why_once",
    "plugin-not-loaded": "test_plugin_not_loaded_names_the_import_error_lmcache_only_logs",
    "wrong-redis-password": "test_wrong_or_missing_redis_password_is_named_and_lmcache_config_refuses",
    "wrong-token": "test_wrong_or_missing_token_is_named_per_node",
    "wrong-namespace": "test_wrong_namespace_names_the_namespaces_that_have_nodes",
    "node-not-advertised-on-a-reachable-address": "test_node_advertised_on_an_unreachable_address_is_named",
    "devshm-too-small": "test_devshm_too_small_for_the_arena_is_named_on_the_node_host",
    "nvme-directory-not-writable": "test_nvme_directory_not_writable_is_named_on_a_core_install_without_lmcache",
    "redis-full": "test_redis_full_is_named",
    "clock-skew": "test_clock_skew_of_a_node_is_named",
    "tls-name-mismatch": "test_tls_name_mismatch_and_untrusted_certificate_are_named",
    "version-mismatch": "test_version_mismatch_between_node_and_client_is_named",
    "redis-unreachable": "test_redis_unreachable_or_paused_is_named",
    "redis-paused-or-slow": "test_redis_unreachable_or_paused_is_named",
    "secret-file-unreadable": "test_secret_file_unreadable_is_named",
    "tls-certificate-not-trusted": "test_tls_name_mismatch_and_untrusted_certificate_are_named",
}


@dataclass
class Pool:
    redis: EmbeddedRedis
    password_file: Path
    token_file: Path
    node: NodeProcess = field(init=False)  # the one node of namespace "good"

    def url(self, namespace: str = "good", *, password: bool = True, token: bool = True, **options: str) -> str:
        query = {"progress_timeout_s": "1", **options}
        if password:
            query["redis_password_file"] = str(self.password_file)
        if token:
            query["token_file"] = str(self.token_file)
        return f"kvpool://127.0.0.1:{self.redis.port}/{namespace}?" + "&".join(f"{k}={v}" for k, v in query.items())

    def start_node(self, namespace: str, *extra: str, env: dict[str, str] | None = None) -> NodeProcess:
        args = ["--redis", self.redis.url, "--namespace", namespace, "--dram", "16MiB", "--shm-dir", "off"]
        args += ["--redis-password-file", str(self.password_file), "--token-file", str(self.token_file), *extra]
        return NodeProcess(args, {**NODE_ENV, **(env or {})}).start()


@pytest.fixture(scope="module")
def pool(processes: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    directory = tmp_path_factory.mktemp("pool")
    password_file, token_file = directory / "redis-password", directory / "token"
    password_file.write_text(PASSWORD + "\n")
    token_file.write_text(TOKEN + "\n")
    for path in (password_file, token_file):
        path.chmod(0o600)
    redis = EmbeddedRedis().start(password=PASSWORD)
    try:
        made = Pool(redis, password_file, token_file)
        made.node = made.start_node("good")
        try:
            yield made
        finally:
            made.node.kill()
    finally:
        redis.cleanup()


def kvpool(*args: str) -> tuple[int, str, str]:
    """Run the CLI in this process (no interpreter start per case): exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def doctor(*args: str) -> tuple[int, list[dict[str, str]]]:
    code, out, err = kvpool("doctor", *args, "--json")
    assert out, err
    return code, json.loads(out)


def failed(findings: list[dict[str, str]], cause: str) -> list[dict[str, str]]:
    """The failed findings that name ``cause`` (an anchor of docs/troubleshooting.md)."""
    return [f for f in findings if f["cause"] == cause and not f["ok"]]


# -- the page itself ---------------------------------------------------------------------------
def _entries() -> dict[str, str]:
    """The page's entries: anchor -> text, for every ``## `` heading."""
    text = PAGE.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {Cause(title).slug: body for title, body in zip(parts[1::2], parts[2::2])}


def test_the_page_has_an_entry_per_cause_with_symptom_cause_and_command_and_each_is_tested():
    entries = _entries()
    assert len(entries) >= 12
    assert sorted(entries) == sorted(c.slug for c in CAUSES), "an entry per cause doctor names, and no other"
    for slug, body in entries.items():
        for part in ("**Symptom.**", "**Cause.**", "**Confirm.**"):
            assert part in body, (slug, part)
        assert re.search(r"`kvpool (doctor|status|selftest|lmcache-config)[^`]*`", body), slug
        assert ENTRY_TESTS.get(slug) in globals(), f"no test causes the entry {slug!r}"


# -- every lookup misses -------------------------------------------------------------------------
def test_every_lookup_misses_when_no_node_is_alive_anywhere_and_the_connector_says_why_once(
    redis_factory, stack_factory, caplog, monkeypatch
):
    from prometheus_client import REGISTRY

    import backend.lmcache.pool_health as pool_health

    monkeypatch.setattr(pool_health, "POOL_RECHECK_S", 0.2)
    empty = EmbeddedRedis().start()  # a Redis no node ever joined
    redis_factory.append(empty)
    url = f"kvpool://127.0.0.1:{empty.port}/engines?progress_timeout_s=1"
    code, findings = doctor("--url", url)
    assert code == 1 and failed(findings, "every-lookup-misses"), findings
    assert "nor in any other namespace" in failed(findings, "every-lookup-misses")[0]["detail"]

    caplog.set_level(logging.INFO)
    stack = stack_factory(url)

    def pool_up() -> tuple[float | None, float | None]:
        labels = {"plugin": "kvpool"}
        down = REGISTRY.get_sample_value("kvpool_connector_pool_up", {**labels, "cause": "every-lookup-misses"})
        return down, REGISTRY.get_sample_value("kvpool_connector_pool_up", {**labels, "cause": ""})

    assert wait_until(lambda: pool_up()[0] == 0, 10.0), pool_up()
    keys = [stack.key(1), stack.key(2)]
    for _ in range(3):
        assert stack.contains_prefix(keys) == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("backend")]
    assert len(errors) == 1, errors  # once at start, not once per lookup
    assert "not usable at start" in errors[0] and "#every-lookup-misses" in errors[0] and "kvpool node" in errors[0]
    # The start check searched the other namespaces (a SCAN of the whole keyspace); the checks every
    # POOL_RECHECK_S ask for this namespace's nodes alone, or every engine would SCAN on a timer.
    with redis.Redis(port=empty.port) as raw:
        calls = lambda command: raw.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)  # noqa: E731
        scans_before, pings_before = calls("scan"), calls("ping")
        # Each recheck begins with a PING (and nothing else here pings): three of them, then count the SCANs.
        assert wait_until(lambda: calls("ping") >= pings_before + 3, 10.0, interval_s=0.02)
        assert calls("scan") == scans_before

    node = NodeProcess(
        ["--redis", empty.url, "--namespace", "engines", "--dram", "16MiB", "--shm-dir", "off"], NODE_ENV
    )
    node.start()
    try:
        assert wait_until(lambda: pool_up()[1] == 1, 10.0), pool_up()  # the quiet recheck saw it: up, no cause
        assert any("is usable now" in r.getMessage() for r in caplog.records)
        objs = [stack.make_object(i) for i in range(2)]
        stack.put(keys, objs)
        stack.release(objs)
        assert stack.contains_prefix(keys) == 2
    finally:
        node.kill()


# -- plugin not loaded ----------------------------------------------------------------------------
def test_plugin_not_loaded_names_the_import_error_lmcache_only_logs(pool, tmp_path):
    import yaml

    code, out, err = kvpool("lmcache-config", "--url", pool.url())
    assert code == 0, err
    config = yaml.safe_load(out)
    config["extra_config"]["remote_storage_plugin.kvpool.module_path"] = "backend.lmcache_conector"  # a typo
    config["max_local_cpu_size"] = 0.5
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(config))
    code, findings = doctor("--lmcache-config", str(path))
    assert code == 1
    named = failed(findings, "plugin-not-loaded")
    [failure] = [f for f in findings if not f["ok"]]  # one cause; LMCache building no backend is its consequence
    assert failure in named and "No module named 'backend.lmcache_conector'" in failure["detail"], findings
    assert "remote_storage_plugin.kvpool.module_path'] = 'kvpool.lmcache_connector'" in failure["fix"]


# -- wrong password -------------------------------------------------------------------------------
def test_wrong_or_missing_redis_password_is_named_and_lmcache_config_refuses(pool, tmp_path):
    code, findings = doctor("--url", pool.url(password=False))
    [finding] = failed(findings, "wrong-redis-password")
    assert code == 1 and finding["detail"].startswith("Redis asks for a password: add redis_password_file=")
    code, out, err = kvpool("lmcache-config", "--url", pool.url(password=False))
    assert code == 1 and out == ""
    assert "Redis asks for a password: add redis_password_file=" in err and err.count("\n") == 1
    code, out, _ = kvpool("lmcache-config", "--url", pool.url(password=False), "--offline")
    assert code == 0 and "remote_storage_plugins" in out  # --offline prints without asking Redis

    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    code, findings = doctor("--url", pool.url(password=False, redis_password_file=str(wrong)))
    [finding] = failed(findings, "wrong-redis-password")
    assert code == 1 and "refused the password" in finding["detail"] and str(wrong) in finding["detail"]
    assert "not-the-password" not in json.dumps(findings)
    assert kvpool("lmcache-config", "--url", pool.url(password=False, redis_password_file=str(wrong)))[0] == 1


# -- wrong token ---------------------------------------------------------------------------------
def test_wrong_or_missing_token_is_named_per_node(pool, tmp_path):
    other = tmp_path / "other-token"
    other.write_text("another-token-0123456789abcdef0123\n")
    other.chmod(0o600)
    for url in (pool.url(token=False), pool.url(token=False, token_file=str(other))):
        code, findings = doctor("--url", url)
        [finding] = failed(findings, "wrong-token")
        assert code == 1 and finding["check"] == f"node {pool.node.node_id}", findings
    code, out, _ = kvpool("selftest", pool.url(token=False))
    assert code == 1 and "[FAIL] put" in out and "token" in out, out


# -- wrong namespace -----------------------------------------------------------------------------
def test_wrong_namespace_names_the_namespaces_that_have_nodes(pool):
    code, findings = doctor("--url", pool.url("prod"))
    [finding] = failed(findings, "wrong-namespace")
    assert code == 1 and "'good' (1 live)" in finding["detail"] and "/good" in finding["fix"]
    code, out, err = kvpool("status", "--url", pool.url("prod"))
    assert code == 1 and "0 alive" in out
    assert "no live node in namespace 'prod'" in err and "'good' (1 live)" in err
    code, out, err = kvpool("status", "--url", pool.url("prod"), "--json")
    assert code == 1 and json.loads(out)["namespaces_with_live_nodes"]["good"] == 1
    code, out, err = kvpool("lmcache-config", "--url", pool.url("prod"))
    assert code == 1 and out == "" and "'good' (1 live)" in err
    assert kvpool("status", "--url", pool.url())[0] == 0  # the right namespace: 0 as before


# -- node not advertised on a reachable address --------------------------------------------------
def test_node_advertised_on_an_unreachable_address_is_named(pool):
    # Listens on 127.0.0.1 only and tells clients 127.0.0.2: what a node behind --host 127.0.0.1 that
    # advertises its LAN address does to every engine on another host.
    node = pool.start_node("adv", "--host", "127.0.0.1", "--advertise", "127.0.0.2")
    try:
        code, findings = doctor("--url", pool.url("adv"))
        [finding] = failed(findings, "node-not-advertised-on-a-reachable-address")
        assert code == 1 and "127.0.0.2" in finding["detail"] and "--advertise" in finding["fix"]
    finally:
        node.terminate()  # a clean stop leaves the registry: the other cases see no stale live node
    # On the node's host, before it starts: the same mistake, named from the flags alone.
    code, findings = doctor(
        "--node", "--redis", "redis://127.0.0.1:1/0", "--host", "127.0.0.1", "--advertise", "10.9.8.7"
    )
    assert failed(findings, "node-not-advertised-on-a-reachable-address"), findings


# -- /dev/shm too small ---------------------------------------------------------------------------
def test_devshm_too_small_for_the_arena_is_named_on_the_node_host(pool):
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    info = os.statvfs(shm)
    dram_mib = (info.f_bavail * info.f_frsize) // 2**20 + 1024  # more than this machine's /dev/shm has free
    args = ["--node", "--redis", pool.redis.url, "--redis-password-file", str(pool.password_file)]
    code, findings = doctor(*args, "--dram", f"{dram_mib}MiB", "--shm-dir", str(shm))
    [finding] = failed(findings, "devshm-too-small")
    assert code == 1 and "--shm-size" in finding["fix"] and "--shm-dir off" in finding["fix"]
    code, findings = doctor(*args, "--dram", "16MiB", "--shm-dir", str(shm))
    assert not failed(findings, "devshm-too-small"), findings


# -- NVMe directory not writable; the node-side doctor on a core install -----------------------------
BLOCK_LMCACHE = """
import importlib.abc, json, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('lmcache', 'torch'):
            raise ModuleNotFoundError(f'No module named {name!r} (a node host has the core install)')
sys.meta_path.insert(0, NotInstalled())
from backend.cli import main
code = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('lmcache', 'torch'))
print(json.dumps({'code': code, 'loaded': loaded}))
"""


@contextlib.contextmanager
def _not_writable(directory: Path) -> Iterator[str]:
    """``directory`` made unwritable for real: mode 0555, or for root (whom modes do not stop) a read-only
    file system mounted on it, as a volume mounted read-only into a node's container. Yields which."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield "mode 0555"
        finally:
            directory.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"root, and no read-only mount here to stop it writing: {mounted.stderr.decode().strip()}")
    try:
        yield "a read-only file system"
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_nvme_directory_not_writable_is_named_on_a_core_install_without_lmcache(pool, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    with _not_writable(nvme) as how:
        command = [sys.executable, "-c", BLOCK_LMCACHE, "doctor", "--node", "--json", "--redis", pool.redis.url]
        command += ["--redis-password-file", str(pool.password_file), "--nvme-dir", str(nvme), "--shm-dir", "off"]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60, env=NODE_ENV)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-2000:]
    findings, ran = json.loads("\n".join(lines[:-1])), json.loads(lines[-1])
    assert ran == {"code": 1, "loaded": []}, proc.stderr[-2000:]  # no LMCache, no torch: the core install
    [finding] = failed(findings, "nvme-directory-not-writable")
    assert str(nvme) in finding["detail"] and "chown" in finding["fix"], (how, finding)
    assert [f["check"] for f in findings if not f["ok"]] == ["NVMe directory"], findings  # nothing else failed


# -- Redis full ------------------------------------------------------------------------------------
def test_redis_full_is_named(redis_factory):
    import redis

    server = EmbeddedRedis().start()
    redis_factory.append(server)
    with redis.Redis(port=server.port) as raw:
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) // 2)  # below what it holds: full
        code, findings = doctor("--url", f"kvpool://127.0.0.1:{server.port}/full?progress_timeout_s=1")
        [finding] = failed(findings, "redis-full")
        assert code == 1 and "maxmemory" in finding["detail"]
        raw.config_set("maxmemory", 0)
        assert not failed(doctor("--url", f"kvpool://127.0.0.1:{server.port}/full")[1], "redis-full")


# -- clock skew ------------------------------------------------------------------------------------
def test_clock_skew_of_a_node_is_named(pool, tmp_path):
    node = pool.start_node("skew", env=skewed_clock_env(tmp_path / "clock", 3 * 3600.0))
    try:
        code, findings = doctor("--url", pool.url("skew"))
        [finding] = failed(findings, "clock-skew")
        assert code == 1 and finding["check"] == f"node {node.node_id} clock" and "ahead of" in finding["detail"]
        assert [f for f in findings if not f["ok"]] == [finding]  # it serves: liveness never read that clock
    finally:
        node.terminate()


# -- TLS -------------------------------------------------------------------------------------------
def test_tls_name_mismatch_and_untrusted_certificate_are_named(tmp_path, redis_factory):
    ca, ca_cert, ca_key = _make_ca(tmp_path, "troubleshoot-ca")
    other_ca, _, _ = _make_ca(tmp_path, "unrelated-ca")
    cert, key = _make_leaf(tmp_path, "redis", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))], ca_cert, ca_key)
    server = EmbeddedRedis(tls=(cert, key, ca)).start()
    redis_factory.append(server)
    # The certificate names 127.0.0.1; the URL dials localhost.
    code, findings = doctor("--url", f"kvpool://localhost:{server.port}/t?tls=on&tls_ca={ca}&progress_timeout_s=1")
    [finding] = failed(findings, "tls-name-mismatch")
    assert code == 1 and "localhost" in finding["detail"]
    code, findings = doctor(
        "--url", f"kvpool://127.0.0.1:{server.port}/t?tls=on&tls_ca={other_ca}&progress_timeout_s=1"
    )
    assert code == 1 and failed(findings, "tls-certificate-not-trusted"), findings


# -- version mismatch ---------------------------------------------------------------------------------
OTHER_RELEASE = '''\
"""Test setting: this process is a kvpool of another release, whose handshake is one version on."""
import backend.handshake
backend.handshake.HANDSHAKE_VERSION += 1
'''


def test_version_mismatch_between_node_and_client_is_named(pool, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(OTHER_RELEASE)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    node = pool.start_node("ver", env={"PYTHONPATH": path})
    try:
        code, findings = doctor("--url", pool.url("ver"))
        [finding] = failed(findings, "version-mismatch")
        assert code == 1 and "handshake version" in finding["detail"] and finding["check"] == f"node {node.node_id}"
    finally:
        node.terminate()


# -- Redis unreachable or paused --------------------------------------------------------------------
def test_redis_unreachable_or_paused_is_named(redis_factory):
    code, findings = doctor("--url", f"kvpool://127.0.0.1:{free_port()}/x?progress_timeout_s=0.3")
    assert code == 1 and failed(findings, "redis-unreachable"), findings
    server = EmbeddedRedis().start()
    redis_factory.append(server)
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)
    try:
        code, findings = doctor("--url", f"kvpool://127.0.0.1:{server.port}/x?progress_timeout_s=0.3")
    finally:
        server.process.send_signal(signal.SIGCONT)
    assert code == 1 and failed(findings, "redis-paused-or-slow"), findings


# -- secret file unreadable ----------------------------------------------------------------------------
def test_secret_file_unreadable_is_named(pool, tmp_path):
    missing = tmp_path / "no-such-token"
    code, findings = doctor("--node", "--redis", pool.redis.url, "--token-file", str(missing), "--shm-dir", "off")
    [finding] = failed(findings, "secret-file-unreadable")
    assert code == 1 and finding["check"] == "--token-file" and str(missing) in finding["detail"]
    code, _, err = kvpool("lmcache-config", "--url", pool.url(token=False, token_file=str(missing)))
    assert code == 2 and "token_file: cannot read" in err  # the URL's own file: a usage error, nothing printed


# -- selftest ---------------------------------------------------------------------------------------
def test_selftest_puts_finds_gets_and_deletes_byte_identical_chunks_and_leaves_none(pool):
    from kvpool import PoolConfig, SyncPoolClient

    code, out, err = kvpool("selftest", pool.url(), "--chunks", "3", "--chunk-size", "64KiB")
    assert code == 0, out + err
    for step in ("Redis", "nodes", "put", "lookup", "get", "delete"):
        assert re.search(rf"^\[ok  \] {step}: ", out, re.M), (step, out)
    assert "3 of 3 byte-identical" in out
    with SyncPoolClient(PoolConfig.from_url(pool.url())) as client:
        assert not [k for k in client.list_keys() if k.startswith(SELFTEST_PREFIX)]
    code, out, _ = kvpool("selftest", pool.url(password=False), "--json")
    steps = {f["check"]: f for f in json.loads(out)}
    assert code == 1 and steps["Redis"]["cause"] == "wrong-redis-password"
    assert [steps[s]["state"] for s in ("put", "lookup", "get", "delete")] == ["skip"] * 4


# -- the messages as printed ---------------------------------------------------------------------------
_PLACEHOLDERS = ("...", "HOST", "PORT", "FILE")


def _printed_lines(anchor: str) -> list[re.Pattern[str]]:
    """The ``kvpool: error:`` lines entry ``anchor`` shows in its code blocks, as patterns its placeholders fill."""
    page = PAGE.read_text()
    title = next(line for line in page.splitlines() if line.startswith("## ") and _anchor(line[3:]) == anchor)
    entry = page.split(title + "\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in re.findall(r"```\n(.*?)\n```", entry, re.S) if line.startswith("kvpool: error:")]
    split = "(" + "|".join(re.escape(p) for p in _PLACEHOLDERS) + ")"
    return [
        re.compile("".join(".+?" if part in _PLACEHOLDERS else re.escape(part) for part in re.split(split, line)))
        for line in lines
    ]


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def test_the_redis_errors_verbs_print_are_the_lines_the_page_shows(pool, tmp_path, monkeypatch):
    wrong = tmp_path / "redis-password"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    refused, none_given = _printed_lines("wrong-redis-password")
    for url, shown in (
        (pool.url(password=False, redis_password_file=str(wrong)), refused),
        (pool.url(password=False), none_given),
    ):
        code, out, err = kvpool("status", "--url", url)
        assert code == 1 and out == "" and shown.fullmatch(err.rstrip("\n")), (shown.pattern, err)
        assert "not-the-password" not in err
    code, out, err = kvpool("status", "--url", pool.url(password=False, redis_password_file=str(wrong)), "--json")
    assert code == 1 and refused.fullmatch("kvpool: error: " + json.loads(out)["error"]), out

    down = f"kvpool://127.0.0.1:{free_port()}/x?progress_timeout_s=0.3"
    given, stale = _printed_lines("redis-unreachable")
    code, out, err = kvpool("ls", "--url", down)
    assert code == 1 and given.fullmatch(err.rstrip("\n")) and not stale.fullmatch(err.rstrip("\n")), err
    monkeypatch.setenv("KVPOOL_URL", down)
    code, out, err = kvpool("ls", "--json")
    assert code == 1 and stale.fullmatch(err.rstrip("\n")), (stale.pattern, err)
    assert json.loads(out) == {
        "error": err.rstrip("\n").removeprefix("kvpool: error: "),
        "type": "RedisUnreachableError",
        "exit_code": 1,
    }


def test_an_engine_whose_redis_refuses_the_password_starts_logs_once_and_misses(pool, stack_factory, caplog, tmp_path):
    """Redis's refusal is an AuthError now; the connector still starts, says why once, and reads misses."""
    from prometheus_client import REGISTRY

    wrong = tmp_path / "redis-password"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    caplog.set_level(logging.INFO)
    stack = stack_factory(pool.url(password=False, redis_password_file=str(wrong)))  # the engine starts

    def down() -> float | None:
        labels = {"plugin": "kvpool", "cause": "wrong-redis-password"}
        return REGISTRY.get_sample_value("kvpool_connector_pool_up", labels)

    assert wait_until(lambda: down() == 0, 10.0), down()
    keys = [stack.key(1), stack.key(2)]
    for _ in range(3):
        assert stack.contains_prefix(keys) == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("backend")]
    assert len(errors) == 1 and str(wrong) in errors[0] and "not-the-password" not in errors[0], errors
