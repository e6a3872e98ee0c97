"""Flush tickets: who waits for which lsn to become durable.

A ticket belongs to an lsn, not to a group: with a producer ahead of the disk the pending
records are cut into groups of ``max_group_records``, and a ticket shared by everything pending
would resolve only with the last of them, holding its waiter one group too long and leaving
the pipeline idle meanwhile.

Not thread-safe by itself: the group committer calls it under its lock and resolves the
Futures it hands back outside the lock.

Invariants (``check``): waiting lsns ascend, each has at least one waiter and at most one shared
ticket (its first waiter), all are above the committed lsn; ``unsynced`` holds waiters whose
records are committed but not yet fsynced (``interval``).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, InvalidStateError


def done(value) -> Future:
    """A ticket that is already resolved with ``value``."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


# NOTE: one resolved ``None`` ticket for every call that has nothing to wait for (a release
# without commit: every request's last call). A finished Future never changes again (``cancel``
# returns False, ``set_result`` raises, a done-callback runs at once and is not kept), so
# sharing it is safe, and a fresh one (a Future, its Condition, ``set_result``) on every
# request's last call would be pure overhead.
DONE_NONE: Future = done(None)


def failed(exc: BaseException) -> Future:
    """A ticket that has already failed with ``exc``."""
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


_LSN = object()  # a waiter's value: resolve it with the durable lsn (``flush``'s shared ticket)


def resolve(waiters: list, lsn: int) -> None:
    """Resolve each ``(future, value)`` waiter: ``flush``'s tickets with ``lsn``, the others
    (``follow``) with their own value. A future its holder cancelled is skipped: a committer
    that raised here would poison the log for it."""
    for fut, value in waiters:
        try:
            fut.set_result(lsn if value is _LSN else value)
        except InvalidStateError:  # cancelled by its holder: nobody waits for it
            pass


class Tickets:
    """Waiters by lsn. A waiter is ``(future, value)``: ``ticket`` hands out one future per lsn,
    shared by every ``flush`` of it and resolved with the lsn; ``follow`` adds the caller's own
    future, resolved with the caller's value (the engine's commit ticket, resolved with its
    blocks: one Future per commit, where a shared ticket and a ticket chained on it made two).
    """

    __slots__ = ("_waiting", "_unsynced")

    def __init__(self) -> None:
        self._waiting: deque[tuple[int, list]] = deque()  # (lsn, waiters), lsns ascending
        self._unsynced: list = []  # waiters whose records are committed, not yet fsynced

    def ticket(self, lsn: int, committed_lsn: int) -> Future:
        """The ticket for "every record <= ``lsn`` is durable" (the caller checked it is not yet)."""
        waiting = self._waiting
        if waiting and waiting[-1][0] == lsn:
            waiters = waiting[-1][1]
            if waiters[0][1] is _LSN:
                return waiters[0][0]
            fut: Future = Future()
            waiters.insert(0, (fut, _LSN))
            return fut
        fut = Future()
        self.follow(lsn, committed_lsn, [(fut, _LSN)])
        return fut

    def follow(self, lsn: int, committed_lsn: int, waiters: list) -> None:
        """Resolve the ``(future, value)`` ``waiters`` with their values once every record <=
        ``lsn`` is durable (the caller checked it is not yet)."""
        if lsn <= committed_lsn:  # interval: committed, resolved by the next fsync
            self._unsynced += waiters
            return
        waiting = self._waiting
        if waiting and waiting[-1][0] == lsn:
            waiting[-1][1].extend(waiters)
        else:
            waiting.append((lsn, list(waiters)))

    def wanted_beyond(self, lsn: int) -> bool:
        """Whether a ticket waits for a record after ``lsn``."""
        return bool(self._waiting) and self._waiting[-1][0] > lsn

    def committed(self, lsn: int, synced: bool) -> list:
        """Records up to ``lsn`` are committed: the waiters now due (``synced``; the caller
        ``resolve``s them), or none (they wait for the next fsync)."""
        waiting, due = self._waiting, []
        while waiting and waiting[0][0] <= lsn:
            due += waiting.popleft()[1]
        if synced:
            return due
        self._unsynced += due
        return []

    def take_unsynced(self) -> list:
        """The waiters an fsync about to run will resolve; ``give_back`` them if it fails."""
        taken, self._unsynced = self._unsynced, []
        return taken

    def give_back(self, waiters: list) -> None:
        self._unsynced = waiters + self._unsynced

    def take_all(self) -> list[Future]:
        """Every open ticket's future (the log failed: the caller fails them)."""
        taken = [fut for _, waiters in self._waiting for fut, _ in waiters]
        taken += [fut for fut, _ in self._unsynced]
        self._waiting, self._unsynced = deque(), []
        return taken

    @property
    def num_waiting(self) -> int:
        """Tickets waiting for records not yet committed (distinct lsns)."""
        return len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self._waiting or self._unsynced)

    def check(self, committed_lsn: int) -> None:
        lsns = [lsn for lsn, _ in self._waiting]
        assert lsns == sorted(set(lsns)), "flush tickets out of order"
        assert not lsns or lsns[0] > committed_lsn, "a committed lsn still has waiting tickets"
        assert all(waiters for _, waiters in self._waiting), "an lsn waits with no waiter"
        for _, waiters in self._waiting:
            assert all(value is not _LSN for _, value in waiters[1:]), "an lsn has two shared tickets"
