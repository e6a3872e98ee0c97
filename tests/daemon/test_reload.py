"""Config reload: the file watch and SIGHUP apply live settings, keep the others for a restart,
and refuse a file that does not load, whole. One daemon process walks through the cases in
order (each case waits for its own log line, so they cannot be confused)."""

from __future__ import annotations

import os
import signal
import stat
import tempfile
import time

import grpc
import numpy as np
import pytest

from prefixd.api import prefixd_pb2 as pb
from prefixd.config.daemon_settings import DaemonConfig, TenantSocket
from prefixd.config.engine_settings import EngineConfig, TierSizes
from prefixd.config.live_keys import DAEMON_LIVE_KEYS, daemon_changes
from prefixd.daemon.reload import DAEMON_LIVE
from prefixd.engine import live_settings
from prefixd.engine.engine import Engine
from prefixd.api.layout import KVLayout
from tests.daemon.harness import DaemonProcess
from tests.daemon.notify_listener import NotifyListener

CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"
eviction = "lru"
{engine_extra}

[engine.blocks]
device = {device}
host = 1024
disk = 4096

[daemon]
lease_s = {lease_s}
log_level = "info"

[daemon.limits]
sequences_per_session = {seqs}

[[daemon.sockets]]
tenant = "default"
path = "{base}/run/s.sock"
mode = "{mode}"
"""

LAYOUT = pb.KVLayout(model_id="tiny", num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float16", block_size=16)


def _render(base: str, **kw) -> str:
    values = dict(shm=os.path.join(base, "shm"), base=base, lease_s=3.0, device=256, seqs=4096,
                  mode="0660", engine_extra="")
    values.update(kw)
    return CONFIG.format(**values)


def _save(d: DaemonProcess, text: str) -> None:
    """As an editor saves: a new file renamed over the old one."""
    tmp = d.config_path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, d.config_path)


def _wait_log(d: DaemonProcess, needle: str, start: int, timeout: float = 30.0) -> str:
    """The daemon's log from offset ``start`` once it contains ``needle``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = d.log_text()[start:]
        if needle in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"no {needle!r} in the daemon log:\n{d.log_text()[start:]}")


def _open(stub, sid: int, first: int):
    tokens = np.arange(first, first + 16, dtype="<i4").tobytes()
    return stub.Open(pb.OpenRequest(session_id=sid, tokens=tokens)).sequence


@pytest.fixture(scope="module")
def daemon():
    listener = NotifyListener()
    base = tempfile.mkdtemp(prefix="pd-", dir="/tmp")
    d = DaemonProcess(_render(base), base=base, env=listener.env())
    d.listener = listener
    try:
        yield d.start()
    finally:
        d.close()
        listener.close()


def test_a_live_setting_applies_with_a_log_line_and_reloading_ready(daemon):
    """The limits change on a save: a second Open in the session is refused at once."""
    d = daemon
    stub = d.stub()
    sid = stub.Attach(pb.AttachRequest(client_name="reload", layout=LAYOUT)).session_id
    _open(stub, sid, 0)
    _open(stub, sid, 100)  # 4096 sequences allowed
    seen = len(d.listener.snapshot())
    start = len(d.log_text())
    _save(d, _render(d.base, seqs=2, engine_extra='write_policy = "write_back"'))
    text = _wait_log(d, "config reload: daemon.limits", start)
    assert "config reload (file changed)" in text
    assert "config reload: engine.write_policy 'write_through' -> 'write_back'" in text
    assert "restart" not in text
    with pytest.raises(grpc.RpcError) as err:
        _open(stub, sid, 200)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    reloading = d.listener.wait_for("RELOADING", "1", after=seen)
    ready = d.listener.wait_for("READY", "1", after=reloading)
    assert "applied" in d.listener.snapshot()[ready]["STATUS"]
    stub.Detach(pb.DetachRequest(session_id=sid))


def test_a_socket_mode_change_applies_live(daemon):
    d = daemon
    start = len(d.log_text())
    _save(d, _render(d.base, seqs=2, mode="0600", engine_extra='write_policy = "write_back"'))
    _wait_log(d, "config reload: daemon.sockets", start)
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600


def test_a_setting_that_needs_a_restart_is_refused_and_the_old_value_kept(daemon):
    """A pool made after the reload still gets the running device size (256, not 512)."""
    d = daemon
    start = len(d.log_text())
    _save(d, _render(d.base, seqs=2, mode="0600", device=512,
                     engine_extra='write_policy = "write_back"'))
    text = _wait_log(d, "need a restart", start)
    assert "engine.blocks" in text
    stub = d.stub()
    other = pb.KVLayout(model_id="other", num_layers=1, num_kv_heads=1, head_dim=8,
                        dtype="float16", block_size=16)
    reply = stub.Attach(pb.AttachRequest(client_name="reload", layout=other))
    device = next(p for p in reply.pools if p.tier == "device")
    assert list(device.shape)[0] == 256
    stub.Detach(pb.DetachRequest(session_id=reply.session_id))


@pytest.mark.parametrize("broken", [
    '[engine\nsync = "commit"',                           # TOML syntax
    '[daemon]\nlog_level = "debug"\nlease_s = "long"',    # wrong type
    '[daemon]\nlog_level = "debug"\nleese_s = 3.0',       # unknown key
])
def test_a_broken_file_is_refused_whole(daemon, broken):
    """The valid part (log_level = "debug") is not applied either."""
    d = daemon
    # an operator's broken file is an ERROR by design: the reload they asked for did not happen
    d.expect_log(r"^ERROR prefixd\.daemon\.reload: config reload refused, nothing applied")
    start = len(d.log_text())
    _save(d, broken)
    text = _wait_log(d, "config reload refused, nothing applied", start)
    assert "daemon.log_level" not in text
    assert "DEBUG" not in d.log_text()[start:]


