"""``[daemon.kv_events]``: off by default, read from the file, its checks, and each tenant's
endpoints and topic."""

from __future__ import annotations

import pytest

from prefixd.config.errors import ConfigError
from prefixd.config.kv_events_settings import KVEventsConfig
from prefixd.config.toml_reader import load


def test_off_by_default_and_read_from_the_file(tmp_path):
    assert not load(None)[1].kv_events.enabled
    path = tmp_path / "prefixd.toml"
    path.write_text('[daemon.kv_events]\nendpoint = "tcp://127.0.0.1:5557"\n'
                    'replay_endpoint = "tcp://127.0.0.1:5567"\nbuffer_batches = 64\nhwm = 8\n')
    kv = load(str(path))[1].kv_events
    assert kv == KVEventsConfig("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5567", "", 64, 8)
    assert kv.enabled


@pytest.mark.parametrize("kwargs, words", [
    (dict(endpoint="http://x:1"), "must start with one of tcp://"),
    (dict(endpoint="tcp://127.0.0.1"), "tcp://HOST:PORT"),
    (dict(endpoint="tcp://127.0.0.1:70000"), "tcp://HOST:PORT"),
    (dict(endpoint="ipc://"), "names no path"),
    (dict(replay_endpoint="tcp://127.0.0.1:5567"), "endpoint is not"),
    (dict(endpoint="tcp://h:1", buffer_batches=0), "buffer_batches must be an integer"),
    (dict(endpoint="tcp://h:1", hwm=True), "hwm must be an integer"),
    (dict(endpoint=5557), "must be a string"),
])
def test_bad_settings_are_refused_with_what_to_change(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        KVEventsConfig(**kwargs)


def test_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "prefixd.toml"
    path.write_text('[daemon.kv_events]\nendpoint = "tcp://h:1"\nbuffer_steps = 3\n')
    with pytest.raises(ConfigError, match="buffer_steps"):
        load(str(path))


def test_each_tenant_gets_its_own_endpoints_and_topic():
    tcp = KVEventsConfig("tcp://*:5557", "tcp://*:5567", "")
    assert [(e.tenant, e.endpoint, e.replay_endpoint, e.topic) for e in tcp.tenants(["a", "b"])] == [
        ("a", "tcp://*:5557", "tcp://*:5567", "a"), ("b", "tcp://*:5558", "tcp://*:5568", "b")]
    ipc = KVEventsConfig("ipc:///run/p/kv", "", "kv@10.0.0.1@m")
    assert [(e.endpoint, e.replay_endpoint, e.topic) for e in ipc.tenants(["a", "b"])] == [
        ("ipc:///run/p/kv", "", "kv@10.0.0.1@m"), ("ipc:///run/p/kv_b", "", "kv@10.0.0.1@m")]


def test_overlapping_tenant_ports_are_refused():
    with pytest.raises(ConfigError, match="overlap"):
        KVEventsConfig("tcp://*:5557", "tcp://*:5558").tenants(["a", "b"])
    with pytest.raises(ConfigError, match="choose a lower port"):
        KVEventsConfig("tcp://*:65535").tenants(["a", "b"])
