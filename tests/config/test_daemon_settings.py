"""``DaemonConfig``: the [daemon] table, its checks, and where sockets go."""

from __future__ import annotations

import pytest

from prefixd.config.daemon_settings import DaemonConfig, TenantSocket
from prefixd.config.engine_settings import EngineConfig, Tenant
from prefixd.config.errors import ConfigError
from prefixd.config.paths import default_socket
from prefixd.config.toml_reader import load


def write(tmp_path, text: str) -> str:
    path = tmp_path / "prefixd.toml"
    path.write_text(text)
    return str(path)


def test_defaults_need_no_file():
    engine, daemon = load(None)
    assert engine == EngineConfig() and daemon == DaemonConfig()


def test_a_file_with_both_tables_loads(tmp_path):
    engine, daemon = load(write(tmp_path, """
[engine]
sync = "none"
[[engine.tenants]]
name = "a"
salt = "x"
[[engine.tenants]]
name = "b"
salt = "y"
[daemon]
lease_s = 2.5
log_level = "debug"
[daemon.limits]
sequences_per_session = 7
[[daemon.sockets]]
tenant = "b"
path = "/run/pd/b-custom.sock"
mode = "0600"
"""))
    assert engine.sync == "none" and daemon.lease_s == 2.5 and daemon.limits.sequences_per_session == 7
    socks = daemon.socket_paths(engine, "/var/lib/pd")
    assert [s.tenant for s in socks] == ["a", "b"]
    assert socks[1] == TenantSocket("b", "/run/pd/b-custom.sock", mode=0o600)


@pytest.mark.parametrize("text, words", [
    ("[daemon]\nlease = 3\n", "unknown key 'lease'"),
    ("[daemon]\nlease_s = 0\n", "lease_s must be"),
    ("[daemon]\nlease_s = true\n", "lease_s must be"),
    ("[daemon]\nlog_level = \"loud\"\n", "log_level must be one of"),
    ("[daemon]\nmax_message_bytes = 10\n", "at least 65536"),
    ("[daemon.limits]\nsequences_per_session = 0\n", "sequences_per_session"),
    ("[daemon.limits]\nsessions = 3\n", "unknown key 'sessions'"),
    ("[deamon]\nlease_s = 3\n", "unknown key 'deamon'"),
    ("[daemon]\nlease_s = \n", "not valid TOML"),
    ("[[daemon.sockets]]\ntenant = \"default\"\n", "needs tenant"),
    ("[[daemon.sockets]]\ntenant = \"default\"\npath = \"rel.sock\"\n", "must be absolute"),
    ("[[daemon.sockets]]\ntenant = \"default\"\npath = \"/a.sock\"\nmode = \"rw\"\n", "octal"),
    ("[[daemon.sockets]]\ntenant = \"default\"\npath = \"/" + "x" * 120 + ".sock\"\n", "at most 107"),
])
def test_bad_settings_are_refused_with_what_to_change(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words):
        load(write(tmp_path, text))


def test_a_socket_for_an_unknown_tenant_is_refused():
    config = DaemonConfig(sockets=(TenantSocket("ghost", "/run/g.sock"),))
    with pytest.raises(ConfigError, match="ghost"):
        config.socket_paths(EngineConfig(), "/s")


def test_tenants_sockets_sit_beside_the_first_and_never_share_a_path():
    engine = EngineConfig(tenants=(Tenant("a", "1"), Tenant("b", "2")))
    socks = DaemonConfig(socket="/run/pd/main.sock").socket_paths(engine, "/s")
    assert [s.path for s in socks] == ["/run/pd/main.sock", "/run/pd/b.sock"]
    clash = DaemonConfig(socket="/run/pd/b.sock")
    with pytest.raises(ConfigError, match="share a socket path"):
        clash.socket_paths(engine, "/s")


def test_default_socket_follows_xdg_runtime_dir(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket("/st") == "/run/user/1000/prefixd/prefixd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket("/st") == "/st/prefixd.sock"
