"""The sd_notify contract, as systemd would see it: a daemon process started with
``NOTIFY_SOCKET`` (and ``WATCHDOG_USEC``) pointing at a datagram socket the test binds.

No systemd runs here: what it would do with the messages (start returns on READY, restart
when the pings stop, stop waits after STOPPING) follows from the messages themselves.
"""

from __future__ import annotations

import os
import signal
import time
import types

import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.daemon import lifecycle
from prefixd.daemon.notify import Notifier
from tests.daemon.harness import DaemonProcess
from tests.daemon.notify_listener import NotifyListener

LAYOUT = pb.KVLayout(model_id="tiny", num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float16", block_size=16)


def _commit_some(d: DaemonProcess, n: int) -> None:
    stub = d.stub()
    sid = stub.Attach(pb.AttachRequest(client_name="notify-test", layout=LAYOUT)).session_id
    for i in range(n):
        tokens = np.arange(i * 1000, i * 1000 + 48, dtype="<i4").tobytes()
        seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=tokens)).sequence
        stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id, commit=True,
                                       durability="crash"))


# -- the protocol, in process ------------------------------------------------------------------


def test_notifier_sends_one_datagram_per_message_to_a_path_and_to_an_abstract_socket():
    for abstract in (False, True):
        with NotifyListener(abstract=abstract) as listener:
            notifier = Notifier(listener.env())
            assert notifier.enabled
            assert notifier.ready("serving")
            listener.wait_for("READY", "1")
            assert listener.snapshot()[0] == {"READY": "1", "STATUS": "serving"}
            notifier.close()


def test_notifier_is_silent_without_notify_socket_and_ignores_another_pids_watchdog():
    notifier = Notifier({})
    assert not notifier.enabled and not notifier.send("READY=1")
    other = Notifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000000",
                      "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_usec == 0
    mine = Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())})
    assert mine.watchdog_usec == 1_000_000


def test_notifier_does_not_raise_when_nobody_listens():
    """A lost notification must not stop the daemon: systemd acts on what is missing."""
    notifier = Notifier({"NOTIFY_SOCKET": "/tmp/prefixd-no-such-notify-socket"})
    assert notifier.send("WATCHDOG=1") is False


def test_probe_raises_when_a_pool_log_has_failed():
    """A poisoned log acknowledges nothing more; the pings must stop so systemd restarts."""
    calls = []
    failure = RuntimeError("wal failed")
    pool = types.SimpleNamespace(
        wal=types.SimpleNamespace(failure=None),
        layout=types.SimpleNamespace(block_size=4),
        lookup=lambda tokens: calls.append(tokens))
    core = types.SimpleNamespace(engine=types.SimpleNamespace(pool_items=lambda: [(None, pool)]))
    assert lifecycle.probe(core) == 1 and calls == [[0, 0, 0, 0]]
    pool.wal.failure = failure
    with pytest.raises(RuntimeError, match="wal failed"):
        lifecycle.probe(core)


# -- a real daemon process ---------------------------------------------------------------------
# One daemon walks through the contract in order (the tests below run in file order): started
# plain, given some commits, killed with SIGKILL (no checkpoint: the restart replays the log),
# then restarted as systemd would start it, with NOTIFY_SOCKET (abstract) and WATCHDOG_USEC.

STALL = os.path.join("/tmp", f"pd-stall-{os.getpid()}")


@pytest.fixture(scope="module")
def notified():
    with NotifyListener(abstract=True) as listener, DaemonProcess() as d:
        d.start()
        _commit_some(d, 8)
        d.kill()
        d.env.update(listener.env(watchdog_usec=300_000))
        d.entry = ["-m", "tests.daemon.launcher", "--watchdog-stall", STALL]
        d.start(wait=False)
        yield d, listener


def test_status_shows_recovery_progress_before_ready(notified):
    d, listener = notified
    ready = listener.wait_for("READY", "1")
    before = [m.get("STATUS", "") for m in listener.snapshot()[:ready]]
    assert before and before[0].startswith("recovering"), before
    done = [s for s in before if s.startswith("recovered: replayed")]
    assert done, before
    replayed, total = done[-1].split()[2], done[-1].split()[4]
    assert int(replayed) == int(total) > 0, done


def test_ready_comes_once_the_socket_answers(notified):
    d, listener = notified
    listener.wait_for("READY", "1")
    with d.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert listener.count("READY") == 1
    assert listener.snapshot()[listener.wait_for("READY", "1")]["STATUS"].startswith("serving")


def test_watchdog_pings_come_while_serving(notified):
    d, listener = notified
    ready = listener.wait_for("READY", "1")
    first = listener.wait_for("WATCHDOG", "1", after=ready)
    listener.wait_for("WATCHDOG", "1", after=first + 1)


def test_watchdog_pings_stop_while_the_serving_loop_stalls_and_resume_after(notified):
    """A pinger on a timer (or a thread) would go on pinging a dead loop."""
    d, listener = notified
    listener.wait_for("WATCHDOG", "1")
    with open(STALL, "w"):
        pass  # the next probe blocks the event loop, as a hung engine call would
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(STALL + ".stalled"):  # the loop is blocked from here on
            assert time.monotonic() < deadline, "the stall never began"
            time.sleep(0.02)
        time.sleep(1.0)  # a ping sent before the stall reaches the listener meanwhile
        pings = listener.count("WATCHDOG")
        # 1.5 s is 15 periods of 0.1 s: a live loop would have pinged about 15 times
        with pytest.raises(AssertionError):
            listener.wait_for("WATCHDOG", "1", after=len(listener.snapshot()), timeout=1.5)
        assert listener.count("WATCHDOG") == pings
        assert d.proc.poll() is None
    finally:
        os.unlink(STALL)
    listener.wait_for("WATCHDOG", "1", after=len(listener.snapshot()))


def test_sigterm_says_stopping_and_exits_clean(notified):
    d, listener = notified
    ready = listener.wait_for("READY", "1")
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(60) == 0
    assert listener.wait_for("STOPPING", "1") > ready
    assert listener.count("READY") == 1
