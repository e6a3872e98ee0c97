"""The harness's own check (``DaemonProcess.close``): a test that starts a daemon fails when
the daemon logged an error in the background, exited badly at SIGTERM or died on its own,
and passes when the test declared exactly that."""

import os
import signal

import pytest

from tests.daemon.harness import DaemonCheckFailed, DaemonProcess

PLANTED = ["-m", "tests.daemon.launcher", "--background-error"]


def _wait_logged(d: DaemonProcess, needle: str) -> None:
    import time
    deadline = time.monotonic() + 60
    while needle not in d.log_text():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)


def test_an_error_logged_in_the_background_fails_the_test():
    d = DaemonProcess(entry=PLANTED).start()
    _wait_logged(d, "planted background failure")
    with pytest.raises(DaemonCheckFailed, match=r"(?s)log: ERROR asyncio.*planted background failure"):
        d.close()


def test_a_declared_error_line_passes():
    # the line the planted callback makes asyncio log, declared as a test that provokes it would
    d = DaemonProcess(entry=PLANTED, expect_log=[r"^ERROR asyncio: Exception in callback"]).start()
    _wait_logged(d, "planted background failure")
    d.close()


def test_a_bad_exit_status_at_sigterm_fails_the_test():
    d = DaemonProcess(entry=["-m", "tests.daemon.launcher", "--exit-status", "3"]).start()
    with pytest.raises(DaemonCheckFailed, match="ended at SIGTERM with status 3"):
        d.close()


def test_a_daemon_dying_on_its_own_fails_unless_declared():
    """Killed from outside the harness (as the OOM killer would): not the test's doing."""
    for declared in (False, True):
        d = DaemonProcess().start()
        if declared:
            d.expect_exit(-signal.SIGKILL)
        os.kill(d.pid(), signal.SIGKILL)
        d.proc.wait(60)
        if declared:
            d.close()
        else:
            with pytest.raises(DaemonCheckFailed, match="ended on its own with status -9"):
                d.close()


def test_a_kill_is_a_declared_end():
    d = DaemonProcess().start()
    d.kill()
    d.start()
    d.close()
