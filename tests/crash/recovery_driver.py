"""Recovery of damaged state directories away from pytest: a driver interpreter, a forked child
per directory.

A damaged state directory may kill whatever recovers it with a signal (a damaged LMDB file
SIGSEGVs or SIGBUSes its reader), and that must not kill the test run. So a suite damages its
directories, then runs its own module as a driver in a fresh interpreter (`run_driver`: one
interpreter start, and so one import of torch, for a whole table); the driver recovers each
directory in a forked child (`recover_in_child`) and prints one JSON line mapping each
directory's name to what its child returned, ``{"died": exit code, "stderr": tail}`` or
``{"hung": seconds}``.

Used by ``test_corruption_lmdb`` and ``test_bitflip_fuzz``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]


def run_driver(module: str, args: list[str], timeout_s: float) -> dict:
    """Run ``python -m module *args`` with the repository importable and no crash point armed.

    Returns:
        The JSON object the driver printed last.

    Raises:
        AssertionError: the driver exited non-zero (its stderr's tail in the message).
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("PREFIXD_CRASH", None)
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=timeout_s)
    assert out.returncode == 0, f"the {module} driver failed rc={out.returncode}: {out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def recover_in_child(recover: Callable[[], dict], scratch_dir: str, timeout_s: float | None = None) -> dict:
    """Call `recover` in a forked child, so that a signal kills only the child.

    The child's stderr and its result go to ``result.err`` and ``result.json`` in `scratch_dir`.

    Returns:
        What `recover` returned (through JSON); ``{"died": exit code, "stderr": tail}`` when it
        raised (exit code 1, the traceback in the tail) or a signal killed it (a negative exit
        code); ``{"hung": timeout_s}`` when it ran past `timeout_s` (it is then killed).
    """
    out_path = os.path.join(scratch_dir, "result.json")
    err_path = os.path.join(scratch_dir, "result.err")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the forked child
        code = 0
        try:
            fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 2)
            result = recover()
            with open(out_path, "w") as f:
                json.dump(result, f)
        except BaseException:  # noqa: BLE001 - reported as a death with its traceback
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    rc = _wait(pid, timeout_s)
    if rc is None:
        return {"hung": timeout_s}
    if rc == 0:
        return json.loads(Path(out_path).read_text())
    return {"died": rc, "stderr": Path(err_path).read_text()[-1500:]}


def _wait(pid: int, timeout_s: float | None) -> int | None:
    """The child's exit code (negative: the signal), or None once killed past `timeout_s`."""
    if timeout_s is None:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.01)
