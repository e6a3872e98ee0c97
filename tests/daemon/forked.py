"""``ForkedDaemon``: a test daemon that is always a fork of a zygote (``tests.daemon.zygote``),
even with an environment of its own (a crash point), for the suites that restart the daemon
tens or hundreds of times (kill -9, SIGTERM with calls in flight)."""

from __future__ import annotations

from tests.daemon.harness import DaemonProcess
from tests.daemon.zygote import Forked  # noqa: F401 - the kill -9 suite's load clients


class ForkedDaemon(DaemonProcess):
    """A ``DaemonProcess`` whose every start is a fork of a zygote, whatever its environment
    (``DaemonProcess`` forks only where it was given none of its own)."""

    def forks(self) -> bool:
        return True  # the suites that use it restart too often for a fresh interpreter each time
