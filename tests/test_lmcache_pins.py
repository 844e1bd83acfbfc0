"""Pinning a prompt by its token ids through the LMCache connector (docs/fleet.md, "Pinning a system prompt").

A real LMCache storage stack (``load_engine_config_with_overrides`` + ``CreateStorageBackends``)
stores a prompt's chunks under the keys LMCache's own ``ChunkedTokenDatabase`` makes; the
connector pins the prompt by its tokens; pressure through the same stack evicts everything
else and the prompt's chunks still hit, byte for byte; once unpinned, they go like the rest.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from backend import admin
from backend.cli.exits import EXIT_USAGE
from backend.errors import ConfigError
from backend.lmcache.stack import kvpool_lmcache_config
from backend.tenants import scoped
from kvpool import PoolClient, PoolConfig
from tests.support.cli import kvpool

CHUNK_TOKENS = 16  # the test engine's LMCache chunk_size: chunks of 8 KiB (2 layers, 2 heads of 64, bf16)
ENGINE = {"num_layers": 2, "hidden": (2, 32)}
TAG = "tenant"  # tenant_tag=tenant: a request's kv_transfer_params {"lmcache.tag.tenant": NAME} names its tenant
POOL_TOKEN = "pool-token-" + "a1" * 16
ALICE_TOKEN = "alice-token-" + "b2" * 16


def _tokens(first: int, chunks: int) -> list[int]:
    return list(range(first, first + chunks * CHUNK_TOKENS))


def _lmcache_keys(stack: Any, tokens: list[int]) -> list[Any]:
    """The prompt's keys as LMCache's engine makes them (independently of the code under test)."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    return [key for _start, _end, key in ChunkedTokenDatabase(stack.config, stack.metadata).process_tokens(tokens)]


def _tagged_keys(stack: Any, tokens: list[int], tenant: str) -> list[Any]:
    """The prompt's keys of a request whose tag names ``tenant``, as LMCache's engine makes them (the tag rides in
    each key: ``...@tenant%NAME``)."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    database = ChunkedTokenDatabase(stack.config, stack.metadata)
    return [key for _s, _e, key in database.process_tokens(tokens, request_configs={f"lmcache.tag.{TAG}": tenant})]


def _secret(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return path


def _store(stack: Any, keys: list[Any], seed: int) -> None:
    objs = [stack.make_object(seed + i) for i in range(len(keys))]
    try:
        stack.put(keys, objs)
    finally:
        stack.release(objs)


def _pressure(stack: Any, first: int) -> list[Any]:
    """Twice the node's 1 MiB of DRAM in chunks of other prompts, 8 at a time; the keys of the first 8."""
    batches = [_lmcache_keys(stack, _tokens(first + b * 10_000, 8)) for b in range(24)]
    for b, keys in enumerate(batches):
        _store(stack, keys, 1000 + b * 8)
    return batches[0]


def _engine(stack_factory: Any, url: str) -> Any:
    return stack_factory(url, engine=ENGINE, chunk_size=CHUNK_TOKENS)


def test_a_prompt_pinned_by_its_tokens_survives_pressure_that_evicts_everything_else(
    node_factory, pool_url, stack_factory
):
    node_factory(dram="1MiB")
    stack = _engine(stack_factory, pool_url)
    system = _tokens(1000, 4)
    keys = _lmcache_keys(stack, system)
    _store(stack, keys, 0)
    other = _lmcache_keys(stack, _tokens(5000, 2))
    _store(stack, other, 100)
    conn = stack.connector()

    asked = system + _tokens(9000, 2)  # the system prompt, then a question the pool never saw
    report = conn.pin_prompt_sync(asked, ttl_s=60, owner="sysprompt")
    assert (report.chunks, report.pinned_chunks, report.keys, report.copies, len(report.nodes)) == (6, 4, 4, 4, 1)
    assert report.ttl_s == 60.0

    first_pressed = _pressure(stack, 100_000)
    assert stack.contains_prefix(other) == 0 and stack.contains_prefix(first_pressed) == 0  # pressure evicted
    assert stack.contains_prefix(keys) == 4
    got = stack.get(keys)
    try:
        for i, obj in enumerate(got):
            assert obj is not None and bool((obj.tensor == stack.expected_tensor(i)).all())
    finally:
        stack.release(got)

    unpinned = conn.unpin_prompt_sync(asked, owner="sysprompt")
    assert unpinned.unpinned == 4 and len(unpinned.not_pinned) == 2  # the question's chunks were never pinned
    _pressure(stack, 500_000)
    assert stack.contains_prefix(keys) == 0


