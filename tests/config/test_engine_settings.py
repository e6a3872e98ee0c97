"""``EngineConfig``: defaults, every validation path, the TOML table and its round trip."""

import dataclasses

import pytest

from prefixd.api.layout import KVLayout
from prefixd.cache.policy import POLICIES
from prefixd.cache.tiering import WRITE_POLICIES
from prefixd.config import ConfigError, EngineConfig, Tenant, TierSizes
from prefixd.config.engine_settings import EVICTION_POLICIES
from prefixd.config.engine_settings import WRITE_POLICIES as CONFIG_WRITE_POLICIES
from prefixd.config.toml_reader import read_engine_config
from prefixd.config.toml_writer import engine_toml

FULL_TOML = b"""
[daemon]
socket = "/run/prefixd/prefixd.sock"   # the daemon's table: the engine ignores it

[engine]
sync = "interval"
sync_interval_ms = 250
write_policy = "write_back"
eviction = "lfu"
verify = "eager"
checkpoint_records = 5000
checkpoint_blocks = 200000
spill_blocks = 64
reclaim_grace_s = 2.5
shm_dir = "/dev/shm/prefixd"
use_cuda = "auto"
forget_missing_tier = true

[engine.blocks]
device = 100
host = 200
disk = 300

[engine.blocks.models."org/model-a"]
device = 7

[[engine.tenants]]
name = "acme"
salt = "s3cret"

[[engine.tenants]]
name = "globex"
salt = "other"
"""


def test_defaults_are_valid_and_name_one_default_tenant():
    config = EngineConfig()
    assert config.sync == "commit" and config.verify == "lazy"
    assert config.checkpoint_blocks is None and config.forget_missing_tier is False
    assert [t.name for t in config.tenants] == ["default"]
    assert config.tenant("default").salt == b""
    assert config.tenant("nobody") is None


def test_a_full_engine_table_loads_every_key():
    config = read_engine_config(FULL_TOML)
    assert config.sync == "interval" and config.sync_interval_ms == 250
    assert (config.write_policy, config.eviction, config.verify) == ("write_back", "lfu", "eager")
    assert (config.checkpoint_records, config.checkpoint_blocks, config.spill_blocks) == (5000, 200000, 64)
    assert config.reclaim_grace_s == 2.5 and config.shm_dir == "/dev/shm/prefixd"
    assert config.use_cuda is None and config.forget_missing_tier is True
    assert config.blocks == TierSizes(100, 200, 300)
    assert config.tenants == (Tenant("acme", b"s3cret"), Tenant("globex", b"other"))


def test_a_model_override_replaces_only_the_tiers_it_names():
    config = read_engine_config(FULL_TOML)
    a = KVLayout("org/model-a", num_layers=1, num_kv_heads=1, head_dim=8)
    b = KVLayout("org/model-b", num_layers=1, num_kv_heads=1, head_dim=8)
    assert config.blocks_for(a) == TierSizes(7, 200, 300)
    assert config.blocks_for(b) == TierSizes(100, 200, 300)


def test_toml_round_trip_gives_an_equal_config(tmp_path):
    config = read_engine_config(FULL_TOML)
    path = tmp_path / "prefixd.toml"
    path.write_text(engine_toml(config))
    assert read_engine_config(path) == config
    assert read_engine_config(engine_toml(EngineConfig()).encode()) == EngineConfig()


def test_a_document_without_an_engine_table_gives_the_defaults():
    assert read_engine_config(b"[daemon]\nsocket = 'x'\n") == EngineConfig()


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().sync = "none"


