"""Typed errors of the write-ahead log, each carrying the context a person needs to act.

Every error derives from :class:`WalError`, so a caller that only wants "the log is unusable"
catches one type. Errors that concern a place carry it: ``path`` (the state directory) and, for
records, ``lsn``.
"""

from __future__ import annotations


class WalError(Exception):
    """Base class of every error raised by ``prefixd.wal``."""


class WalCorruptError(WalError):
    """A stored record or checkpoint failed validation (checksum, length, kind, gap).

    LMDB transactions are atomic, so a torn or half-written record inside a committed
    transaction cannot come from a crash: it means the file was damaged. Replay never skips such
    a record silently; it raises this with the lsn of the first bad record.

    Attributes:
        lsn: log sequence number of the bad record (for a checkpoint: the checkpoint lsn);
            -1 when LMDB itself found a damaged page and no record can be named; None when the
            damage was found by what the records say, not where.
        reason: what failed, in words.
    """

    ADVICE = ("the state directory is damaged: restore it from a backup, or move it aside to "
              "start a new cache there (its cached blocks are lost)")

    def __init__(self, lsn: int | None, reason: str, path: str | None = None) -> None:
        self.lsn = lsn
        self.reason = reason
        self.path = path
        where = f" in {path}" if path else ""
        at = "" if lsn is None else f" at lsn {lsn}" if lsn >= 0 else " (a damaged LMDB page)"
        super().__init__(f"corrupt write-ahead log{at}{where}: {reason}; {self.ADVICE}")


class WalFailedError(WalError):
    """The log is poisoned: a group commit, an fsync or a checkpoint failed.

    After a failed commit or fsync nothing more is acknowledged (a failed fsync may have dropped
    dirty pages, so a later "successful" fsync would be a lie). Restart the daemon: recovery
    replays what did reach the disk. ``__cause__`` is the original error.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class WalNoSpaceError(WalError):
    """A checkpoint's write transaction met a full filesystem (ENOSPC, EDQUOT) and was
    aborted: the log is intact and accepts records as before (it is NOT poisoned), the
    checkpoint is simply not taken; try again once there is room."""

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = path
        super().__init__(f"checkpoint of {path} not taken: {cause}; the log keeps every record "
                         f"and the checkpoint is retried (free space on that filesystem)")


class WalClosedError(WalError):
    """The Wal was used after ``close()``."""


class StateMismatchError(WalError):
    """The state directory was written by an incompatible format or for other layouts.

    Attributes:
        path: the state directory.
        what: which meta entry differs (``format_version``, ``layouts``, ``kinds``...).
    """

    def __init__(self, path: str, what: str, detail: str) -> None:
        self.path = path
        self.what = what
        super().__init__(f"state directory {path} does not match this prefixd ({what}): {detail}")


class StateLockedError(WalError):
    """Another process holds the state directory lock.

    Attributes:
        path: the lock file.
        pid: the pid written in the lock file by its holder, or None if unreadable.
    """

    def __init__(self, path: str, pid: int | None) -> None:
        self.path = path
        self.pid = pid
        holder = f"pid {pid}" if pid is not None else "another process"
        super().__init__(
            f"state directory lock {path} is held by {holder}: another prefixd is running on this "
            f"state directory; stop it or use another --state-dir"
        )


class EnvAlreadyOpenError(WalError):
    """This process already has the environment of this state directory open.

    LMDB forbids two environments on the same files in one process (its fcntl locks belong to the
    process, so closing one would drop the other's). Reuse the open ``Wal``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"write-ahead log {path} is already open in this process (pid-wide); reuse it")


class ForkedEnvError(WalError):
    """An environment opened in one process was used in a forked child.

    An LMDB environment must never cross ``fork()``: the child shares the parent's file locks and
    reader slots. Open a fresh one in the child (after the parent has closed its own).
    """

    def __init__(self, path: str, opened_pid: int, pid: int) -> None:
        self.path = path
        super().__init__(
            f"write-ahead log {path} was opened by pid {opened_pid} and used in pid {pid} "
            f"after fork(); open it again in this process instead"
        )
