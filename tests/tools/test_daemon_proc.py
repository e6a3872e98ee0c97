"""``prefixd.tools.daemon_proc``: the daemon child the demo and bench/e2e.py crash and restart."""

import pytest

from prefixd.tools.daemon_proc import DaemonFailed, DaemonProc


def test_kill9_then_start_serves_again_on_the_same_state_and_stop_is_clean():
    with DaemonProc.temporary(device=16, host=16, disk=16) as d:
        d.start()
        with pytest.raises(DaemonFailed, match="still runs"):
            d.start()  # one child at a time: a second start would not be a restart
        first = d.proc.pid
        d.kill9()
        assert not d.running()
        d.start()
        assert d.proc.pid != first and d.starts == 2
        assert d.stop() == 0


def test_wait_serving_names_an_exit_and_a_timeout_with_the_log(tmp_path):
    """The one wait of the demo, the benches and the test harness: a child that exits says its
    status, one that never serves says the timeout; both end with the log it was given."""
    import subprocess
    import sys

    from prefixd.tools.daemon_proc import wait_serving

    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait()
    with pytest.raises(DaemonFailed, match=r"(?s)exited with 3:\nthe log"):
        wait_serving(gone, str(tmp_path / "none.sock"), 5.0, lambda: "the log")
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(DaemonFailed, match=r"(?s)not serving after 0.2 s:\nthe log"):
            wait_serving(silent, str(tmp_path / "none.sock"), 0.2, lambda: "the log")
    finally:
        silent.kill()
        silent.wait()


def test_unexpected_lines_finds_errors_and_tracebacks_less_the_allowed():
    from prefixd.tools.daemon_proc import unexpected_lines

    log = "\n".join([
        "INFO prefixd.daemon.server: serving pools=1",
        "WARNING prefixd.engine: a pool is small",
        "ERROR prefixd.daemon.server: checkpoint at stop failed error=OSError()",
        "INFO x: handled | Traceback (most recent call last): |   File ...",
        "CRITICAL prefixd: out of memory",
        "Exception ignored in: <function Server.__del__>",
        "E1206 20:51:02.123456   123 server.cc:42] bad thing",
        "INFO prefixd.daemon: the word ERROR inside a message is fine",
    ])
    assert unexpected_lines(log) == [log.splitlines()[i] for i in (2, 3, 4, 5, 6)]
    assert unexpected_lines(log, [r"checkpoint at stop failed", "^CRITICAL"]) == \
        [log.splitlines()[i] for i in (3, 5, 6)]


def test_exits_record_how_each_run_ended():
    with DaemonProc.temporary(device=16, host=16, disk=16) as d:
        d.start()
        d.kill9()
        d.start()
        assert d.stop() == 0
    assert d.exits == [("kill", -9), ("term", 0)]
