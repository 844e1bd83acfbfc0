"""Weak tokens and readable secret files: a short token is refused, a weak one or a readable file is named.

The attack: a 5-byte token in a world-readable file was accepted without a word, so
anyone on the host could read it, and anyone off it could guess it. Now a token shorter
than ``MIN_TOKEN_CHARS`` is refused wherever it comes from (a file, ``KVPOOL_TOKEN``, the
URL), by a client and by a node; one shorter than ``GOOD_TOKEN_CHARS`` is warned about,
and so is a secret file others can read (the token's and the Redis password's: one
reader, ``backend.config.values.read_secret_file``). What is promised:
docs/configuration.md, "Secrets".
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from backend.config import NodeConfig
from backend.config import values as config_values
from backend.config.values import GOOD_TOKEN_CHARS, MIN_TOKEN_CHARS
from kvpool import ConfigError, PoolConfig
from tests.support.cli import kvpool

GOOD_TOKEN = "9f" * 32  # what `openssl rand -hex 32` makes: 64 characters
WEAK_TOKEN = "w" * (GOOD_TOKEN_CHARS - 1)
SHORT_TOKEN = "t0k3n"  # 5 characters, as in the attack


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each warning is said once per process: every test here starts as a fresh process would."""
    monkeypatch.setattr(config_values, "_warned_secrets", set())


def _secret_file(tmp_path: Path, name: str, text: str, mode: int) -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- too short: refused -------------------------------------------------------------------
def test_a_five_character_world_readable_token_file_is_refused_by_a_client_naming_the_minimum(tmp_path):
    path = _secret_file(tmp_path, "token", SHORT_TOKEN, 0o644)
    with pytest.raises(ConfigError) as refused:
        PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?token_file={path}")
    message = str(refused.value)
    assert refused.value.key == "token_file" and str(path) in message
    assert f"is {len(SHORT_TOKEN)} characters; at least {MIN_TOKEN_CHARS} are required" in message
    assert "openssl rand -hex 32" in message
    assert SHORT_TOKEN not in message


@pytest.mark.parametrize("where", ["url", "env"])
def test_a_short_token_from_the_url_or_the_environment_is_refused_by_a_client(where):
    url, environ = "kvpool://127.0.0.1:6379/ns", {}
    if where == "url":
        url = f"kvpool://:{SHORT_TOKEN}@127.0.0.1:6379/ns"
    else:
        environ = {"KVPOOL_TOKEN": SHORT_TOKEN}
    with pytest.raises(ConfigError, match=f"at least {MIN_TOKEN_CHARS} are required") as refused:
        PoolConfig.from_url(url, environ)
    assert SHORT_TOKEN not in str(refused.value)


@pytest.mark.usefixtures("processes")
def test_a_node_refuses_to_start_with_a_short_token_from_a_file_or_the_environment(tmp_path, redis_server):
    path = _secret_file(tmp_path, "token", SHORT_TOKEN, 0o600)
    base = ["node", "--redis", redis_server.url, "--namespace", "short-token", "--dram", "16MiB"]
    for args, env in ((["--token-file", str(path)], {}), ([], {"KVPOOL_TOKEN": SHORT_TOKEN})):
        out = kvpool(*base, *args, env={"KVPOOL_PREFAULT": "off", **env}, timeout=60)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"at least {MIN_TOKEN_CHARS} are required" in out.stderr and "openssl rand -hex 32" in out.stderr
        assert "ready at" not in out.stdout and SHORT_TOKEN not in out.stdout + out.stderr
    with pytest.raises(ConfigError, match="--token-file"):
        NodeConfig.from_sources({"redis": redis_server.url, "token_file": str(path)}, environ={})


def test_the_minimum_length_is_accepted(caplog):
    token = "m" * MIN_TOKEN_CHARS
    assert PoolConfig.from_url(f"kvpool://:{token}@127.0.0.1:6379/ns").token == token
    assert NodeConfig.from_sources({"redis": "redis://r:1"}, environ={"KVPOOL_TOKEN": token}).token == token


