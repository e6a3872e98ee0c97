"""A real ``prefixd serve`` process for tests: a short temporary directory (Unix socket paths
hold 107 bytes; pytest's ``tmp_path`` is often longer), its own state directory and shm
directory, started and stopped like an operator would.

    with start_daemon() as d:          # waits until health says SERVING
        stub = d.stub()                # raw PrefixCacheStub on d.socket
        d.kill()                       # SIGKILL
        d.restart()                    # same state, same socket
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import grpc
from prefixd.tools.daemon_proc import wait_serving

from prefixd.api import prefixd_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


class DaemonProcess:
    """One daemon process over ``base/state``, listening on ``base/s.sock`` (tenant sockets of
    other tenants sit beside it)."""

    def __init__(self, config: str | None = None, *, lease_s: float = 3.0,
                 base: str | None = None, env: dict | None = None) -> None:
        self.base = base or tempfile.mkdtemp(prefix="pd-", dir="/tmp")
        self.state_dir = os.path.join(self.base, "state")
        self.shm_dir = os.path.join(self.base, "shm")
        self.socket = os.path.join(self.base, "run", "s.sock")
        self.log_path = os.path.join(self.base, "daemon.log")
        os.makedirs(self.shm_dir, exist_ok=True)
        self.config_path = os.path.join(self.base, "prefixd.toml")
        with open(self.config_path, "w") as f:
            f.write((config or DEFAULT_CONFIG).format(shm=self.shm_dir, lease_s=lease_s,
                                                      base=self.base))
        self.env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._channels: list[grpc.Channel] = []

    # -- process -------------------------------------------------------------------------------

    def start(self, *, wait: bool = True, timeout: float = 90.0) -> "DaemonProcess":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefixd.daemon.cli", "serve", "--config", self.config_path,
             "--state-dir", self.state_dir, "--socket", self.socket],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        if wait:
            self.wait_serving(timeout)
        return self

    def wait_serving(self, timeout: float = 90.0) -> None:
        """Until health says SERVING; raises DaemonFailed (a RuntimeError) with the daemon's
        log if it exits or times out."""
        wait_serving(self.proc, self.socket, timeout, self.log)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def restart(self, **kw) -> "DaemonProcess":
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        return self.start(**kw)

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-20000:]
        except OSError:
            return ""

    def pid(self) -> int:
        return self.proc.pid

    # -- clients -------------------------------------------------------------------------------

    def channel(self, socket: str | None = None) -> grpc.Channel:
        ch = grpc.insecure_channel("unix:" + (socket or self.socket),
                                   options=[("grpc.max_receive_message_length", 64 << 20),
                                            ("grpc.max_send_message_length", 64 << 20)])
        self._channels.append(ch)
        return ch

    def stub(self, socket: str | None = None) -> pb_grpc.PrefixCacheStub:
        return pb_grpc.PrefixCacheStub(self.channel(socket))

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.stop(30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "DaemonProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_daemon(config: str | None = None, **kw) -> DaemonProcess:
    """A started daemon (see ``DaemonProcess``); use it as a context manager."""
    return DaemonProcess(config, **kw).start()
