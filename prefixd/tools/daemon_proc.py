"""A ``prefixd serve`` child process: the one helper the demo, the benchmarks and the test
harness start a daemon with.

    with DaemonProc.temporary(device=1024) as d:   # own state dir, shm dir and socket under /tmp
        d.start()                                  # returns once health says SERVING
        session = connect(d.socket, layout)
        d.kill9()                                  # SIGKILL, reaped
        d.start()                                  # same state, same socket: recovery
        d.stop()                                   # SIGTERM, clean shutdown; returns the status
    d.exits                                        # [("kill", -9), ("term", 0)]: how each run ended
    unexpected_lines(d.log_text())                 # ERROR lines and tracebacks of every run

It lives in the package and imports nothing of the daemon's: it starts
``python -m prefixd.daemon.cli`` as an operator would (or ``entry``: a wrapper of the daemon's
``main``, as a test's launcher or a profiler). The test harness (``tests/daemon/harness.py``)
adds the checks a test ends with: every SIGTERM answered by exit 0, and a log free of
unexpected ERROR lines and tracebacks.

NOTE: the base directory is short and under /tmp because a Unix socket path holds at most 107
bytes; ``keep=True`` leaves it behind for a post-mortem (the daemon's log is ``daemon.log``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ``sync`` and ``engine_tables`` (more ``[engine.*]`` tables, such as a model's own pool
# sizes) come from ``fields``, defaulting to ``CONFIG_DEFAULTS``
CONFIG = """
[engine]
sync = "{sync}"
shm_dir = "{shm}"
reclaim_grace_s = 30.0

[engine.blocks]
device = {device}
host = {host}
disk = {disk}
{engine_tables}
[daemon]
lease_s = {lease_s}
"""
CONFIG_DEFAULTS = {"sync": "commit", "engine_tables": ""}

# what no clean run of the daemon prints: an ERROR/CRITICAL record (``daemon/logs.py`` puts
# the level first), a traceback (logged or raw on stderr), an exception Python could not
# raise, an interpreter abort, or an error line of gRPC's C core (``E1206 12:00:00.000 ...``)
_BAD_LINE = re.compile(r"^(ERROR|CRITICAL) |Traceback \(most recent call last\)|^Exception ignored"
                       r"|^Fatal Python error|^E\d{4} \d\d:\d\d:\d\d")


class DaemonFailed(RuntimeError):
    """The daemon exited or did not serve in time; the message ends with its log's tail."""


