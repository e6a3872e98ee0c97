"""The zygote: a process that imported the daemon once and forks each test daemon from there,
so that a start costs the daemon's own start and recovery, not an interpreter importing torch
(2.5 s of CPU a start on the 2-core host; the suite starts a daemon hundreds of times).

    python -m tests.daemon.zygote      (forks a ``prefixd serve`` per stdin line)

Both sides live here: ``serve_forks`` is the zygote process's own loop, and ``Zygote`` /
``Forked`` are the test process's handles on it and on the daemons it forked. One zygote serves
every daemon of the test process that runs with the same environment (``zygote_for``); it ends
when the test process does (``atexit``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import traceback

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
    """One zygote process (``serve_forks``): ``spawn`` forks a daemon from it."""

    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.daemon.zygote"],
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


# -- the zygote process -------------------------------------------------------------------------

def _serve_forked(cli, log_path: str, argv: list[str]) -> int:
    """``prefixd serve`` in a forked child, as a fresh interpreter would run it: stdin from
    /dev/null, stdout and stderr appended to ``log_path``, a traceback printed and status 1 on
    an exception, ``sys.exit``'s status kept; returns the status for ``os._exit``."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(null)
        os.close(fd)
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to say
                pass
    return code


def serve_forks() -> None:
    """Import the daemon once, then fork one ``prefixd serve`` per stdin line (a JSON list:
    the log path, then the command's arguments) and print its pid.

    NOTE: the kill -9 suite restarts the daemon ten times; a fresh interpreter importing torch
    takes 4-11 s of a loaded 2-core host each time, a fork takes milliseconds. The forked child
    is the daemon (its recovery, its sockets, its engine): only the imports came before the
    fork, and no channel, server, loop or engine exists in this process. Each daemon is the
    child of a waiter forked for it, which writes the daemon's exit status (as Popen's
    ``returncode``) to ``exit-<pid>`` beside its log once it is reaped.
    """
    import gc

    import prefixd.daemon.server  # noqa: F401 - torch, grpc and the engine, once
    from prefixd.daemon import cli

    # the imports, frozen here once: each daemon's start-up collection (collector.py) then
    # walks only its own objects, not the 180k it inherits (0.15 s of each start)
    gc.collect()
    gc.freeze()

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        log_path, *argv = json.loads(line)
        if os.fork() == 0:  # a waiter, reaped by the kernel: it waits for the daemon
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                os._exit(_serve_forked(cli, log_path, argv))
            print(pid, flush=True)
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            with open(os.path.join(os.path.dirname(log_path), f"exit-{pid}.tmp"), "w") as f:
                f.write(str(status))
            os.rename(f.name, f.name[:-4])  # appears whole
            os._exit(0)


if __name__ == "__main__":
    serve_forks()
