"""PoolConfig: the kvpool:// URL, KVPOOL_* overrides, the YAML form, sizes, masking, LMCache's remote_url form."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from backend.config import DEFAULT_NAMESPACE, PoolConfig, format_size, mask_secrets, parse_size, without_inline_secrets
from backend.errors import ConfigError, KVPoolError
from backend.lmcache.config import lmcache_remote_url, remote_url_pool_config

GiB = 1024**3
MiB = 1024**2


# -- the URL --------------------------------------------------------------------------


def test_from_url_reads_host_port_namespace_token_and_options() -> None:
    config = PoolConfig.from_url(
        "kvpool://:s3cret-5b8e1f0c9d2a4e67@redis.example:6380/team-a?replicas=2&connect_timeout_s=0.5"
        "&progress_timeout_s=0.75&connections_per_node=4&nccl=on&cluster=rack_1&tls=off"
    )

    assert config.redis_host == "redis.example"
    assert config.redis_port == 6380
    assert config.namespace == "team-a"
    assert config.token == "s3cret-5b8e1f0c9d2a4e67"
    assert config.replicas == 2
    assert (config.connect_timeout_s, config.progress_timeout_s) == (0.5, 0.75)
    assert config.connections_per_node == 4
    assert config.nccl is True
    assert config.cluster == "rack_1"
    assert config.tls is False


def test_from_url_without_options_gives_the_documented_defaults() -> None:
    config = PoolConfig.from_url("kvpool://127.0.0.1:6379/ns")

    assert (config.replicas, config.connections_per_node) == (1, 2)
    assert (config.connect_timeout_s, config.progress_timeout_s, config.pair_timeout_s) == (2.0, 2.0, 30.0)
    assert (config.nccl, config.cluster, config.tls, config.token) == (False, "", False, "")


@pytest.mark.parametrize("url", ["kvpool://h:6379", "kvpool://h:6379/"])
def test_from_url_without_a_path_uses_the_default_namespace(url: str) -> None:
    assert PoolConfig.from_url(url).namespace == DEFAULT_NAMESPACE == "default"


def test_from_url_percent_decodes_the_token() -> None:
    assert PoolConfig.from_url("kvpool://:a%40b%3Ac%2Fd-0123456789@h:1/ns").token == "a@b:c/d-0123456789"


def test_from_url_ignores_surrounding_whitespace() -> None:
    assert PoolConfig.from_url("  kvpool://h:1/ns \n").namespace == "ns"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("on", True),
        ("ON", True),
        ("true", True),
        ("1", True),
        ("yes", True),
        ("off", False),
        ("Off", False),
        ("false", False),
        ("0", False),
        ("no", False),
    ],
)
def test_bool_options_accept_every_documented_spelling(text: str, expected: bool) -> None:
    assert PoolConfig.from_url(f"kvpool://h:1/ns?nccl={text}").nccl is expected


def test_touch_is_auto_by_default_takes_on_off_in_every_spelling_and_refuses_anything_else() -> None:
    assert PoolConfig.from_url("kvpool://h:1/ns").touch == "auto"
    assert PoolConfig.from_url("kvpool://h:1/ns").to_url() == "kvpool://h:1/ns"  # the default is not written out
    for text, mode in (("auto", "auto"), ("AUTO", "auto"), ("on", "on"), ("yes", "on"), ("off", "off"), ("0", "off")):
        config = PoolConfig.from_url(f"kvpool://h:1/ns?touch={text}")
        assert config.touch == mode, text
        assert PoolConfig.from_url(config.to_url()).touch == mode
    with pytest.raises(ConfigError, match="touch: 'sometimes' is not auto, on or off"):
        PoolConfig.from_url("kvpool://h:1/ns?touch=sometimes")


@pytest.mark.parametrize(
    ("option", "low", "high"),
    [("replicas", 1, 8), ("connections_per_node", 1, 64)],
)
def test_int_options_accept_both_ends_of_their_range(option: str, low: int, high: int) -> None:
    assert getattr(PoolConfig.from_url(f"kvpool://h:1/ns?{option}={low}"), option) == low
    assert getattr(PoolConfig.from_url(f"kvpool://h:1/ns?{option}={high}"), option) == high


@pytest.mark.parametrize("option", ["connect_timeout_s", "progress_timeout_s", "pair_timeout_s"])
def test_durations_are_seconds_from_a_millisecond_to_ten_minutes(option: str) -> None:
    assert getattr(PoolConfig.from_url(f"kvpool://h:1/ns?{option}=0.001"), option) == 0.001
    assert getattr(PoolConfig.from_url(f"kvpool://h:1/ns?{option}=1.5"), option) == 1.5
    assert getattr(PoolConfig.from_url(f"kvpool://h:1/ns?{option}=600"), option) == 600.0


# -- names of before 0.1: refused, naming the new ones ---------------------------------


@pytest.mark.parametrize(
    ("query", "new"),
    [
        (
            "timeout_ms=500",
            "did you mean connect_timeout_s and progress_timeout_s? (timeout_ms was its name before 0.1",
        ),
        ("pair_timeout_ms=30000", "did you mean pair_timeout_s? (pair_timeout_ms was its name before 0.1"),
    ],
)
def test_an_old_url_key_is_an_unknown_option_whose_error_names_the_new_one(query: str, new: str) -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url(f"kvpool://h:1/ns?{query}")

    assert caught.value.key == query.split("=")[0]
    assert "unknown option in the URL; " + new in str(caught.value)
    assert "in milliseconds: give seconds" in str(caught.value)


def test_an_old_key_in_the_yaml_form_is_refused_naming_the_new_one() -> None:
    with pytest.raises(
        ConfigError, match=r"pair_timeout_ms: unknown option in the config; did you mean pair_timeout_s\?"
    ):
        PoolConfig.from_mapping({"url": "kvpool://h:1/ns", "pair_timeout_ms": 5000})


def test_an_old_variable_is_refused_naming_the_new_ones_where_an_unknown_one_is_only_warned_about(
    caplog, monkeypatch
) -> None:
    from backend.config import NodeConfig, pool

    monkeypatch.setattr(pool, "_warned_env", set())  # each is warned about once per process
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url("kvpool://h:1/ns", {"KVPOOL_TIMEOUT_MS": "250"})
    assert caught.value.key == "KVPOOL_TIMEOUT_MS"
    assert "did you mean KVPOOL_CONNECT_TIMEOUT_S and KVPOOL_PROGRESS_TIMEOUT_S?" in str(caught.value)
    with pytest.raises(ConfigError, match="did you mean KVPOOL_PAIR_TIMEOUT_S"):
        NodeConfig.from_sources({"redis": "redis://r:1"}, environ={"KVPOOL_PAIR_TIMEOUT_MS": "1000"})

    with caplog.at_level("WARNING", logger="backend.config"):
        config = PoolConfig.from_url("kvpool://h:1/ns", {"KVPOOL_REPLICA": "2", "KVPOOL_REPLICAS": "3"})
    assert config.replicas == 3
    assert any(
        r.getMessage().startswith(
            "KVPOOL_REPLICA: unknown kvpool environment variable, ignored; did you mean KVPOOL_REPLICAS? known: "
        )
        for r in caplog.records
    )


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("kvpool://h:1/ns?replica=2", "replica: unknown option in the URL; did you mean replicas? known: replicas, "),
        ("kvpool://h:1/ns?progress_timeout=2", "did you mean progress_timeout_s?"),
        ("kvpool://h:1/ns?bogus=1", "bogus: unknown option in the URL; known: replicas, "),  # nothing close
    ],
)
def test_an_unknown_url_key_names_the_close_one(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url(url)
    assert fragment in str(caught.value)


def test_redis_url_points_at_db_0_and_never_carries_the_token() -> None:
    config = PoolConfig.from_url("kvpool://:s3cret-5b8e1f0c9d2a4e67@redis.example:6380/ns")

    assert config.redis_url == "redis://redis.example:6380/0"
    assert "s3cret-5b8e1f0c9d2a4e67" not in config.redis_url


# -- bad URLs and options: ConfigError names the offending part -------------------------


@pytest.mark.parametrize(
    ("url", "key", "fragment"),
    [
        ("", "url", "empty pool URL"),
        ("   ", "url", "empty pool URL"),
        ("redis://h:6379/ns", "url", "scheme 'redis' is not kvpool://"),
        ("//h:6379/ns", "url", "scheme '(none)'"),
        ("kvpool://:6379/ns", "url", "missing Redis host"),
        ("kvpool://h/ns", "url", "missing Redis port"),
        ("kvpool://h:abc/ns", "url", "port is not a number"),
        ("kvpool://[::1/default", "url", "malformed URL kvpool://[::1/default: an unclosed '['"),
        ("kvpool://:s3cret-5b8e1f0c9d2a4e67@[::1/default", "url", "malformed URL kvpool://:***@[::1/default"),
        ("kvpool://h:0/ns", "url", "Redis port 0 is out of range"),
        ("kvpool://user:tok@h:6379/ns", "url", "user names are not supported"),
        ("kvpool://user@h:6379/ns", "url", "user names are not supported"),
        ("kvpool://h:6379/ns#part", "url", "unexpected fragment '#part'"),
        ("kvpool://h:6379/ns?bogus=1", "bogus", "unknown option in the URL"),
        ("kvpool://h:6379/ns?replicas=1&replicas=2", "replicas", "given twice"),
        ("kvpool://h:6379/ns?replicas=0", "replicas", "0 is out of range [1, 8]"),
        ("kvpool://h:6379/ns?replicas=9", "replicas", "9 is out of range [1, 8]"),
        ("kvpool://h:6379/ns?replicas=two", "replicas", "'two' is not an integer"),
        ("kvpool://h:6379/ns?replicas=", "replicas", "'' is not an integer"),
        ("kvpool://h:6379/ns?progress_timeout_s=0", "progress_timeout_s", "out of range [0.001, 600] seconds"),
        ("kvpool://h:6379/ns?connect_timeout_s=600.5", "connect_timeout_s", "out of range [0.001, 600] seconds"),
        ("kvpool://h:6379/ns?pair_timeout_s=nan", "pair_timeout_s", "out of range [0.001, 600] seconds"),
        ("kvpool://h:6379/ns?progress_timeout_s=2s", "progress_timeout_s", "'2s' is not a number of seconds"),
        ("kvpool://h:6379/ns?connections_per_node=0", "connections_per_node", "out of range [1, 64]"),
        ("kvpool://h:6379/ns?connections_per_node=65", "connections_per_node", "out of range [1, 64]"),
        ("kvpool://h:6379/ns?nccl=maybe", "nccl", "'maybe' is not on/off"),
        ("kvpool://h:6379/ns?nccl", "nccl", "'' is not on/off"),
        ("kvpool://h:6379/ns?tls=banana", "tls", "'banana' is not on/off"),
        ("kvpool://h:6379/bad%20ns", "namespace", "must be 1-64 characters"),
        ("kvpool://h:6379/ns!", "namespace", "must be 1-64 characters"),
        ("kvpool://h:6379/" + "n" * 65, "namespace", "must be 1-64 characters"),
        ("kvpool://h:6379/a/b", "namespace", "must not contain '/'"),
        ("kvpool://h:6379/a%2Fb", "namespace", "must not contain '/'"),
        ("kvpool://h:6379/ns?cluster=rack%201", "cluster", "must be A-Z a-z 0-9 _ . -"),
        ("kvpool://h:6379/ns?cluster=" + "c" * 65, "cluster", "must be A-Z a-z 0-9 _ . -"),
    ],
)
def test_bad_url_raises_config_error_naming_the_offending_part(url: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url(url)

    assert caught.value.key == key
    assert fragment in str(caught.value)
    assert str(caught.value).startswith(f"{key}: ")


def test_namespace_of_64_allowed_characters_is_accepted() -> None:
    name = "A-z_0.9" + "x" * 57
    assert PoolConfig.from_url(f"kvpool://h:1/{name}").namespace == name


def test_tls_on_means_rediss_to_redis_and_is_kept_in_the_canonical_url() -> None:
    config = PoolConfig.from_url("kvpool://h:6379/ns?tls=on")

    assert config.tls is True and config.tls_ca == ""
    assert config.redis_url == "rediss://h:6379/0"
    assert PoolConfig.from_url(config.to_url()) == config


def test_unknown_option_error_lists_the_known_options() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url("kvpool://h:1/ns?replica=2")

    assert caught.value.key == "replica"
    for known in ("replicas", "connect_timeout_s", "progress_timeout_s", "connections_per_node", "nccl", "tls"):
        assert known in str(caught.value)


def test_url_errors_never_echo_the_token() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url("redis://:hunter2@h:6379/ns")

    assert "hunter2" not in str(caught.value)
    assert ":***@" in str(caught.value)


def test_config_error_is_both_a_kvpool_error_and_a_value_error() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url("kvpool://h:1/ns?replicas=0")

    assert isinstance(caught.value, KVPoolError)
    assert isinstance(caught.value, ValueError)


def test_constructing_directly_validates_like_the_url_does() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig(namespace="no spaces")
    assert caught.value.key == "namespace"

    with pytest.raises(ConfigError) as caught:
        PoolConfig(redis_host="")
    assert caught.value.key == "url"

    with pytest.raises(ConfigError) as caught:
        PoolConfig(redis_port=65536)
    assert caught.value.key == "url"

    with pytest.raises(ConfigError) as caught:
        PoolConfig(tls_ca="/etc/ca.pem")
    assert caught.value.key == "tls_ca"


def test_config_is_immutable() -> None:
    config = PoolConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.replicas = 3  # type: ignore[misc]


# -- environment overrides ------------------------------------------------------------


def test_env_option_overrides_the_url() -> None:
    config = PoolConfig.from_url(
        "kvpool://h:1/ns?replicas=2&nccl=off&cluster=a",
        {"KVPOOL_REPLICAS": "3", "KVPOOL_NCCL": "on", "KVPOOL_CLUSTER": "b"},
    )

    assert (config.replicas, config.nccl, config.cluster) == (3, True, "b")


def test_env_token_overrides_the_url_token() -> None:
    config = PoolConfig.from_url("kvpool://:from-url-0123456789ab@h:1/ns", {"KVPOOL_TOKEN": "from-env-0123456789ab"})
    assert config.token == "from-env-0123456789ab"


def test_empty_env_token_clears_the_url_token() -> None:
    # A set-but-empty KVPOOL_TOKEN still wins over the URL: the documented precedence.
    config = PoolConfig.from_url("kvpool://:from-url-0123456789ab@h:1/ns", {"KVPOOL_TOKEN": ""})
    assert config.token == ""


def test_env_variables_that_are_not_options_are_ignored() -> None:
    environ = {
        "KVPOOL_URL": "kvpool://elsewhere:2/other",
        "KVPOOL_NCCL_LIBRARY": "/opt/nccl/libnccl.so.2",
        "KVPOOL_DEBUG": "1",
        "PATH": "/usr/bin",
        "REDIS_URL": "redis://x:1/0",
    }
    config = PoolConfig.from_url("kvpool://h:1/ns", environ)

    assert config == PoolConfig.from_url("kvpool://h:1/ns")


def test_unknown_kvpool_env_variable_warns_once_naming_it_and_the_known_ones(caplog: pytest.LogCaptureFixture) -> None:
    """A typo'd variable must not raise: inside LMCache a raise while the connector is made turns the cache off."""
    with caplog.at_level(logging.WARNING, logger="backend.config"):
        config = PoolConfig.from_url("kvpool://h:1/ns", {"KVPOOL_REPLICA": "2"})
        PoolConfig.from_url("kvpool://h:1/ns", {"KVPOOL_REPLICA": "2"})

    assert config.replicas == 1  # ignored
    warnings = [r.getMessage() for r in caplog.records if "KVPOOL_REPLICA:" in r.getMessage()]
    assert len(warnings) == 1  # once per process, however often a config is made
    assert "unknown kvpool environment variable" in warnings[0]
    assert "KVPOOL_TOKEN" in warnings[0] and "KVPOOL_REPLICAS" in warnings[0] and "KVPOOL_URL" in warnings[0]