class DaemonProc:
    """One daemon over ``base/state`` on ``base/run/s.sock``.

    Args:
        base: the directory of its state, shm pools (unless ``shm_dir``), socket, config and log.
        config: the TOML text, a ``str.format`` template over ``shm``, ``base``, ``device``,
            ``host``, ``disk``, ``lease_s`` and ``fields``; None: ``CONFIG`` (its ``sync`` and
            ``engine_tables`` fields default to ``CONFIG_DEFAULTS``).
        env: more environment variables for the daemon (``PYTHONPATH`` leads with the
            package's checkout either way).
        entry: what follows the interpreter instead of ``-m prefixd.daemon.cli``.
        preexec_fn: run in the child before it executes (a CPU affinity).

    Invariant: at most one child process at a time (``start`` refuses while one runs), so a
    ``kill9`` + ``start`` pair is exactly a crash and a restart over the same state; every
    run's end is recorded in ``exits`` as ``(how, status)``: ``"term"`` (``stop``),
    ``"kill"`` (``kill9``) or ``"self"`` (it exited on its own).
    """

    def __init__(self, base: str, *, config: str | None = None, device: int = 1024,
                 host: int = 1024, disk: int = 4096, lease_s: float = 10.0, keep: bool = False,
                 env: dict | None = None, entry: list[str] | None = None,
                 shm_dir: str | None = None, fields: dict | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.base = base
        self.keep = keep
        self.state_dir = os.path.join(base, "state")
        self.shm_dir = shm_dir or os.path.join(base, "shm")
        self.socket = os.path.join(base, "run", "s.sock")
        self.log_path = os.path.join(base, "daemon.log")
        self.config_path = os.path.join(base, "prefixd.toml")
        os.makedirs(self.shm_dir, exist_ok=True)
        with open(self.config_path, "w") as f:
            f.write((config or CONFIG).format(shm=self.shm_dir, base=base, device=device, host=host,
                                              disk=disk, lease_s=lease_s,
                                              **{**CONFIG_DEFAULTS, **(fields or {})}))
        path = os.environ.get("PYTHONPATH")
        self.env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + path if path else ""),
                        **(env or {}))
        self.entry = list(entry or ["-m", "prefixd.daemon.cli"])
        self.preexec_fn = preexec_fn
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.exits: list[tuple[str, int]] = []
        self._ended = True  # the current ``proc``'s end is in ``exits``

    @classmethod
    def temporary(cls, **kw) -> "DaemonProc":
        return cls(tempfile.mkdtemp(prefix="prefixd-", dir="/tmp"), **kw)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pid(self) -> int:
        return self.proc.pid

    def serve_args(self) -> list[str]:
        """The daemon's command line after its entry: ``serve --config ... --socket ...``."""
        return ["serve", "--config", self.config_path, "--state-dir", self.state_dir,
                "--socket", self.socket]

    def argv(self) -> list[str]:
        return [sys.executable, *self.entry, *self.serve_args()]

    def launch(self) -> None:
        """Start the child without waiting for it to serve.

        Raises:
            DaemonFailed: a child still runs.
        """
        if self.running():
            raise DaemonFailed(f"daemon pid {self.proc.pid} still runs: stop or kill9 it first")
        self._record("self")
        with open(self.log_path, "ab") as log:
            self.proc = self.spawn(log)
        self._ended = False
        self.starts += 1

    def spawn(self, log) -> subprocess.Popen:
        """The child process, its stdout and stderr on ``log`` (a subclass may fork it from
        elsewhere: it returns an object with Popen's ``pid``, ``poll``, ``wait``,
        ``send_signal`` and ``returncode``)."""
        return subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env, cwd=ROOT,
                                preexec_fn=self.preexec_fn)

    def start(self, timeout: float = 120.0) -> float:
        """Start the daemon and wait until it serves; returns the seconds that took.

        Raises:
            DaemonFailed: a child still runs, or it exited or did not serve within ``timeout``.
        """
        t0 = time.perf_counter()
        self.launch()
        self.wait_serving(timeout - (time.perf_counter() - t0))
        return time.perf_counter() - t0

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Until health says SERVING (``wait_serving``)."""
        wait_serving(self.proc, self.socket, timeout, self.log_tail)

    def kill9(self) -> None:
        """SIGKILL, as a crash would, and reap."""
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
            self._record("kill")
        self._record("self")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (a clean shutdown); returns the exit status (0 when clean).

        Raises:
            DaemonFailed: it did not stop within ``timeout`` (it is killed).
        """
        if self.proc is None:
            return 0
        if self.proc.poll() is not None:
            self._record("self")
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise DaemonFailed(f"daemon did not stop within {timeout} s of SIGTERM (killed):\n"
                               + self.log_tail()) from None
        self._record("term")
        return status

    def _record(self, how: str) -> None:
        if self.proc is not None and not self._ended and self.proc.poll() is not None:
            self.exits.append((how, self.proc.returncode))
            self._ended = True

    def log_text(self) -> str:
        """The whole log of every run (empty when there is none yet)."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:]

    def close(self) -> None:
        """Kill a daemon still running and remove the directory (unless ``keep``)."""
        self.kill9()
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "DaemonProc":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unexpected_lines(log: str, allowed: Iterable[re.Pattern | str] = ()) -> list[str]:
    """The lines of a daemon's ``log`` that no clean run prints (``_BAD_LINE``: ERROR and
    CRITICAL records, tracebacks, ...), less those an ``allowed`` pattern finds (``re.search``)."""
    patterns = [re.compile(p) if isinstance(p, str) else p for p in allowed]
    return [line for line in log.splitlines()
            if _BAD_LINE.search(line) and not any(p.search(line) for p in patterns)]


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
