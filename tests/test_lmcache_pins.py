"""Pinning a prompt by its token ids through the LMCache connector (docs/fleet.md, "Pinning a system prompt").

A real LMCache storage stack (``load_engine_config_with_overrides`` + ``CreateStorageBackends``)
stores a prompt's chunks under the keys LMCache's own ``ChunkedTokenDatabase`` makes; the
connector pins the prompt by its tokens; pressure through the same stack evicts everything
else and the prompt's chunks still hit, byte for byte; once unpinned, they go like the rest.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from backend import admin
from backend.cli.exits import EXIT_USAGE
from backend.errors import ConfigError, KVPoolError
from backend.tenants import scoped
from bench.lmcache_stack import kvpool_lmcache_config
from kvpool import PoolClient, PoolConfig
from tests.support.cli import kvpool

CHUNK_TOKENS = 16  # the test engine's LMCache chunk_size: chunks of 8 KiB (2 layers, 2 heads of 64, bf16)
ENGINE = {"num_layers": 2, "hidden": (2, 32)}


def _tokens(first: int, chunks: int) -> list[int]:
    return list(range(first, first + chunks * CHUNK_TOKENS))


def _lmcache_keys(stack: Any, tokens: list[int]) -> list[Any]:
    """The prompt's keys as LMCache's engine makes them (independently of the code under test)."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    return [key for _start, _end, key in ChunkedTokenDatabase(stack.config, stack.metadata).process_tokens(tokens)]


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
    with pytest.raises(KVPoolError, match="over this node's cap"):
        conn.pin_prompt_sync(_tokens(7, 1), ttl_s=10**7)  # over the node's --pin-ttl-max-s


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