def test_bad_env_value_raises_naming_the_option() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_url("kvpool://h:1/ns", {"KVPOOL_PROGRESS_TIMEOUT_S": "soon"})

    assert caught.value.key == "progress_timeout_s"
    assert "'soon' is not a number of seconds" in str(caught.value)


def test_env_can_turn_on_tls_and_name_its_ca() -> None:
    config = PoolConfig.from_url("kvpool://h:1/ns", {"KVPOOL_TLS": "on", "KVPOOL_TLS_CA": "/etc/ca.pem"})
    assert (config.tls, config.tls_ca) == (True, "/etc/ca.pem")


def test_from_url_reads_no_process_environment_unless_given_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_REPLICAS", "5")
    monkeypatch.setenv("KVPOOL_BOGUS", "x")

    assert PoolConfig.from_url("kvpool://h:1/ns").replicas == 1


# -- mapping and YAML -----------------------------------------------------------------


def test_from_mapping_takes_url_plus_typed_options() -> None:
    config = PoolConfig.from_mapping(
        {
            "url": "kvpool://:tok-0123456789abcdef@h:7000/ns",
            "replicas": 2,
            "progress_timeout_s": 0.9,
            "nccl": True,
            "cluster": "east",
        }
    )

    assert (config.redis_host, config.redis_port, config.namespace, config.token) == (
        "h",
        7000,
        "ns",
        "tok-0123456789abcdef",
    )
    assert (config.replicas, config.progress_timeout_s, config.nccl, config.cluster) == (2, 0.9, True, "east")