async def test_a_tenants_connector_pins_the_tenants_own_keys_of_the_prompt(node_factory, pool_url, stack_factory):
    node_factory(dram="1MiB")
    stack = _engine(stack_factory, pool_url + "?tenant=acme")
    prompt = _tokens(1000, 2)
    keys = _lmcache_keys(stack, prompt)
    _store(stack, keys, 0)
    report = stack.connector().pin_prompt_sync(prompt, owner="acme-sys")
    assert (report.chunks, report.pinned_chunks) == (2, 2)
    async with PoolClient(PoolConfig.from_url(pool_url)) as operator:
        pinned = sorted(row.pin.key for row in await admin.list_pins(operator, owner="acme-sys"))
    assert pinned == sorted(scoped("acme", key.to_string()) for key in keys)


def test_a_prompt_of_a_tenant_named_by_tag_pinned_for_that_tenant_survives_pressure_that_evicts_everything_else(
    node_factory, pool_url, stack_factory
):
    node_factory(dram="1MiB")
    stack = _engine(stack_factory, f"{pool_url}?tenant_tag={TAG}")  # one engine, each request's tag its tenant
    system = _tokens(1000, 4)
    alices = _tagged_keys(stack, system, "alice")
    bobs = _tagged_keys(stack, system, "bob")  # the same prompt, bob's: the same hashes, another tenant's chunks
    _store(stack, alices, 0)
    _store(stack, bobs, 0)
    conn = stack.connector()
    with pytest.raises(ConfigError, match="none of the prompt's 4 chunks"):
        conn.pin_prompt_sync(system)  # no tenant named: the URL names none, and no tenant's chunks are held

    report = conn.pin_prompt_sync(system, ttl_s=60, owner="sysprompt", tenant="alice")
    assert (report.chunks, report.pinned_chunks, report.keys, report.copies) == (4, 4, 4, 4)
    assert _pins(pool_url, "sysprompt") == sorted(
        scoped("alice", key.to_string()) for key in _lmcache_keys(stack, system)
    )

    _pressure(stack, 100_000)
    assert stack.contains_prefix(bobs) == 0  # bob's copy of the prompt went with the rest
    assert stack.contains_prefix(alices) == 4
    got = stack.get(alices)
    try:
        for i, obj in enumerate(got):
            assert obj is not None and bool((obj.tensor == stack.expected_tensor(i)).all())
    finally:
        stack.release(got)

    assert conn.unpin_prompt_sync(system, owner="sysprompt", tenant="alice").unpinned == 4
    _pressure(stack, 500_000)
    assert stack.contains_prefix(alices) == 0


def _pins(pool_url: str, owner: str, env: dict[str, str] | None = None) -> list[str]:
    """The keys ``owner`` pins on the live nodes, as an operator lists them."""

    async def listed() -> list[str]:
        async with PoolClient(PoolConfig.from_url(pool_url, env)) as operator:
            return sorted(row.pin.key for row in await admin.list_pins(operator, owner=owner))

    return asyncio.run(listed())


