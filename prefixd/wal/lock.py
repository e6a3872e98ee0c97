"""The state directory lock: one daemon per state directory, refused with the holder's pid.

``<state_dir>/lock`` is locked with ``flock(LOCK_EX | LOCK_NB)`` for the life of the process and
holds the holder's pid as decimal text. The lock, not the pid, is the truth: a stale file left by
a killed daemon is simply re-locked (the kernel drops flock locks when the holder dies), so no pid
liveness guessing is needed.

NOTE: flock, not fcntl/lockf: fcntl locks belong to the (process, file) pair and are dropped when
*any* descriptor of the file is closed in the process, which LMDB itself relies on for its own
files; flock locks belong to the open file description and behave predictably.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from prefixd.wal.errors import StateLockedError

log = logging.getLogger(__name__)

LOCK_NAME = "lock"


class StateDirLock:
    """An exclusive flock on ``<state_dir>/lock``, released by ``release()`` or process exit.

    Invariants: ``fd`` is an open descriptor holding ``LOCK_EX`` iff not released; the file
    contains ``pid`` followed by a newline.
    """

    def __init__(self, state_dir: str) -> None:
        """Take the lock.

        Raises:
            StateLockedError: another process (or another open in this one) holds it.
            OSError: the state directory cannot be created or the file opened.
        """
        os.makedirs(state_dir, mode=0o750, exist_ok=True)
        self.path = os.path.join(state_dir, LOCK_NAME)
        self.pid = os.getpid()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateLockedError(self.path, holder) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.pid}\n".encode(), 0)
        self.fd: int | None = fd
        log.debug("state lock taken path=%s pid=%s", self.path, self.pid)

    def release(self) -> None:
        """Drop the lock (idempotent). The pid stays in the file; it is only advisory."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def check_invariants(self) -> None:
        """Assert the file still names this process while the lock is held."""
        if self.fd is not None:
            assert _read_pid(self.fd) == self.pid, "lock file does not name its holder"


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
