"""No secret in any log: the pool token and the Redis password never appear in what kvpool or
LMCache write, in what the CLI prints, or in an error.

LMCache logs its whole configuration at INFO, pool URL included, so the configs that
``kvpool up`` and ``kvpool lmcache-config`` print carry no secret: the token and the
Redis password come from files (``token_file=``, ``redis_password_file=``) or the
environment. A real redis-server with an ACL user and password, a real node with a token,
LMCache's own storage stack built from what ``kvpool up`` printed, and every line of the run
scanned for both secrets.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from backend.embedded import EmbeddedRedis, free_port
from backend.lmcache.stack import LMCacheStack
from kvpool import ConfigError, PoolConfig
from tests.conftest import REPO
from tests.support.lmcache import same_bytes
from tests.support.up import UpProcess

TOKEN = "tok-5f1c9a0e7d2b" * 2
PASSWORD = "pw-8e3b61a4c7f0"
USER = "kvpool"
UP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def acl_redis(processes: None) -> Iterator[EmbeddedRedis]:
    """redis-server whose default user is off: only USER with PASSWORD gets in."""
    acl = ["--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all", "--user", "default", "off"]
    with EmbeddedRedis(args=acl) as server:
        yield server


@pytest.fixture
def secret_files(tmp_path: Path) -> tuple[Path, Path]:
    token_file, password_file = tmp_path / "token", tmp_path / "redis-password"
    token_file.write_text(TOKEN + "\n")
    password_file.write_text(PASSWORD + "\n")
    return token_file, password_file


def _kvpool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false", **(env or {})},
    )


def _everything(proc: subprocess.CompletedProcess[str]) -> str:
    """What a command printed (its arguments are what this test typed, secrets included on purpose)."""
    return f"$ kvpool {proc.args[3]} ...\n{proc.stdout}{proc.stderr}"


def test_no_secret_reaches_any_log_line_or_cli_output(acl_redis, secret_files, namespace, caplog, capfd):
    caplog.set_level(logging.DEBUG)  # every kvpool and LMCache record of this process, whatever its level
    token_file, password_file = secret_files
    seen: list[str] = []
    up = UpProcess(
        [
            "--redis",
            f"redis://{USER}@127.0.0.1:{acl_redis.port}/0",
            "--redis-password-file",
            str(password_file),
            "--token-file",
            str(token_file),
            "--namespace",
            namespace,
            "--dram",
            "64MiB",
            "--nvme",
            "0",
            "--shm-dir",
            "off",
        ]
    ).start({**os.environ, "LMCACHE_TRACK_USAGE": "false"})
    try:
        up.wait_ready(UP_TIMEOUT_S)
        printed, url = up.log, up.url
        assert f"token_file={token_file}" in url and f"redis_password_file={password_file}" in url
        # The engine runs LMCache from exactly what `kvpool up` printed (a smaller local buffer for the test).
        config = yaml.safe_load(printed.split("LMCache config (LMCACHE_CONFIG_FILE):\n", 1)[1].split("Ctrl-C")[0])
        config["max_local_cpu_size"] = 0.5
        stack = LMCacheStack(config)
        try:
            keys = [stack.key(i) for i in range(3)]
            objs = [stack.make_object(i) for i in range(3)]
            stack.put(keys, objs)
            got = stack.get(keys)
            try:  # hits prove both secrets were used: the node wants the token, Redis the password
                assert all(g is not None and same_bytes(g, o) for g, o in zip(got, objs))
            finally:
                stack.release(objs + got)
        finally:
            stack.close()

        inline = f"kvpool://:{TOKEN}@127.0.0.1:{acl_redis.port}/{namespace}?redis_user={USER}&redis_password={PASSWORD}"
        for fmt in (["--format", "yaml"], ["--format", "env"], ["--mode", "mp", "--format", "json"], ["--mode", "mp"]):
            out = _kvpool("lmcache-config", "--url", inline, *fmt)
            assert out.returncode == 0, out.stderr
            assert "token was left out" in out.stderr and "redis_password was left out" in out.stderr
            assert "KVPOOL_TOKEN" in out.stderr and "KVPOOL_REDIS_PASSWORD" in out.stderr
            seen.append(_everything(out))
        for verb in ("status", "nodes", "ls", "stats", "check"):
            out = _kvpool(verb, "--url", url)
            assert out.returncode == 0, (verb, out.stderr)
            seen.append(_everything(out))
            out = _kvpool(verb, "--url", inline)  # the same pool named with the secrets inline
            assert out.returncode == 0, (verb, out.stderr)
            seen.append(_everything(out))

        # Errors that name a URL: malformed Redis URLs of every form, an unreachable pool, a bad option.
        for bad in (
            f"redis+cluster://{USER}:{PASSWORD}@127.0.0.1:notaport",
            f"redis+sentinel://{USER}:{PASSWORD}@127.0.0.1:1",
            f"redis+cluster://{USER}:{PASSWORD}@127.0.0.1:1/db",
            f"rediss+cluster://{USER}:{PASSWORD}@127.0.0.1:1?x=y",
            f"http://{USER}:{PASSWORD}@127.0.0.1:1",
        ):
            out = _kvpool("node", "--redis", bad, "--dram", "1MiB")
            assert out.returncode == 2 and "--redis" in out.stderr, out.stderr
            seen.append(_everything(out))
        out = _kvpool(
            "node",
            "--redis",
            f"redis://{USER}:{PASSWORD}@127.0.0.1:{acl_redis.port}/0",
            "--dram",
            "1MiB",
            "--tls-cert",
            str(token_file),
            "--tls-key",
            str(token_file),
        )
        assert out.returncode == 2 and "rediss://" in out.stderr
        seen.append(_everything(out))
        out = _kvpool(
            "status",
            "--url",
            f"kvpool://:{TOKEN}@127.0.0.1:{free_port()}/x?redis_password={PASSWORD}&progress_timeout_s=0.3",
        )
        assert out.returncode == 1
        seen.append(_everything(out))
        for broken in (
            f"kvpool://:{TOKEN}@127.0.0.1:notaport/x?redis_password={PASSWORD}",
            f"redis://:{TOKEN}@127.0.0.1:1/x?redis_password={PASSWORD}",
            f"kvpool://{USER}:{TOKEN}@127.0.0.1:1/x",
        ):
            with pytest.raises(ConfigError) as error:
                PoolConfig.from_url(broken)
            seen.append(str(error.value))
        config_with_secrets = PoolConfig.from_url(inline)
        seen += [
            repr(config_with_secrets),
            str(config_with_secrets),
            config_with_secrets.to_url(with_token=False),
            config_with_secrets.redis_url,
        ]
    finally:
        up.interrupt()
    seen.append(up.log)
    captured = capfd.readouterr()
    seen += [captured.out, captured.err]
    seen += [record.getMessage() for record in caplog.records]
    everything = "\n".join(seen)
    assert "LMCache Configuration" in everything  # LMCache's config dump was among what was scanned
    assert "node" in up.log and "kvpool pool stopped." in up.log
    for secret in (TOKEN, PASSWORD):
        leaks = [line for line in everything.splitlines() if secret in line]
        assert leaks == [], f"{len(leaks)} lines carry a secret, e.g. {leaks[0][:300]!r}"


def test_the_connector_warns_once_and_masked_when_lmcaches_config_carries_a_secret(
    acl_redis, secret_files, node_factory, namespace, stack_factory, caplog
):
    """LMCache has logged the URL by then: the warning says so, without repeating the secret, once."""
    caplog.set_level(logging.WARNING)
    token_file, password_file = secret_files
    node_factory(
        "--token-file",
        str(token_file),
        "--redis-password-file",
        str(password_file),
        redis_url=f"redis://{USER}@127.0.0.1:{acl_redis.port}/0",
    )
    inline = f"kvpool://:{TOKEN}@127.0.0.1:{acl_redis.port}/{namespace}?redis_user={USER}&redis_password={PASSWORD}"
    for seed in (1, 2):  # two engines in one process: still one warning
        stack = stack_factory(inline)
        objs = [stack.make_object(seed)]
        stack.put([stack.key(seed)], objs)
        got = stack.get([stack.key(seed)])
        try:
            assert got[0] is not None and same_bytes(got[0], objs[0])  # the inline secrets still work
        finally:
            stack.release(objs + got)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("backend")]
    warnings = [m for m in ours if "carries the token and the redis_password inline" in m]
    assert len(warnings) == 1, ours
    assert "token_file=PATH" in warnings[0] and "KVPOOL_REDIS_PASSWORD" in warnings[0]
    assert not any(TOKEN in m or PASSWORD in m for m in ours)


def test_a_secret_from_a_file_never_appears_in_the_canonical_url(secret_files):
    token_file, password_file = secret_files
    config = PoolConfig.from_url(
        f"kvpool://127.0.0.1:6379/ns?token_file={token_file}&redis_password_file={password_file}&redis_user={USER}"
    )
    assert config.token == TOKEN and config.redis_password == PASSWORD
    url = config.to_url()
    assert TOKEN not in url and PASSWORD not in url and f"token_file={token_file}" in url
    assert PoolConfig.from_url(url) == config  # the files stand for the secrets
    assert PoolConfig.from_url("kvpool://127.0.0.1:6379/ns", {"KVPOOL_TOKEN_FILE": str(token_file)}).token == TOKEN
    with pytest.raises(ConfigError, match="token_file: cannot read"):
        PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?token_file={token_file}.missing")
    empty = token_file.with_name("empty")
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"redis_password_file: .* is empty"):
        PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?redis_password_file={empty}")


@pytest.mark.usefixtures("processes")
def test_lmcache_config_strips_inline_secrets_and_keeps_everything_else():
    out = _kvpool(
        "lmcache-config",
        "--url",
        f"kvpool://:{TOKEN}@10.0.0.1:6379/prod?replicas=2&redis_password={PASSWORD}&redis_user=u&progress_timeout_s=0.5",
        "--format",
        "env",
        "--offline",
    )
    assert out.returncode == 0, out.stderr
    extra = json.loads(re.search(r"LMCACHE_EXTRA_CONFIG='(.*)'", out.stdout).group(1))
    assert (
        extra["remote_storage_plugin.kvpool.url"]
        == "kvpool://10.0.0.1:6379/prod?replicas=2&redis_user=u&progress_timeout_s=0.5"
    )
    assert TOKEN not in out.stdout + out.stderr and PASSWORD not in out.stdout + out.stderr
