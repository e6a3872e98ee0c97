"""Simulated power loss for the crash suites: a FUSE filesystem that forgets what was not fsynced.

``PowerFS(root)`` mounts ``root/mnt`` over ``root/backing``. While it is mounted, processes see
every write at once, but a disk would only hold what was fsynced; ``power_cut()`` kills the
workload, throws away everything not durable (mode ``lose``) or a seeded random part of it at 4
KiB page granularity (mode ``torn``), unmounts, and leaves exactly the durable state in
``root/backing``. Reopen the application from there, directly or through a new mount.

    with PowerFS(tmp_path, seed=7, mode="torn") as fs:
        child = fs.spawn([sys.executable, "-m", "my.workload", str(fs.mnt), str(ack_path)])
        wait_for_acks(ack_path, 20)          # the ack log lives OUTSIDE fs.mnt
        report = fs.power_cut()              # SIGKILL the child, cut, unmount
    check(fs.backing, read_acks(ack_path))   # every acknowledged item must be there

Leaving the ``with`` block without a cut is an orderly unmount (everything synced); leaving it on
an exception cuts the power (``lose``) so the backing directory is always whole, then unmounts.

Durability rules (the full statement is in `powerfs_model`): a file's data and size are durable
after fsync/fdatasync of it (or an O_SYNC/O_DSYNC write for the pages written); a new file or
directory's name becomes durable when it (or a file under it) is fsynced, or when its directory
is fsynced; every other rename/unlink/rmdir needs an fsync of the directory holding the entry.

How the kernel talks to the FS (measured on Linux 6.18, libfuse 3.14, mfusepy 3.1.1, see
`test_powerfs.py`): writeback caching and direct_io are off, so every write(2)/pwrite(2) reaches
the FS before it returns; fsync and fdatasync arrive as FSYNC (datasync flag set for fdatasync);
fsync of a directory fd arrives as FSYNCDIR; an O_DSYNC write arrives as WRITE followed by FSYNC.
Shared writable mmap works (the page cache sits in front of the FS): dirty pages reach the FS
as WRITE calls only when the kernel writes them back, and msync(MS_SYNC) writes them back and
then sends FSYNC, so mmap + msync is modelled correctly. Dirty mapped pages the kernel has not
written back by the time of the cut are lost even in ``torn`` mode, which is what a power cut
does to them too.

Limits: only regular files and directories (no hard links, symlinks, devices: EOPNOTSUPP);
xattrs and POSIX/flock locks are not implemented by the FS (the kernel keeps locks locally,
which is right for one host); mode, owner and times are not modelled for durability; the
namespace is never torn (an unsynced rename is lost as a whole); fallocate supports modes 0 and
KEEP_SIZE only. Everything goes through Python: expect ~10-50k FS calls a second.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Sequence

from tests.crash.powerfs_model import MODES, PAGE_SIZE, CutReport, PowerFSError

__all__ = ["PAGE_SIZE", "CutReport", "PowerFS", "PowerFSError", "fuse_unavailable_reason",
           "require_fuse"]

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
BINDING = "mfusepy"


def fuse_unavailable_reason(*, euid: int | None = None, dev_fuse: str = "/dev/fuse",
                            fusermount: str = "fusermount3", binding: str = BINDING,
                            library: str = "fuse3") -> str | None:
    """Why PowerFS cannot run here, or None when it can. The arguments exist for tests.

    Checks, in order: root (mounting FUSE as root needs no setuid helper setup), the device,
    the ``fusermount3`` helper (used to unmount), the Python binding, and libfuse 3 itself.
    """
    if (os.geteuid() if euid is None else euid) != 0:
        return "powerfs needs root to mount FUSE"
    if not os.path.exists(dev_fuse):
        return f"{dev_fuse} does not exist (no FUSE in this kernel or container)"
    if not os.access(dev_fuse, os.R_OK | os.W_OK):
        return f"{dev_fuse} is not readable and writable"
    if shutil.which(fusermount) is None:
        return f"{fusermount} is not on PATH (apt-get install fuse3)"
    if importlib.util.find_spec(binding) is None:
        return f"the FUSE binding {binding!r} is not installed (pip install -e '.[test]')"
    if ctypes.util.find_library(library) is None:
        return f"lib{library} is not installed (apt-get install fuse3)"
    return None


def require_fuse() -> None:
    """Skip (or fail under ``.ci/run``: ``tests.requires``) with the reason when FUSE is
    unavailable."""
    reason = fuse_unavailable_reason()
    if reason is not None:
        from tests.requires import missing

        missing(f"powerfs unavailable: {reason}")


def _is_mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


class PowerFS:
    """One simulated disk: `root/backing` (durable state), `root/mnt` (the mount), a server.

    State: `backing` is whole whenever no server runs (the server moves its files into
    ``root/.powerfs-store`` while mounted and writes the durable tree back at the cut);
    `children` are the workload processes that `power_cut` kills first.

    Args:
        root: a directory of its own (e.g. pytest's ``tmp_path``); `backing` may already hold a
            previous run's durable state, which is taken as fully durable.
        seed: the torn-page seed used by `power_cut` unless it is given one.
        mode: the default cut mode: ``lose`` or ``torn``.
        mount_timeout_s: how long `mount` waits for the kernel handshake.
    """

    def __init__(self, root: str | os.PathLike, *, seed: int = 0, mode: str = "lose",
                 mount_timeout_s: float = 20.0) -> None:
        if mode not in ("lose", "torn"):
            raise PowerFSError(f"PowerFS mode {mode!r} must be 'lose' or 'torn'")
        self.root = Path(root)
        self.backing = self.root / "backing"
        self.mnt = self.root / "mnt"
        self.store = self.root / ".powerfs-store"
        self.log_path = self.root / "powerfs-server.log"
        self.seed, self.mode, self.mount_timeout_s = seed, mode, mount_timeout_s
        self.children: list[Any] = []
        self.last_report: CutReport | None = None
        self._server: subprocess.Popen | None = None
        self._replies: list[dict] = []
        self._reply_ready = threading.Condition()

    # ---- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> PowerFS:
        return self.mount()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._server is not None:
                if exc_type is None:
                    self.unmount()
                else:
                    with contextlib.suppress(Exception):
                        self.power_cut("lose")
        finally:
            self.close()

    def mount(self) -> PowerFS:
        """Start the server and wait until `mnt` answers.

        Raises:
            PowerFSError: already mounted, a mount already on `mnt`, or the server did not come
                up in time (the message carries the server's log).
        """
        if self._server is not None:
            raise PowerFSError(f"{self.mnt} is already mounted by this PowerFS")
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        if _is_mounted(self.mnt):
            raise PowerFSError(f"{self.mnt} is already a mount point")
        if self.store.exists():
            raise PowerFSError(f"{self.store} exists: a previous server died holding the data")
        env = dict(os.environ, FUSE_LIBRARY_NAME="fuse3",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        logf = open(self.log_path, "ab")
        try:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "tests.crash.powerfs_server",
                 str(self.backing), str(self.mnt), str(self.store)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, cwd=REPO, env=env,
                start_new_session=True)
        finally:
            logf.close()
        self._replies = []
        threading.Thread(target=self._read_replies, args=(self._server.stdout,), daemon=True).start()
        try:
            reply = self._wait_reply(self.mount_timeout_s, "mount")
            if not reply.get("ready"):
                raise PowerFSError(f"powerfs server said {reply!r} instead of ready")
            deadline = time.monotonic() + self.mount_timeout_s
            while not _is_mounted(self.mnt):
                if time.monotonic() > deadline:
                    raise PowerFSError(f"{self.mnt} not in mountinfo after the FUSE handshake")
                time.sleep(0.01)
        except BaseException:
            self.close()
            raise
        return self

    def spawn(self, args: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start a workload process (own session) that `power_cut` will SIGKILL first."""
        popen_kwargs.setdefault("start_new_session", True)
        env = popen_kwargs.pop("env", None) or dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        proc = subprocess.Popen(list(args), cwd=popen_kwargs.pop("cwd", REPO), env=env,
                                **popen_kwargs)
        proc._powerfs_group = bool(popen_kwargs["start_new_session"])  # type: ignore[attr-defined]
        self.children.append(proc)
        return proc

    def adopt(self, proc: Any) -> Any:
        """Register a process started elsewhere (Popen or multiprocessing.Process) for the cut."""
        self.children.append(proc)
        return proc

    def power_cut(self, mode: str | None = None, seed: int | None = None) -> CutReport:
        """Kill the workload (SIGKILL), drop what is not durable, unmount.

        Args:
            mode: ``lose`` or ``torn`` (default: the constructor's mode).
            seed: the torn-page seed (default: the constructor's seed).

        Returns:
            What was kept and lost. `backing` holds the durable state afterwards.

        Raises:
            PowerFSError: not mounted, the server failed, or the FS hit an internal error during
                the run (a harness bug: its errors are in the message).
        """
        return self._cut(mode or self.mode, self.seed if seed is None else seed)

    def unmount(self) -> CutReport:
        """An orderly unmount: workload killed, everything live made durable, unmounted."""
        return self._cut("clean", self.seed)

    def stats(self) -> dict:
        """The server's counters (write, fsync, fdatasync, fsyncdir, ...) and dirty page count."""
        return self._request({"op": "stats"})

    def check(self) -> None:
        """Run the model's `check_invariants` in the server (raises PowerFSError if broken)."""
        self._request({"op": "check"})

    # ---- internals ---------------------------------------------------------------------

    def _cut(self, mode: str, seed: int) -> CutReport:
        if mode not in MODES:
            raise PowerFSError(f"power cut mode {mode!r} is not one of {MODES}")
        if self._server is None:
            raise PowerFSError(f"{self.mnt} is not mounted")
        self._kill_children()
        try:
            reply = self._request({"op": "cut", "mode": mode, "seed": seed}, timeout_s=120.0)
        finally:
            self.close()
        if reply["errors"]:
            raise PowerFSError(f"powerfs internal errors during the run: {reply['errors']}")
        self.last_report = CutReport(**reply["report"])
        log.info("powerfs cut %s", self.last_report)
        return self.last_report

    def _kill_children(self) -> None:
        for proc in self.children:
            alive = proc.poll() is None if isinstance(proc, subprocess.Popen) else proc.is_alive()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if getattr(proc, "_powerfs_group", False):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own children too
                elif alive:
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self.children:
            if isinstance(proc, subprocess.Popen):
                proc.wait(timeout=30)
            else:
                proc.join(timeout=30)
        self.children = []

    def _read_replies(self, stream: IO[bytes]) -> None:
        for line in stream:
            with self._reply_ready:
                self._replies.append(json.loads(line))
                self._reply_ready.notify_all()
        with self._reply_ready:
            self._replies.append({"eof": True})
            self._reply_ready.notify_all()

    def _wait_reply(self, timeout_s: float, what: str) -> dict:
        with self._reply_ready:
            if not self._reply_ready.wait_for(lambda: self._replies, timeout=timeout_s):
                raise PowerFSError(f"powerfs {what}: no answer in {timeout_s:.0f} s; {self._log_tail()}")
            reply = self._replies.pop(0)
        if reply.get("eof"):
            raise PowerFSError(f"powerfs {what}: the server exited; {self._log_tail()}")
        return reply

    def _request(self, req: dict, timeout_s: float = 30.0) -> dict:
        if self._server is None or self._server.stdin is None:
            raise PowerFSError(f"{self.mnt} is not mounted")
        self._server.stdin.write((json.dumps(req) + "\n").encode())
        self._server.stdin.flush()
        reply = self._wait_reply(timeout_s, req["op"])
        if not reply.get("ok"):
            raise PowerFSError(f"powerfs {req['op']} failed: {reply.get('error')}")
        return reply

    def _log_tail(self) -> str:
        try:
            return "server log: " + self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return "no server log"

    def close(self) -> None:
        """Kill the workload, unmount (lazily if busy), stop the server. Safe to call twice.

        A server that was not cut yet cuts in ``lose`` mode as it goes, so `backing` is whole.
        """
        self._kill_children()
        server, self._server = self._server, None
        if _is_mounted(self.mnt):
            if subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True).returncode:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        if server is None:
            return
        with contextlib.suppress(OSError):
            server.stdin.close()  # EOF: a server not cut yet cuts (lose) and exits
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("powerfs server pid=%d did not exit; killing it", server.pid)
            server.kill()
            server.wait()
        if _is_mounted(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