def test_from_mapping_options_override_the_url_and_env_overrides_both() -> None:
    data = {"url": "kvpool://h:1/ns?replicas=2&progress_timeout_s=0.1", "replicas": 3}

    config = PoolConfig.from_mapping(data, {"KVPOOL_PROGRESS_TIMEOUT_S": "0.25"})

    assert config.replicas == 3
    assert config.progress_timeout_s == 0.25


def test_from_mapping_rejects_an_unknown_key_by_name() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_mapping({"url": "kvpool://h:1/ns", "token": "x"})

    assert caught.value.key == "token"
    assert "unknown option" in str(caught.value)


def test_from_mapping_without_url_raises_on_url() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_mapping({"replicas": 2})
    assert caught.value.key == "url"


def test_from_mapping_rejects_a_non_mapping() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_mapping(["kvpool://h:1/ns"])  # type: ignore[arg-type]
    assert caught.value.key == "config"


def test_from_mapping_validates_option_values() -> None:
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_mapping({"url": "kvpool://h:1/ns", "replicas": 99})
    assert caught.value.key == "replicas"


def test_from_yaml_reads_a_real_file(tmp_path: Path) -> None:
    path = tmp_path / "kvpool.yaml"
    path.write_text(
        "url: kvpool://:tok-0123456789abcdef@redis.internal:6379/prod\n"
        "replicas: 2\n"
        "connections_per_node: 8\n"
        "nccl: on\n"
        "cluster: gpu-rack-3\n"
    )

    config = PoolConfig.from_yaml(path)

    assert config.redis_host == "redis.internal"
    assert config.namespace == "prod"
    assert config.token == "tok-0123456789abcdef"
    assert (config.replicas, config.connections_per_node, config.nccl, config.cluster) == (2, 8, True, "gpu-rack-3")


