"""A real ``prefixd serve`` process for tests (``prefixd.tools.daemon_proc.DaemonProc``, the
one helper that starts a daemon) that ends by checking what the daemon said: a short
temporary directory (Unix socket paths hold 107 bytes; pytest's ``tmp_path`` is often longer),
its own state directory and shm directory, started and stopped like an operator would.

    with start_daemon() as d:          # waits until health says SERVING
        stub = d.stub()                # raw PrefixCacheStub on d.socket
        d.kill()                       # SIGKILL: declared by calling it
        d.restart()                    # same state, same socket
    # leaving the block stops the daemon and fails the test unless every SIGTERM got exit 0,
    # no run died on its own, and the log holds no ERROR line or traceback

A test that provokes an error line declares it (``expect_log=[regex, ...]`` or
``d.expect_log(regex)``), with a comment saying why the daemon is right to log it; one whose
daemon is meant to exit by itself declares the status (``d.expect_exit(status)``).

A daemon given no environment and no entry of its own is forked from a zygote that imported
the daemon once (``tests.daemon.zygote``): the same ``prefixd serve`` from ``cli.main`` on,
without torch's import at every start. ``fork=False`` (or ``PREFIXD_TEST_FORK=0`` for the whole
run) starts a fresh interpreter instead, as ``prefixd.tools.daemon_proc`` always does.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import grpc

from prefixd.api import prefixd_pb2_grpc as pb_grpc
from prefixd.tools.daemon_proc import ROOT, DaemonProc, unexpected_lines

__all__ = ["DEFAULT_CONFIG", "METRICS_CONFIG", "ROOT", "DaemonCheckFailed", "DaemonProcess",
           "start_daemon", "two_tenant_config"]

DEFAULT_CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"
reclaim_grace_s = 30.0

[engine.blocks]
device = 256
host = 1024
disk = 4096

[daemon]
lease_s = {lease_s}
"""

# a small daemon with its metrics endpoint on ``base/m.sock`` (8 device blocks: evictions soon)
METRICS_CONFIG = """
[engine]
shm_dir = "{shm}"

[engine.blocks]
device = 8
host = 16
disk = 64

[daemon]
lease_s = {lease_s}

[daemon.metrics]
listen = "unix:{base}/m.sock"
"""


def two_tenant_config(*, device: int, host: int, disk: int, tables: str = "") -> str:
    """A config template (over ``shm``, ``base`` and ``lease_s``, as ``DaemonProcess`` takes it)
    for a daemon with two tenants, ``alpha`` and ``beta``, each with a salt of its own: alpha
    serves on ``base/run/s.sock`` (the first tenant's socket) and beta on ``beta.sock`` beside it,
    unless ``tables`` says otherwise.

    Args:
        device, host, disk: the blocks of each tier (``[engine.blocks]``).
        tables: more TOML after ``[daemon]``'s ``lease_s`` (``[daemon.*]`` tables, with the
            same fields to fill in).
    """
    return f"""
[engine]
sync = "commit"
shm_dir = "{{shm}}"

[engine.blocks]
device = {device}
host = {host}
disk = {disk}

[[engine.tenants]]
name = "alpha"
salt = "salt-of-alpha"

[[engine.tenants]]
name = "beta"
salt = "salt-of-beta"

[daemon]
lease_s = {{lease_s}}
""" + tables


class DaemonCheckFailed(AssertionError):
    """The daemon exited badly or logged what a clean run does not (the message says what)."""


