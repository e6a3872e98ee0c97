"""Flush tickets: who waits for which lsn to become durable.

A ticket belongs to an lsn, not to a group: with a producer ahead of the disk the pending
records are cut into groups of ``max_group_records``, and a ticket shared by everything pending
would resolve only with the last of them, holding its waiter one group too long (the WAL bench
lost a third of its throughput to that idle pipeline).

Not thread-safe by itself: the group committer calls it under its lock and resolves the
Futures it hands back outside the lock.

Invariants (``check``): waiting lsns ascend, each has one Future, all are above the committed
lsn; ``unsynced`` holds tickets whose records are committed but not yet fsynced (``interval``).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future


def done(value) -> Future:
    """A ticket that is already resolved with ``value``."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def failed(exc: BaseException) -> Future:
    """A ticket that has already failed with ``exc``."""
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


class Tickets:
    __slots__ = ("_waiting", "_unsynced")

    def __init__(self) -> None:
        self._waiting: deque[tuple[int, Future]] = deque()  # (lsn, ticket), lsns ascending
        self._unsynced: list[Future] = []

    def ticket(self, lsn: int, committed_lsn: int) -> Future:
        """The ticket for "every record <= ``lsn`` is durable" (the caller checked it is not yet)."""
        waiting = self._waiting
        if waiting and waiting[-1][0] == lsn:
            return waiting[-1][1]
        fut: Future = Future()
        if lsn <= committed_lsn:  # interval: committed, resolved by the next fsync
            self._unsynced.append(fut)
        else:
            waiting.append((lsn, fut))
        return fut

    def wanted_beyond(self, lsn: int) -> bool:
        """Whether a ticket waits for a record after ``lsn``."""
        return bool(self._waiting) and self._waiting[-1][0] > lsn

    def committed(self, lsn: int, synced: bool) -> list[Future]:
        """Records up to ``lsn`` are committed: the tickets now due (``synced``), or none (their
        tickets wait for the next fsync)."""
        waiting, due = self._waiting, []
        while waiting and waiting[0][0] <= lsn:
            due.append(waiting.popleft()[1])
        if synced:
            return due
        self._unsynced += due
        return []

    def take_unsynced(self) -> list[Future]:
        """The tickets an fsync about to run will resolve; ``give_back`` them if it fails."""
        taken, self._unsynced = self._unsynced, []
        return taken

    def give_back(self, tickets: list[Future]) -> None:
        self._unsynced = tickets + self._unsynced

    def take_all(self) -> list[Future]:
        """Every open ticket (the log failed: the caller fails them)."""
        taken = [fut for _, fut in self._waiting] + self._unsynced
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