def test_sighup_reloads(daemon):
    d = daemon
    _save(d, _render(d.base, seqs=2, mode="0600", engine_extra='write_policy = "write_back"'))
    _wait_log(d, "config reload", len(d.log_text()) - 1)
    time.sleep(0.5)  # let the watch's reload of that save finish first
    start = len(d.log_text())
    os.kill(d.pid(), signal.SIGHUP)
    text = _wait_log(d, "config reload (SIGHUP)", start)
    text = _wait_log(d, "config reload: no change", start)
    assert "refused" not in text
    assert d.proc.poll() is None


# -- in process ------------------------------------------------------------------------------


def test_daemon_changes_split_live_from_restart():
    old = DaemonConfig(sockets=(TenantSocket("default", "/run/p/a.sock", mode=0o660),))
    new = DaemonConfig(log_level="debug", max_message_bytes=1 << 20,
                       sockets=(TenantSocket("default", "/run/p/a.sock", mode=0o600),))
    assert daemon_changes(old, new) == (["log_level", "sockets"], ["max_message_bytes"])
    moved = DaemonConfig(sockets=(TenantSocket("default", "/run/p/b.sock", mode=0o600),))
    assert daemon_changes(old, moved) == ([], ["sockets"])


def test_every_live_daemon_key_has_an_applier():
    """``live_keys.DAEMON_LIVE_KEYS`` says what a reload applies, ``reload.DAEMON_LIVE`` how:
    a key in one and not the other would be taken live and never applied, or never taken."""
    assert sorted(DAEMON_LIVE) == sorted(DAEMON_LIVE_KEYS)


def test_apply_live_rekeys_eviction_and_sets_the_write_policy(tmp_path):
    config = EngineConfig(blocks=TierSizes(8, 16, 0), shm_dir=str(tmp_path / "shm"))
    with Engine(str(tmp_path / "state"), config) as engine:
        dc = engine.pool("default", KVLayout("m", 1, 1, 8, "float16", 4))
        for i in range(6):
            seq = dc.open(list(range(i * 10, i * 10 + 8)))
            dc.release(seq.id, commit=True).result()
        new = EngineConfig(blocks=TierSizes(8, 16, 0), shm_dir=str(tmp_path / "shm"),
                           eviction="lfu", write_policy="write_back", checkpoint_records=7)
        assert live_settings.apply_live(engine, new) == ["write_policy", "eviction",
                                                          "checkpoint_records"]
        assert all(q.policy.name == "lfu" for q in dc.cache.tree.queues)
        assert dc.cache.tiering.write_policy == "write_back" and dc.checkpoint_records == 7
        engine.check_invariants()
        for i in range(6, 12):  # evictions under the new order keep every invariant
            seq = dc.open(list(range(i * 10, i * 10 + 8)))
            dc.release(seq.id, commit=True).result()
        engine.check_invariants()
        with pytest.raises(ValueError, match="restart"):
            live_settings.apply_live(engine, EngineConfig(blocks=TierSizes(16, 16, 0),
                                                          shm_dir=str(tmp_path / "shm")))


def test_a_reload_asked_while_recovering_runs_once_serving(tmp_path):
    """The engine's settings cannot be applied to an engine still opening: the request waits."""
    import asyncio
    import types

    from prefixd.daemon.core import RECOVERING, SERVING
    from prefixd.daemon.reload import ConfigSource, Reloader

    path = tmp_path / "prefixd.toml"
    path.write_text('[daemon]\nlease_s = 4.0\n')
    core = types.SimpleNamespace(state=RECOVERING, engine=None, engine_config=EngineConfig(),
                                 config=DaemonConfig(),
                                 sessions=types.SimpleNamespace(lease_s=10.0, limits=None))

    async def walk():
        reloader = Reloader(core, ConfigSource(str(path)))
        reloader.request("SIGHUP")
        await asyncio.sleep(0.5)
        assert reloader.outcomes == [] and core.sessions.lease_s == 10.0
        core.state = SERVING
        reloader.serving()
        await asyncio.sleep(0.5)
        return reloader.outcomes

    (outcome,) = asyncio.run(walk())
    assert outcome.applied == ["daemon.lease_s"] and core.sessions.lease_s == 4.0


def test_config_watch_sees_a_save_by_rename(tmp_path):
    import asyncio

    from prefixd.daemon.config_watch import ConfigWatch

    path = tmp_path / "prefixd.toml"
    path.write_text("[daemon]\n")

    async def walk():
        seen = asyncio.Event()
        watch = ConfigWatch(str(path), asyncio.get_running_loop(), lambda reason: seen.set())
        watch.start()
        try:
            (tmp_path / "other.toml").write_text("x")  # another file: no call
            await asyncio.sleep(0.3)
            assert not seen.is_set()
            (tmp_path / "new").write_text('[daemon]\nlease_s = 4.0\n')
            os.replace(tmp_path / "new", path)
            await asyncio.wait_for(seen.wait(), 10)
        finally:
            watch.stop()

    asyncio.run(walk())
