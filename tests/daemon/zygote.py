"""Processes forked from a zygote (``tests.daemon.gsp_load zygote``) that imported the daemon
once: a start costs the daemon's own start and recovery, not an interpreter importing torch
(2.5 s of CPU a start on the 2-core host; the suite starts a daemon hundreds of times).

One zygote serves every daemon of the test process that runs with the same environment
(``zygote_for``); it ends when the test process does (``atexit``).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time

from prefixd.tools.daemon_proc import ROOT


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


class Zygote:
    """One ``gsp_load zygote`` process: ``spawn`` forks a daemon from it."""

    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.daemon.gsp_load", "zygote"],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, log_path: str, argv: list[str]) -> Forked:
        """A daemon running ``prefixd serve`` with ``argv``, its output appended to
        ``log_path`` and its exit status written beside it."""
        self.proc.stdin.write(json.dumps([log_path] + argv) + "\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        return Forked(pid, os.path.join(os.path.dirname(log_path), f"exit-{pid}"))

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


# pytest names the running test in the environment: not a difference a daemon sees
_IGNORED = frozenset({"PYTEST_CURRENT_TEST"})
_KEEP = 2  # zygotes kept at once (each holds an imported torch: ~250 MB)
_zygotes: dict[frozenset, Zygote] = {}  # least recently used first


def zygote_for(env: dict) -> Zygote:
    """The test process's zygote for daemons with environment ``env`` (started at first use;
    the least recently used one ends when a third environment comes)."""
    key = frozenset((k, v) for k, v in env.items() if k not in _IGNORED)
    z = _zygotes.pop(key, None)
    if z is None or not z.alive():
        z = Zygote(env)
    _zygotes[key] = z
    while len(_zygotes) > _KEEP:
        _zygotes.pop(next(iter(_zygotes))).close()
    return z


@atexit.register
def _close_zygotes() -> None:
    for z in _zygotes.values():
        z.close()
    _zygotes.clear()