def test_from_yaml_accepts_a_string_path_and_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "kvpool.yaml"
    path.write_text("url: kvpool://h:1/ns\nreplicas: 2\n")

    config = PoolConfig.from_yaml(str(path), {"KVPOOL_REPLICAS": "4"})

    assert config.replicas == 4


def test_from_yaml_missing_file_raises_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_yaml(missing)

    assert caught.value.key == "config"
    assert f"cannot read {missing}" in str(caught.value)


def test_from_yaml_invalid_yaml_raises_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("url: [unclosed\n")

    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_yaml(path)

    assert caught.value.key == "config"
    assert "is not valid YAML" in str(caught.value)


def test_from_yaml_empty_file_raises_on_the_missing_url(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")

    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_yaml(path)
    assert caught.value.key == "url"


def test_from_yaml_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("url: kvpool://h:1/ns\nreplica: 2\n")

    with pytest.raises(ConfigError) as caught:
        PoolConfig.from_yaml(path)
    assert caught.value.key == "replica"


# -- canonical URL and masking --------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "kvpool://127.0.0.1:6379/default",
        "kvpool://redis.example:6380/team-a?replicas=3",
        "kvpool://:tok-0123456789abcdef@h:1/ns?replicas=2&progress_timeout_s=0.5&connections_per_node=16&nccl=on&cluster=east",
        "kvpool://:p%40ss%2Fw%3Ard-0123456789@h:1/ns",
    ],
)
def test_to_url_round_trips_through_from_url(url: str) -> None:
    config = PoolConfig.from_url(url)

    assert PoolConfig.from_url(config.to_url()) == config
    assert config.to_url() == url


