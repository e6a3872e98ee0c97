"""A ``prefixd serve`` child process for the demo and the end-to-end bench.

    with DaemonProc.temporary(device=1024) as d:   # own state dir, shm dir and socket under /tmp
        d.start()                                  # returns once health says SERVING
        session = connect(d.socket, layout)
        d.kill9()                                  # SIGKILL, reaped
        d.start()                                  # same state, same socket: recovery
        d.stop()                                   # SIGTERM, clean shutdown; returns the status

The tests keep their own harness (``tests/daemon/harness.py``); this one is for programs a
user runs, so it lives in the package and imports nothing of the daemon's (it starts
``python -m prefixd.daemon.cli`` as an operator would).

NOTE: the base directory is short and under /tmp because a Unix socket path holds at most 107
bytes; ``keep=True`` leaves it behind for a post-mortem (the daemon's log is ``daemon.log``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"
reclaim_grace_s = 30.0

[engine.blocks]
device = {device}
host = {host}
disk = {disk}

[daemon]
lease_s = {lease_s}
"""


class DaemonFailed(RuntimeError):
    """The daemon exited or did not serve in time; the message ends with its log's tail."""


class DaemonProc:
    """One daemon over ``base/state`` on ``base/run/s.sock``.

    Invariant: at most one child process at a time (``start`` refuses while one runs), so a
    ``kill9`` + ``start`` pair is exactly a crash and a restart over the same state.
    """

    def __init__(self, base: str, *, device: int = 1024, host: int = 1024, disk: int = 4096,
                 lease_s: float = 10.0, keep: bool = False) -> None:
        self.base = base
        self.keep = keep
        self.state_dir = os.path.join(base, "state")
        self.shm_dir = os.path.join(base, "shm")
        self.socket = os.path.join(base, "run", "s.sock")
        self.log_path = os.path.join(base, "daemon.log")
        self.config_path = os.path.join(base, "prefixd.toml")
        os.makedirs(self.shm_dir, exist_ok=True)
        with open(self.config_path, "w") as f:
            f.write(CONFIG.format(shm=self.shm_dir, device=device, host=host, disk=disk, lease_s=lease_s))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.environ.get("PYTHONPATH")
        self._env = dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""))
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @classmethod
    def temporary(cls, **kw) -> "DaemonProc":
        return cls(tempfile.mkdtemp(prefix="prefixd-", dir="/tmp"), **kw)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 120.0) -> float:
        """Start the daemon and wait until it serves; returns the seconds that took.

        Raises:
            DaemonFailed: it exited or did not serve within ``timeout``.
        """
        if self.running():
            raise DaemonFailed(f"daemon pid {self.proc.pid} still runs: stop or kill9 it first")
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefixd.daemon.cli", "serve", "--config", self.config_path,
                 "--state-dir", self.state_dir, "--socket", self.socket],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env)
        self.starts += 1
        wait_serving(self.proc, self.socket, timeout - (time.perf_counter() - t0), self.log_tail)
        return time.perf_counter() - t0

    def kill9(self) -> None:
        """SIGKILL, as a crash would, and reap."""
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (a clean shutdown); returns the exit status (0 when clean)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise DaemonFailed(f"daemon did not stop within {timeout} s of SIGTERM (killed):\n"
                               + self.log_tail()) from None

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        """Kill a daemon still running and remove the directory (unless ``keep``)."""
        self.kill9()
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "DaemonProc":
        return self

    def __exit__(self, *exc) -> None:
        self.close()



def wait_serving(proc: subprocess.Popen, socket: str, timeout: float, log_tail: Callable[[], str]) -> None:
    """Return once the daemon ``proc`` answers SERVING on ``socket``. The one wait of the
    demo's daemon, the benchmarks' and the test harness's.

    Raises:
        DaemonFailed: ``proc`` exited first, or ``timeout`` seconds passed; the message ends
            with ``log_tail()`` (the daemon's log).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DaemonFailed(f"daemon exited with {proc.returncode}:\n{log_tail()}")
        if answers_serving(socket):
            return
        time.sleep(0.05)
    raise DaemonFailed(f"daemon not serving after {timeout:g} s:\n{log_tail()}")


def answers_serving(socket: str, timeout: float = 1.0) -> bool:
    """One health check on ``socket``: True once the daemon says SERVING (False while the
    socket is missing, refuses, or the daemon is still recovering). The one probe the demo,
    the benchmarks and the test harness wait on."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if not os.path.exists(socket):
        return False
    try:
        with grpc.insecure_channel("unix:" + socket) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
