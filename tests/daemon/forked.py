"""Daemons forked from one zygote (``tests.daemon.gsp_load zygote``) that imported the daemon
once: a restart costs the daemon's recovery, not torch's import (the suites that restart it
tens or hundreds of times: kill -9, SIGTERM with calls in flight)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.daemon.harness import ROOT, DaemonProcess


class Forked:
    """A process forked by a zygote: the part of ``Popen`` the harness uses. With
    ``status_path`` (a daemon: its waiter writes the file once it reaped it) it has ended
    when the file exists, and the file holds its status; without (a load client, reaped by
    the kernel) it has ended when its pid is gone, status unknown (-1)."""

    def __init__(self, pid: int, status_path: str | None = None) -> None:
        self.pid = pid
        self.status_path = status_path
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            if self.status_path is not None:
                try:
                    with open(self.status_path) as f:
                        self.returncode = int(f.read())
                except FileNotFoundError:
                    pass
            else:
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    self.returncode = -1
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # reaped, its status not written yet

    def wait(self, timeout: float | None = None):
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"daemon {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode


class ForkedDaemon(DaemonProcess):
    """A ``DaemonProcess`` whose every start is a fork of one zygote that imported the daemon
    once (``gsp_load.zygote``): a restart costs the daemon's recovery, not torch's import."""

    zygote: subprocess.Popen | None = None

    def spawn(self, log) -> Forked:
        if self.zygote is None:
            self.zygote = subprocess.Popen(
                [sys.executable, "-m", "tests.daemon.gsp_load", "zygote"], cwd=ROOT, env=self.env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.zygote.stdin.write(json.dumps([self.log_path] + self.serve_args()) + "\n")
        self.zygote.stdin.flush()
        pid = int(self.zygote.stdout.readline())
        return Forked(pid, os.path.join(os.path.dirname(self.log_path), f"exit-{pid}"))

    def close(self, check: bool = True) -> None:
        super().close(check)
        if self.zygote is not None:
            self.zygote.stdin.close()
            self.zygote.wait(30)