def test_to_url_lists_only_options_that_differ_from_defaults() -> None:
    url = PoolConfig.from_url("kvpool://h:1/ns?replicas=1&progress_timeout_s=2&nccl=off&cluster=x").to_url()
    assert url == "kvpool://h:1/ns?cluster=x"


def test_to_url_without_token_masks_it() -> None:
    config = PoolConfig.from_url("kvpool://:s3cret-5b8e1f0c9d2a4e67@h:1/ns")

    assert config.to_url(with_token=False) == "kvpool://:***@h:1/ns"
    assert PoolConfig.from_url("kvpool://h:1/ns").to_url(with_token=False) == "kvpool://h:1/ns"


def test_repr_and_str_mask_the_token() -> None:
    config = PoolConfig.from_url("kvpool://:s3cret-5b8e1f0c9d2a4e67@h:1/ns?replicas=2")

    for text in (repr(config), str(config), f"{config}", repr([config])):
        assert "s3cret-5b8e1f0c9d2a4e67" not in text
        assert "token='***'" in text
    assert "replicas=2" in repr(config)
    assert "token=''" in repr(PoolConfig())


# -- sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1048576),
        ("0", 0),
        ("7B", 7),
        ("4GiB", 4 * GiB),
        ("4gib", 4 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5G", int(1.5 * GiB)),
        ("2K", 2048),
        ("2KiB", 2048),
        ("2KB", 2000),
        ("4GB", 4_000_000_000),
        ("1T", 1024**4),
        ("1TB", 10**12),
        (" 64 MiB ", 64 * MiB),
    ],
)
def test_parse_size_understands_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "4 PiB", "4XB", "four", "1,5G"])
def test_parse_size_rejects_non_sizes_naming_the_setting(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_size(text, name="--dram")

    assert caught.value.key == "--dram"
    assert "is not a size" in str(caught.value)


def test_parse_size_accepts_the_unit_suffix_without_b() -> None:
    assert parse_size("4Gi") == 4 * GiB


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (4 * GiB, "4.0 GiB"), (3 * 1024**4, "3.0 TiB")],
)
def test_format_size_renders_binary_units(num_bytes: int, text: str) -> None:
    assert format_size(num_bytes) == text


def test_ipv6_host_round_trips() -> None:
    config = PoolConfig.from_url("kvpool://[::1]:6379/ns")

    assert PoolConfig.from_url(config.to_url()) == config
    assert config.redis_url == "redis://[::1]:6379/0"


# -- the LMCache remote_url form --------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "kvpool://127.0.0.1:6379/default",
        "kvpool://127.0.0.1:6379",
        "kvpool://redis.example:6380/team.a-1?replicas=2&progress_timeout_s=0.5&shm=off",
        "kvpool://10.0.0.5:7000/prod?redis_mode=cluster&redis_hosts=10.0.0.6:7000,10.0.0.7:7000",
        "kvpool://[::1]:26379/ns?sentinel=kvmaster&redis_hosts=[::2]:26379",
        "kvpool://h:1/ns?tls=on&tls_ca=/etc/kvpool/ca%20bundle.pem&cluster=east&nccl=on",
    ],
)
def test_remote_url_names_the_same_pool_as_the_pool_url(url: str) -> None:
    remote_url = lmcache_remote_url(url)

    assert remote_url.startswith(f"external://{urlsplit(url).netloc}/kvpool.lmcache_connector/?")
    assert "connector_name=KVPoolRemoteURLConnector" in remote_url
    assert "," not in remote_url  # LMCache reads one host per comma and refuses several
    assert remote_url_pool_config(remote_url) == PoolConfig.from_url(url)