@pytest.mark.parametrize("line, words", [
    ('sync = "fsync"', ["engine.sync", "'commit', 'interval', 'none'", "'fsync'", "[engine] sync ="]),
    ("sync_interval_ms = 0", ["engine.sync_interval_ms", "> 0"]),
    ('sync_interval_ms = "fast"', ["engine.sync_interval_ms"]),
    ('write_policy = "write_around"', ["engine.write_policy", "'write_through'"]),
    ('eviction = "fifo"', ["engine.eviction", "'lru'"]),
    ('verify = "never"', ["engine.verify", "'lazy', 'eager'"]),
    ("checkpoint_records = 0", ["engine.checkpoint_records", ">= 1"]),
    ("checkpoint_records = true", ["engine.checkpoint_records"]),
    ("checkpoint_blocks = -5", ["engine.checkpoint_blocks", "leave it out"]),
    ("spill_blocks = 1.5", ["engine.spill_blocks"]),
    ("reclaim_grace_s = -1", ["engine.reclaim_grace_s", ">= 0"]),
    ("reclaim_grace_s = nan", ["engine.reclaim_grace_s"]),
    ('shm_dir = ""', ["engine.shm_dir"]),
    ('use_cuda = "yes"', ["engine.use_cuda", '"auto"']),
    ('forget_missing_tier = "no"', ["engine.forget_missing_tier", "true or false"]),
    ("sycn = 'commit'", ["'sycn'", "[engine]", "known keys", "sync"]),
    ("blocks = 5", ["[engine.blocks] must be a table"]),
    ("tenants = 'acme'", ["engine.tenants", "[[engine.tenants]]"]),
])
def test_a_bad_engine_value_is_refused_saying_what_to_change(line, words):
    with pytest.raises(ConfigError) as err:
        read_engine_config(f"[engine]\n{line}\n".encode())
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@pytest.mark.parametrize("table, words", [
    ("[engine.blocks]\ndevice = 0", ["engine.blocks.device", ">= 1"]),
    ("[engine.blocks]\nhost = -1", ["engine.blocks.host", ">= 0"]),
    ("[engine.blocks]\nhost = 0\ndisk = 0", ["host or a disk tier"]),
    ("[engine.blocks]\ndevices = 4", ["'devices'", "[engine.blocks]", "device, host, disk, models"]),
    ('[engine.blocks.models."m"]\ndevice = "many"', ['[engine.blocks.models."m"]', "engine.blocks.device"]),
    ('[engine.blocks.models."m"]\nram = 3', ["'ram'", '[engine.blocks.models."m"]']),
    ("[[engine.tenants]]\nsalt = 'x'", ["no name", 'name = "..."']),
    ("[[engine.tenants]]\nname = 'a'\nkey = 'x'", ["'key'", "name, salt"]),
    ("[[engine.tenants]]\nname = '../etc'", ["'../etc'", "names a directory"]),
    ("[[engine.tenants]]\nname = '.hidden'", ["'.hidden'"]),
    ("[[engine.tenants]]\nname = 'a'\nsalt = 3", ["salt must be a string"]),
    ("[[engine.tenants]]\nname = 'a'\nsalt = 'x'\n[[engine.tenants]]\nname = 'a'\nsalt = 'y'",
     ["'a' twice"]),
    ("[[engine.tenants]]\nname = 'a'\nsalt = 'x'\n[[engine.tenants]]\nname = 'b'\nsalt = 'x'",
     ["same salt", "'a'", "'b'"]),
    ("[engine]\ntenants = []", ["engine.tenants is empty"]),
])
def test_a_bad_sub_table_is_refused_saying_what_to_change(table, words):
    with pytest.raises(ConfigError) as err:
        read_engine_config(table.encode())
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_values_built_in_code_are_checked_too():
    """A config made without TOML (tests, the daemon's overrides) is validated the same way."""
    with pytest.raises(ConfigError, match="engine.sync must be one of"):
        EngineConfig(sync="fsync")
    with pytest.raises(ConfigError, match="engine.blocks must be TierSizes"):
        EngineConfig(blocks=(1, 2, 3))
    with pytest.raises(ConfigError, match="model_blocks entries"):
        EngineConfig(model_blocks=(("m", (1, 2, 3)),))
    with pytest.raises(ConfigError, match="names 'm' twice"):
        EngineConfig(model_blocks=(("m", TierSizes()), ("m", TierSizes())))
    with pytest.raises(ConfigError, match="Tenant"):
        EngineConfig(tenants=("acme",))
    with pytest.raises(ConfigError, match="salt must be a string or bytes"):
        Tenant("acme", 5)
    assert Tenant("acme", "text").salt == b"text"


def test_the_policy_names_are_the_ones_the_cache_implements():
    """Config names the eviction and write policies without importing the cache (config
    imports only api/): a policy added to the cache but not here could never be chosen."""
    assert EVICTION_POLICIES == tuple(POLICIES)
    assert CONFIG_WRITE_POLICIES == WRITE_POLICIES


def test_bad_toml_and_a_missing_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_engine_config(b"[engine\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_engine_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="engine must be a table"):
        read_engine_config(b"engine = 3\n")


def test_a_salt_that_is_not_text_cannot_be_written_as_toml():
    config = EngineConfig(tenants=(Tenant("a", b"\xff\xfe"),))
    with pytest.raises(ConfigError, match="not UTF-8"):
        engine_toml(config)


def test_odd_characters_survive_the_round_trip():
    config = EngineConfig(shm_dir='/tmp/a "quoted"\\dir\x7f',
                          model_blocks=(('org/m "x"', TierSizes(1, 2, 3)),),
                          tenants=(Tenant("a", "sält\n\t"),))
    assert read_engine_config(engine_toml(config).encode()) == config