def test_a_prompts_tenant_is_refused_naming_it_when_it_is_no_tenant_or_not_the_urls_under_a_tenants_token(
    node_factory, pool_url, stack_factory, tmp_path
):
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    _secret(tenants / "alice", ALICE_TOKEN)
    node_factory("--token-file", str(_secret(tmp_path / "pool", POOL_TOKEN)), "--tenant-tokens", str(tenants))
    alice_token = _secret(tmp_path / "alice-token", ALICE_TOKEN)
    # An engine serving alice by tag with alice's token (the URL names her, as her engines' URLs do).
    engine = _engine(stack_factory, f"{pool_url}?tenant_tag={TAG}&tenant=alice&token_file={alice_token}")
    prompt = _tokens(2000, 2)
    _store(engine, _tagged_keys(engine, prompt, "alice"), 0)
    conn = engine.connector()
    for bad in ("a/b", "x" * 65, ""):
        with pytest.raises(ConfigError, match=r"^tenant: tenant .* must be 1-64 characters"):
            conn.pin_prompt_sync(prompt, tenant=bad)
    with pytest.raises(
        ConfigError, match=r"^tenant: this client's connections proved tenant alice's token: .* not tenant bob's"
    ):
        conn.pin_prompt_sync(prompt, tenant="bob", owner="tried")
    with pytest.raises(ConfigError, match="proved tenant alice's token"):
        conn.unpin_prompt_sync(prompt, tenant="bob", owner="tried")
    pool_env = {"KVPOOL_TOKEN": POOL_TOKEN}
    assert _pins(pool_url, "tried", pool_env) == []  # nothing pinned
    assert conn.pin_prompt_sync(prompt, tenant="alice", owner="mine").pinned_chunks == 2  # the URL's tenant: hers
    assert conn.pin_prompt_sync(prompt, owner="mine").pinned_chunks == 2  # none named: the URL's, alice
    assert len(_pins(pool_url, "mine", pool_env)) == 2

    # A connector whose URL names its tenant (no tag) pins that tenant's chunks only: its client scopes every key.
    carols = _engine(stack_factory, f"{pool_url}?tenant=carol&token_file={_secret(tmp_path / 'pool2', POOL_TOKEN)}")
    with pytest.raises(ConfigError, match=r"^tenant: this client is tenant carol's .* cannot pin tenant alice's"):
        carols.connector().pin_prompt_sync(prompt, tenant="alice")


def test_pinning_a_prompt_the_pool_does_not_hold_is_refused_naming_the_tokens(node_factory, pool_url, stack_factory):
    node_factory(dram="1MiB")
    stack = _engine(stack_factory, pool_url)
    conn = stack.connector()
    with pytest.raises(ConfigError, match="none of the prompt's 3 chunks"):
        conn.pin_prompt_sync(_tokens(7, 3))
    with pytest.raises(ConfigError, match="no chunk with a key"):
        conn.pin_prompt_sync(list(range(CHUNK_TOKENS - 1)))  # under one chunk: LMCache keys none
    keys = _lmcache_keys(stack, _tokens(7, 1))
    _store(stack, keys, 0)
    with pytest.raises(ConfigError, match=r"--ttl: node .* ttl_s 1e\+07 s is over this node's cap of 86400 s"):
        conn.pin_prompt_sync(_tokens(7, 1), ttl_s=10**7)  # over the node's --pin-ttl-max-s: bad input, nothing pinned
    assert conn.pin_prompt_sync(_tokens(7, 1), ttl_s=60).pinned_chunks == 1  # and the connector goes on


def test_kvpool_pin_tokens_file_pins_the_prompt_an_engine_of_that_lmcache_config_stored(
    node_factory, pool_url, stack_factory, tmp_path
):
    node_factory(dram="1MiB")
    stack = _engine(stack_factory, pool_url)
    prompt = _tokens(3000, 3)
    keys = _lmcache_keys(stack, prompt)
    _store(stack, keys, 0)
    config = tmp_path / "lmcache.yaml"
    engine_config = {**kvpool_lmcache_config(pool_url + "?token=never-printed-secret"), "chunk_size": CHUNK_TOKENS}
    config.write_text(yaml.safe_dump(engine_config))  # its pool URL is the engine's: the CLI pins over --url
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(prompt + _tokens(70_000, 1)))  # then a chunk the pool never saw
    engine = ("--tokens-file", str(tokens), "--lmcache-config", str(config), "--model", stack.model)

    pinned = kvpool("pin", *engine, "--url", pool_url, "--owner", "cli", "--ttl", "60")
    assert pinned.returncode == 0, pinned.stderr
    assert "never-printed-secret" not in pinned.stderr  # LMCache logs the config it loads: kept quiet
    assert "worker 0: pinned 3 of the prompt's 4 chunks (3 keys, 3 copies on 1 nodes) for owner cli" in pinned.stdout
    listed = kvpool("pins", "--url", pool_url, "--owner", "cli", "--json")
    assert sorted(row["key"] for row in json.loads(listed.stdout)) == sorted(key.to_string() for key in keys)

    assert kvpool("unpin", *engine, "--url", pool_url, "--owner", "cli").stdout.startswith("unpinned 3 keys")
    again = kvpool("unpin", *engine, "--url", pool_url, "--owner", "cli")
    assert (
        again.returncode == EXIT_USAGE and "--tokens-file: owner cli pins none of this prompt's chunks" in again.stderr
    )
    wrong_dtype = kvpool("pin", *engine, "--kv-dtype", "float17", "--url", pool_url)
    assert wrong_dtype.returncode == EXIT_USAGE and "--kv-dtype: 'float17' is none of LMCache's" in wrong_dtype.stderr
    no_model = kvpool("pin", "--tokens-file", str(tokens), "--lmcache-config", str(config), "--url", pool_url)
    assert no_model.returncode != 0 and "--model" in no_model.stderr