def test_remote_url_reads_secrets_from_files_and_kvpool_env_like_a_pool_url(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-5b8e1f0c9d2a4e67\n")
    remote_url = lmcache_remote_url(f"kvpool://h:6379/ns?token_file={token}")

    config = remote_url_pool_config(remote_url, {"KVPOOL_REPLICAS": "3", "KVPOOL_REDIS_PASSWORD": "pw"})

    assert (config.token, config.replicas, config.redis_password) == ("s3cret-5b8e1f0c9d2a4e67", 3, "pw")
    assert "s3cret-5b8e1f0c9d2a4e67" not in remote_url


REMOTE = "external://h:6379/kvpool.lmcache_connector/?connector_name=KVPoolRemoteURLConnector&namespace=ns"


@pytest.mark.parametrize(
    ("remote_url", "key", "fragment"),
    [
        ("", "remote_url", "is empty"),
        ("kvpool://h:6379/ns", "remote_url", "scheme 'kvpool' is not external://"),
        (REMOTE.replace("h:6379", "h"), "remote_url", "missing Redis port"),
        (REMOTE.replace("h:6379", ":6379"), "remote_url", "missing Redis host"),
        (REMOTE.replace("h:6379", "h:port"), "remote_url", "port is not a number"),
        (REMOTE.replace("h:6379", "[::1:6379"), "remote_url", "malformed URL"),
        (REMOTE.replace("//h", "//user:pw@h"), "remote_url", "a user name is not supported"),
        (REMOTE + "&redis_mode=cluster&redis_hosts=a:1,b:2", "remote_url", "write a comma inside a value as %2C"),
        (REMOTE + "&namespace=other", "namespace", "given twice"),
        (REMOTE.replace("namespace=ns", "namespace="), "namespace", "is empty"),
        (REMOTE.replace("namespace=ns", "namespace=bad%20ns"), "namespace", "must be 1-64 characters"),
        (
            REMOTE + "&namespce=x",
            "namespce",
            "unknown option; did you mean namespace? known: connector_name, namespace, ",
        ),
        (REMOTE + "&replicas=lots", "replicas", "'lots' is not an integer"),
        (REMOTE + "&token_file=/nonexistent/token", "token_file", "cannot read /nonexistent/token"),
    ],
)
def test_bad_remote_url_raises_naming_the_bad_part_and_shows_the_url(remote_url: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        remote_url_pool_config(remote_url)

    assert caught.value.key == key
    assert str(caught.value).startswith(f"{key}: ") and fragment in str(caught.value)
    if remote_url:  # the URL as given, secrets left out
        assert str(caught.value).endswith(f", in remote_url {without_inline_secrets(remote_url)[0]}")


def test_remote_url_errors_never_echo_a_secret() -> None:
    with pytest.raises(ConfigError) as caught:
        remote_url_pool_config(
            REMOTE.replace("//h", "//:tok3n-0123456789abcdef@h") + "&redis_password=pw5ecret&replicas=0"
        )

    assert caught.value.key == "replicas"
    assert "tok3n-0123456789abcdef" not in str(caught.value) and "pw5ecret" not in str(caught.value)


# -- NodeConfig: flags, environment and YAML through one table --------------------------


def test_node_options_take_a_flag_over_the_environment_over_yaml_over_the_default(tmp_path: Path) -> None:
    from backend.config import NodeConfig

    token_file = tmp_path / "token"
    token_file.write_text("from-file-0123456789ab\n")
    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text("redis: redis://r:1\ndram: 8MiB\nnode-id: from-yaml\nshm_dir: off\nport: 7001\n")
    config = NodeConfig.from_sources(
        {"dram": "16MiB"}, config_file=yaml_file, environ={"KVPOOL_TOKEN": "env-0123456789abcdef"}
    )
    assert (config.redis_url, config.dram_bytes, config.node_id) == ("redis://r:1", 16 << 20, "from-yaml")
    assert (config.port, config.shm_dir, config.token, config.token_file) == (7001, None, "env-0123456789abcdef", "")
    assert config.nvme_dir is None and config.pair_timeout_s == 60.0  # the table's defaults

    yaml_file.write_text(f"redis: redis://r:1\ntoken_file: {token_file}\n")
    config = NodeConfig.from_sources({}, config_file=yaml_file, environ={"KVPOOL_TOKEN": "env-0123456789abcdef"})
    assert (config.token, config.token_file) == ("from-file-0123456789ab", str(token_file.resolve()))  # a file wins
    assert "from-file-0123456789ab" not in repr(config)


def test_a_node_reads_the_token_and_password_files_the_engines_variables_name(tmp_path: Path) -> None:
    """KVPOOL_TOKEN_FILE set on a node (as on an engine) must not leave the node without a token."""
    from backend.config import NodeConfig

    (tmp_path / "token").write_text("file-token-0123456789ab\n")
    (tmp_path / "password").write_text("file-password\n")
    environ = {"KVPOOL_TOKEN_FILE": str(tmp_path / "token"), "KVPOOL_REDIS_PASSWORD_FILE": str(tmp_path / "password")}
    config = NodeConfig.from_sources(
        {"redis": "redis://r:1"}, environ={**environ, "KVPOOL_TOKEN": "env-token-0123456789ab"}
    )
    assert (config.token, config.redis_password) == ("file-token-0123456789ab", "file-password")
    (tmp_path / "flag-token").write_text("flag-token-0123456789ab")
    flags = {"redis": "redis://r:1", "token_file": str(tmp_path / "flag-token")}
    assert NodeConfig.from_sources(flags, environ=environ).token == "flag-token-0123456789ab"  # a flag wins
    (tmp_path / "token").write_text("")
    with pytest.raises(ConfigError, match="is empty; a node without a token accepts anyone"):
        NodeConfig.from_sources({"redis": "redis://r:1"}, environ=environ)


def test_prefault_is_on_by_default_and_parses_from_a_flag_the_environment_and_yaml(tmp_path: Path) -> None:
    from backend.config import NodeConfig

    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text("redis: redis://r:1\nprefault: off\n")  # YAML reads a bare off as False
    assert NodeConfig.from_sources({"redis": "redis://r:1"}).prefault is True
    assert NodeConfig.from_sources({}, config_file=yaml_file).prefault is False
    assert NodeConfig.from_sources({}, config_file=yaml_file, environ={"KVPOOL_PREFAULT": "on"}).prefault is True
    flags = {"prefault": "off"}
    assert NodeConfig.from_sources(flags, config_file=yaml_file, environ={"KVPOOL_PREFAULT": "on"}).prefault is False
    yaml_file.write_text("redis: redis://r:1\nprefault: yes\n")
    assert NodeConfig.from_sources({}, config_file=yaml_file).prefault is True


@pytest.mark.parametrize(
    ("flags", "yaml_text", "environ", "key"),
    [
        ({"dram": "lots"}, "", {}, "--dram"),
        ({}, "dram: 0", {}, "dram (in "),
        ({}, "dramm: 8MiB", {}, "dramm"),
        ({}, "token: secret", {}, "token"),
        ({"port": "99999"}, "", {}, "--port"),
        ({"advertise": "host:port"}, "", {}, "--advertise"),
        ({"channel": "cpu"}, "", {}, "--channel"),  # needs --cluster
        ({"namespace": "a/b"}, "", {}, "--namespace"),
        ({"token_file": "/nonexistent/token"}, "", {}, "--token-file"),
        ({"redis": "http://r:1"}, "", {}, "--redis"),
        ({"redis": None}, "", {}, "--redis"),  # required
        ({"pair_timeout_s": "0"}, "", {}, "--pair-timeout-s"),
        ({"handshake_timeout_s": "soon"}, "", {}, "--handshake-timeout-s"),
        ({"pair_timeout_ms": "0"}, "", {}, "--pair-timeout-ms"),
        ({}, "dead-node-grace-ms: 1.5", {}, "dead-node-grace-ms"),
        ({"handshake_timeout_ms": "500", "handshake_timeout_s": "1"}, "", {}, "--handshake-timeout-ms"),
        ({}, "shm-dir: /nonexistent/shm", {}, "shm_dir (in "),
        ({"prefault": "maybe"}, "", {}, "--prefault"),
        ({}, "", {"KVPOOL_PREFAULT": "2"}, "KVPOOL_PREFAULT"),
        ({}, "prefault: [on]", {}, "prefault (in "),
        ({"eviction": "lfu"}, "", {}, "--eviction"),
        ({}, "eviction: prefix-frequency", {}, "eviction (in "),
        ({"eviction": "prefix-freq"}, "", {}, "--eviction"),
    ],
)
def test_a_bad_node_option_is_refused_naming_it_as_its_source_spells_it(tmp_path, flags, yaml_text, environ, key):
    from backend.config import NodeConfig

    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text(yaml_text or "{}")
    with pytest.raises(ConfigError) as caught:
        NodeConfig.from_sources({"redis": "redis://r:1", **flags}, config_file=yaml_file, environ=environ)
    assert str(caught.value).startswith(key), str(caught.value)


@pytest.mark.parametrize(
    ("flags", "yaml_text", "expected"),
    [
        (
            {"handshake_timeout_ms": "500"},
            "",
            "--handshake-timeout-ms: unknown flag; did you mean --handshake-timeout-s? ",
        ),
        ({"pair_timeout_ms": "500"}, "", "--pair-timeout-ms: unknown flag; did you mean --pair-timeout-s? "),
        (
            {},
            "dead-node-grace-ms: 90000",
            "dead-node-grace-ms: unknown option in {yaml}; did you mean dead_node_grace_s? ",
        ),
        ({}, "dramm: 8MiB", "dramm: unknown option in {yaml}; did you mean dram? known: "),
        (
            {"eviction": "prefix-freq"},
            "",
            "--eviction: 'prefix-freq' is not one of lru, prefix, prefix-recency; did you "
            "mean prefix? (prefix-freq was its name before 0.1)",
        ),
        (
            {},
            "eviction: prefix-freq",
            "eviction (in {yaml}): 'prefix-freq' is not one of lru, prefix, prefix-recency; did you mean prefix?",
        ),
    ],
)
def test_an_old_node_flag_yaml_key_or_eviction_name_is_refused_naming_the_new_one(tmp_path, flags, yaml_text, expected):
    """The names of before 0.1 (milliseconds, ``prefix-freq``) are unknown now: the error says what replaced them."""
    from backend.config import NodeConfig

    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text("redis: redis://r:1\n" + yaml_text)
    with pytest.raises(ConfigError) as caught:
        NodeConfig.from_sources(flags, config_file=yaml_file, environ={})
    assert str(caught.value).startswith(expected.format(yaml=yaml_file)), str(caught.value)
    if "_ms" in str(flags) + yaml_text:
        assert "in milliseconds: give seconds" in str(caught.value)


def test_node_flags_are_the_option_table(tmp_path: Path) -> None:
    """Every flag of `kvpool node` and `kvpool up` is a NODE_OPTIONS entry (plus --config, and up's own
    --events, which sets several of them), and every settable entry is a flag: the CLI, the YAML keys and
    the variables cannot drift apart."""
    from backend.cli import build_parser
    from backend.config import NODE_OPTIONS

    parser = build_parser()
    for verb, own in (("node", {"--config"}), ("up", {"--config", "--events"})):
        sub = parser._subparsers._group_actions[0].choices[verb]  # type: ignore[union-attr]
        shown = [a for a in sub._actions if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS]
        hidden = [a for a in sub._actions if a.option_strings and a.help == argparse.SUPPRESS]
        assert {a.option_strings[0] for a in shown} == own | {o.flag_name for o in NODE_OPTIONS if o.flag}
        assert hidden == []
    assert {o.env for o in NODE_OPTIONS if o.env} == {
        "KVPOOL_TOKEN",
        "KVPOOL_REDIS_PASSWORD",
        "KVPOOL_PREFAULT",
        "KVPOOL_TOKEN_FILE",
        "KVPOOL_REDIS_PASSWORD_FILE",
    }


def test_an_unknown_kvpool_variable_warns_a_node_and_does_not_stop_it(caplog: pytest.LogCaptureFixture) -> None:
    from backend.config import NodeConfig

    with caplog.at_level(logging.WARNING, logger="backend.config"):
        config = NodeConfig.from_sources({"redis": "redis://r:1"}, environ={"KVPOOL_DRAMM": "8MiB"})
    assert config.dram_bytes == 4 << 30
    assert any("KVPOOL_DRAMM: unknown kvpool environment variable" in r.getMessage() for r in caplog.records)


def test_nccl_on_without_a_cluster_is_warned_about_when_the_config_is_built(caplog, monkeypatch):
    from backend.config import pool

    monkeypatch.setattr(pool, "_warned_options", set())
    with caplog.at_level(logging.WARNING, logger="backend.config"):
        PoolConfig.from_url("kvpool://127.0.0.1:6379/ns?nccl=on")
        PoolConfig.from_url("kvpool://127.0.0.1:6379/ns?nccl=on")  # once per process, not per config
        PoolConfig.from_url("kvpool://127.0.0.1:6379/ns?nccl=on&cluster=rack-a")
    warned = [r.getMessage() for r in caplog.records if "nccl=on needs cluster" in r.getMessage()]
    assert len(warned) == 1 and "TCP" in warned[0]


def test_mask_secrets_hides_every_secret_written_into_a_url_in_a_text() -> None:
    dump = (
        "{'extra_config': {'url': 'kvpool://:tok3n-0123456789abcdef@h:6379/ns?redis_password=pw0rd&replicas=2'}, "
        "'remote_url': 'external://h:1/m/?connector_name=C&token=tok3n-0123456789abcdef', 'redis': 'redis://u:pw0rd@h:1/0'}"
    )
    shown = mask_secrets(dump)
    assert "tok3n-0123456789abcdef" not in shown and "pw0rd" not in shown
    assert "kvpool://:***@h:6379/ns?redis_password=***&replicas=2" in shown and "redis://u:***@h:1/0" in shown
    assert mask_secrets("read from a file: f1le-secret", ["f1le-secret"]) == "read from a file: ***"
    assert mask_secrets("kvpool://h:6379/ns and user@example.com") == "kvpool://h:6379/ns and user@example.com"