# -- weak: warned about -------------------------------------------------------------------
def test_a_weak_token_is_accepted_with_one_warning_naming_the_recommended_length(tmp_path, caplog):
    path = _secret_file(tmp_path, "token", WEAK_TOKEN, 0o600)
    with caplog.at_level(logging.WARNING, logger="backend.config"):
        for _ in range(3):  # configs are rebuilt often (dataclasses.replace): said once
            assert PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?token_file={path}").token == WEAK_TOKEN
        config = NodeConfig.from_sources({"redis": "redis://r:1"}, environ={"KVPOOL_TOKEN": WEAK_TOKEN})
        assert config.token == WEAK_TOKEN
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings  # the file's, and the node's KVPOOL_TOKEN
    assert all(f"{GOOD_TOKEN_CHARS} or more are recommended" in w and "openssl rand -hex 32" in w for w in warnings)
    assert str(path) in warnings[0] and "KVPOOL_TOKEN" in warnings[1]
    assert not any(WEAK_TOKEN in w for w in warnings)


def test_a_good_token_in_a_private_file_is_read_without_a_word(tmp_path, caplog):
    path = _secret_file(tmp_path, "token", GOOD_TOKEN, 0o600)
    with caplog.at_level(logging.WARNING, logger="backend.config"):
        assert PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?token_file={path}").token == GOOD_TOKEN
        assert (
            NodeConfig.from_sources({"redis": "redis://r:1", "token_file": str(path)}, environ={}).token == GOOD_TOKEN
        )
    assert _warnings(caplog) == []


# -- readable by others: warned about -----------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "who"), [(0o644, "every user of this host"), (0o640, "its group")], ids=["world", "group"]
)
def test_a_token_file_others_can_read_is_warned_about_naming_the_file_and_chmod_600(tmp_path, caplog, mode, who):
    path = _secret_file(tmp_path, "token", GOOD_TOKEN, mode)
    with caplog.at_level(logging.WARNING, logger="backend.config"):
        PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?token_file={path}")
        PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?token_file={path}")
    [warning] = _warnings(caplog)
    assert f"token_file: {path} is readable by {who} (mode {mode:04o})" in warning
    assert f"chmod 600 {path}" in warning and GOOD_TOKEN not in warning


def test_a_node_names_a_readable_token_file_in_its_log(tmp_path, node_factory):
    token = _secret_file(tmp_path, "token", GOOD_TOKEN, 0o604)
    node = node_factory("--token-file", str(token))
    assert f"--token-file: {token} is readable by every user of this host (mode 0604)" in node.log
    assert f"chmod 600 {token}" in node.log and GOOD_TOKEN not in node.log
    os.chmod(token, stat.S_IRUSR | stat.S_IWUSR)
    quiet = node_factory("--token-file", str(token))
    assert "is readable by" not in quiet.log


def test_a_readable_redis_password_file_is_warned_about_the_same_way(tmp_path, caplog):
    password = _secret_file(tmp_path, "redis-password", "pw-" + "1" * 20, 0o644)
    with caplog.at_level(logging.WARNING, logger="backend.config"):
        config = NodeConfig.from_sources({"redis": "redis://r:1", "redis_password_file": str(password)}, environ={})
        PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?redis_password_file={password}")
    assert config.redis_password == "pw-" + "1" * 20
    warnings = _warnings(caplog)
    assert warnings == [
        f"--redis-password-file: {password} is readable by every user of this host (mode 0644): whoever reads it "
        f"holds the secret; run `chmod 600 {password}`"
    ]  # once per file, whichever reads it first


def test_a_file_of_another_owner_read_through_its_group_is_not_warned_about(tmp_path, caplog, monkeypatch):
    """A Kubernetes secret volume (root's file, mode 0440, the pod's fsGroup) is read through the group."""
    path = _secret_file(tmp_path, "token", GOOD_TOKEN, 0o440)
    monkeypatch.setattr(config_values.os, "getuid", lambda: os.stat(path).st_uid + 1)  # as if root owned it
    with caplog.at_level(logging.WARNING, logger="backend.config"):
        assert PoolConfig.from_url(f"kvpool://127.0.0.1:6379/ns?token_file={path}").token == GOOD_TOKEN
    assert _warnings(caplog) == []
