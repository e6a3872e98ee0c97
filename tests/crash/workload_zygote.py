"""A zygote for ``tests.crash.prefixd_workload`` children: the kill -9 and crash-point tests
start every child as a fork of one process that imported the workload (torch, the engine)
once, instead of a fresh interpreter.

    python -m tests.crash.workload_zygote     (one JSON request per stdin line)

A request is ``{"argv": [...], "env": {...}, "stderr": PATH}``: the zygote forks a child that
sets ``env`` (and arms its ``PREFIXD_CRASH`` crash points), sends its stdout to /dev/null and
its stderr to ``PATH``, and runs ``prefixd_workload.main(argv)``. The zygote prints the child's
pid, waits for it, then prints its exit status as ``subprocess`` gives it (``-9`` for a
SIGKILL, 77 for a crash point). One child at a time. The forked child is the workload: only
the imports came before the fork, and no engine, thread or file of it exists in the zygote.

NOTE: a fresh interpreter importing torch took ~2-3 s of the loaded 2-core host per child,
and ``test_kill9.py`` starts ~50 children in ``make test``.

``WorkloadZygote`` (the test side) starts one and hands out ``ZygoteChild`` handles, which do
the part of ``subprocess.Popen`` the tests use: ``pid``, ``poll``, ``send_signal``, ``wait``,
``communicate`` (stderr from the file) and ``returncode``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkloadZygote:
    """One zygote process; ``spawn`` forks a workload child from it (one alive at a time)."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("PREFIXD_CRASH", None)  # armed per child
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.crash.workload_zygote"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buf = b""

    def spawn(self, argv: list[str], stderr_path: str, env_extra: dict | None = None) -> "ZygoteChild":
        request = {"argv": [str(a) for a in argv], "env": env_extra or {}, "stderr": str(stderr_path)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        line = self.read_line(60.0)
        if line is None:
            raise TimeoutError("the workload zygote did not fork a child within 60 s")
        return ZygoteChild(self, int(line), str(stderr_path))

    def read_line(self, timeout: float | None) -> bytes | None:
        """The zygote's next line, or None when none came within ``timeout`` (0: a poll)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the workload zygote exited (status {self.proc.wait()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ZygoteChild:
    """A workload child forked by the zygote: what the tests use of ``subprocess.Popen``."""

    def __init__(self, zygote: WorkloadZygote, pid: int, stderr_path: str) -> None:
        self._zygote = zygote
        self.pid = pid
        self.stderr_path = stderr_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._status(0.0)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        status = self._status(timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"workload child {self.pid}", timeout)
        return status

    def communicate(self, timeout: float | None = None) -> tuple[None, bytes]:
        self.wait(timeout)
        with open(self.stderr_path, "rb") as f:
            return None, f.read()

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._zygote.read_line(timeout)
            if line is not None:
                self.returncode = int(line)
        return self.returncode


def _serve() -> None:
    """The zygote: import once, then fork, report the pid, reap, report the status."""
    from prefixd import crashpoints
    from tests.crash import prefixd_workload  # torch, numpy, lmdb, the engine: once

    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(request["env"])
                crashpoints.arm(request["env"].get("PREFIXD_CRASH", ""))
                err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(err, 2)
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                prefixd_workload.main(request["argv"])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - reported through stderr and the status
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        out.write(f"{pid}\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(f"{os.waitstatus_to_exitcode(status)}\n")
        out.flush()


if __name__ == "__main__":
    _serve()