class DaemonProcess(DaemonProc):
    """One daemon process over ``base/state``, listening on ``base/run/s.sock`` (tenant
    sockets of other tenants sit beside it); ``close`` checks its exits and its log.

    ``exit_status_known``: False where the child's status cannot be read (a daemon forked by
    a zygote that reaps it); its log is checked all the same.
    ``fork``: fork each start from a zygote (None: where ``env`` and ``entry`` are the defaults).
    """

    exit_status_known = True

    def __init__(self, config: str | None = None, *, lease_s: float = 3.0,
                 base: str | None = None, env: dict | None = None,
                 expect_log: list[str] = (), entry: list[str] | None = None,
                 fork: bool | None = None) -> None:
        super().__init__(base or tempfile.mkdtemp(prefix="pd-", dir="/tmp"),
                         config=config or DEFAULT_CONFIG, lease_s=lease_s, env=env, entry=entry)
        self._fork = fork
        self._plain = (dict(self.env), list(self.entry)) if env is None and entry is None else None
        self.allowed_log = [re.compile(p) for p in expect_log]
        self.allowed_exits: set[int] = set()
        self._channels: list[grpc.Channel] = []

    # -- process -------------------------------------------------------------------------------

    def forks(self) -> bool:
        """Whether the next start forks: as ``fork`` says, else where the test changed neither
        the environment nor the entry (a fixture may, between two starts)."""
        if os.environ.get("PREFIXD_TEST_FORK", "1") == "0":
            return False
        if self._fork is not None:
            return self._fork
        return self._plain is not None and (self.env, self.entry) == self._plain

    def spawn(self, log):
        if not self.forks():
            return super().spawn(log)
        from tests.daemon.zygote import zygote_for

        return zygote_for(self.env).spawn(self.log_path, self.serve_args())

    def start(self, *, wait: bool = True, timeout: float = 90.0) -> "DaemonProcess":
        self.launch()
        if wait:
            self.wait_serving(timeout)
        return self

    def kill(self) -> None:
        """SIGKILL and reap (the test means it: the check skips this run's exit status)."""
        self.kill9()

    def restart(self, **kw) -> "DaemonProcess":
        if self.running():
            self.stop()
        return self.start(**kw)

    def log(self) -> str:
        return self.log_tail(20000)

    # -- what the test expects -----------------------------------------------------------------

    def expect_log(self, *patterns: str) -> None:
        """Allow log lines an ERROR/traceback check would fail on (``re.search``)."""
        self.allowed_log.extend(re.compile(p) for p in patterns)

    def expect_exit(self, *statuses: int) -> None:
        """Allow runs that end (on their own or at SIGTERM) with one of ``statuses``."""
        self.allowed_exits.update(statuses)

    def start_refused(self, timeout: float = 120.0) -> str:
        """Start a daemon whose start must be refused: it exits 1 with a ``not starting:`` line
        and no traceback; returns its log. The caller still closes it."""
        self.expect_exit(1)  # the refusal is the behaviour under test
        self.expect_log(r"not starting:")
        self.start(wait=False)
        assert self.proc.wait(timeout) == 1
        log = self.log()
        assert "not starting:" in log and "Traceback" not in log, log
        return log

    def problems(self) -> list[str]:
        """What the check fails on: bad exits and unexpected log lines."""
        found = []
        for how, status in self.exits:
            if how == "kill" or status == 0 or status in self.allowed_exits:
                continue
            if how == "term" and not self.exit_status_known:
                continue
            found.append(f"a run ended {'at SIGTERM' if how == 'term' else 'on its own'} "
                         f"with status {status}")
        found += [f"log: {line[:600]}" for line in unexpected_lines(self.log_text(), self.allowed_log)]
        return found

    def check(self) -> None:
        """Raises DaemonCheckFailed naming every problem (with the log's tail)."""
        found = self.problems()
        if found:
            raise DaemonCheckFailed("the daemon " + "; ".join(found[:20])
                                    + f"\n--- daemon log (tail) ---\n{self.log_tail(6000)}")

    # -- clients -------------------------------------------------------------------------------

    def channel(self, socket: str | None = None) -> grpc.Channel:
        ch = grpc.insecure_channel("unix:" + (socket or self.socket),
                                   options=[("grpc.max_receive_message_length", 64 << 20),
                                            ("grpc.max_send_message_length", 64 << 20)])
        self._channels.append(ch)
        return ch

    def stub(self, socket: str | None = None) -> pb_grpc.PrefixCacheStub:
        return pb_grpc.PrefixCacheStub(self.channel(socket))

    def close(self, check: bool = True) -> None:
        """Close the channels, SIGTERM a daemon still running, then (``check``) fail unless
        every run ended as the test declared and the log is clean; the directory goes either
        way."""
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        try:
            if self.running():
                self.stop(60)
            self.kill9()  # nothing runs now; records a run that ended on its own
            if check:
                self.check()
        finally:
            self.kill9()
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "DaemonProcess":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(check=exc_type is None)  # a failing test's own error says more


def start_daemon(config: str | None = None, **kw) -> DaemonProcess:
    """A started daemon (see ``DaemonProcess``); use it as a context manager."""
    return DaemonProcess(config, **kw).start()