def test_kvpool_pin_tokens_file_with_tenant_pins_that_tenants_chunks_of_an_engine_naming_tenants_by_tag(
    node_factory, pool_url, stack_factory, tmp_path
):
    node_factory(dram="1MiB")
    stack = _engine(stack_factory, f"{pool_url}?tenant_tag={TAG}")
    prompt = _tokens(4000, 3)
    _store(stack, _tagged_keys(stack, prompt, "alice"), 0)
    config = tmp_path / "lmcache.yaml"
    config.write_text(
        yaml.safe_dump({**kvpool_lmcache_config(f"{pool_url}?tenant_tag={TAG}"), "chunk_size": CHUNK_TOKENS})
    )
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(prompt))
    engine = ("--tokens-file", str(tokens), "--lmcache-config", str(config), "--model", stack.model)

    refused = kvpool("pin", *engine, "--url", pool_url)  # no tenant named: no tenant's chunks, and there are none
    assert refused.returncode == EXIT_USAGE and "none of the prompt's 3 chunks" in refused.stderr
    pinned = kvpool("pin", *engine, "--tenant", "alice", "--url", pool_url, "--owner", "cli")
    assert pinned.returncode == 0, pinned.stderr
    assert "worker 0: pinned 3 of the prompt's 3 chunks" in pinned.stdout
    assert _pins(pool_url, "cli") == sorted(scoped("alice", key.to_string()) for key in _lmcache_keys(stack, prompt))
    unpinned = kvpool("unpin", *engine, "--tenant", "alice", "--url", pool_url, "--owner", "cli")
    assert unpinned.stdout.startswith("unpinned 3 keys") and _pins(pool_url, "cli") == []

    bad = kvpool("pin", *engine, "--tenant", "a/b", "--url", pool_url)
    assert bad.returncode == EXIT_USAGE and "--tenant: tenant 'a/b' must be 1-64 characters" in bad.stderr
    keys = kvpool("pin", scoped("alice", "k"), "--tenant", "alice", "--url", pool_url)
    assert keys.returncode == EXIT_USAGE and "--tenant: names the tenant of a prompt's chunks" in keys.stderr


def test_a_tokens_file_is_a_json_list_or_integers_and_anything_else_is_refused_naming_it(tmp_path):
    from backend.lmcache.prompts import read_tokens

    given = tmp_path / "prompt"
    for text, tokens in (("[1, 2, 3]", [1, 2, 3]), ("4 5\n6", [4, 5, 6]), ("7,8", [7, 8])):
        given.write_text(text)
        assert read_tokens(given) == tokens
    for text, said in (("[1, 2, x]", "'x' is not a token id"), ("", "holds no token ids"), ("1 -2", "a negative id")):
        given.write_text(text)
        with pytest.raises(ConfigError, match=f"--tokens-file: {given}.*{said}"):
            read_tokens(given)
    with pytest.raises(ConfigError, match=r"--tokens-file: .* cannot be read"):
        read_tokens(tmp_path / "absent")
