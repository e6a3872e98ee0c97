"""The committer thread's loop: wait for work, gather, take a group, commit it, sync, run jobs.

``CommitterLoop`` is the half of ``GroupCommitter`` (``prefixd.wal.group``) that runs on the
committer thread (``_run``; ``_step`` also inline from ``GroupCommitter.submit`` on that thread):
it takes the pending group and the due jobs under ``_cv``, then outside it writes the group in
one LMDB txn, makes it durable per the sync policy, resolves the tickets it covers, runs the
jobs, and poisons the log on any failure. The producer side (``append``, ``flush``,
``submit``, ``close``), the state and its invariants stay in ``prefixd.wal.group``.

NOTE: a mixin, not an object of its own: the loop and the producers share one lock, one
condition and every field it guards (``GroupCommitter``'s docstring lists the invariants);
splitting the state would put the lsn invariants across two objects. The split is by concept,
for the reader.
"""

from __future__ import annotations

import bisect
import logging
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

from prefixd.crashpoints import crash_point
from prefixd.wal.errors import WalError, WalFailedError
from prefixd.wal.tickets import resolve

log = logging.getLogger(__name__)

READER_CHECK_GROUPS = 4096
READER_CHECK_S = 60.0
GATHER_STEP_S = 0.0003  # a wanted group waits this long for more records, while they keep coming
GATHER_MAX_S = 0.002    # ... at most this long (see GroupCommitter._gather)
# histogram bucket upper bounds (the daemon exports them as prefixd_wal_commit_seconds and
# prefixd_wal_group_records; one more bucket counts what is above the last bound)
COMMIT_S_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5)
GROUP_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


class Taken(NamedTuple):
    """What the committer took under the lock for one step."""

    group: list[tuple[bytes, bytes]]
    last_lsn: int
    jobs: list[tuple[Callable[[], object], Future]]
    closing: bool


class CommitterLoop:
    """The committer-thread half of ``GroupCommitter``; not used alone (see the module's NOTE).

    Expects of its subclass the fields ``GroupCommitter.__init__`` sets (``_wenv``, ``_sync``,
    ``_lock`` / ``_cv`` and what they guard, the committer-thread counters) and its ``_thread``.
    Invariants: those of ``GroupCommitter.check_invariants``; this half holds no state of its own.
    """

    def _wait_for_work(self) -> None:
        """Block (holding ``_cv``) until a group, a job, a due fsync or close needs the thread.

        NOTE (linger): for ``max_delay_s`` after a group, with nothing pending, the thread
        waits on a timeout instead of "idle", and an append to the empty group does not wake
        it (``GroupCommitter._add`` wakes an idle committer only): a record appended meanwhile
        is still committed within ``max_delay_s`` of its append (the linger ends before that,
        and the thread then waits out the rest), and a flush wakes it at once as always. On a
        serving daemon the open of a request appended its record to an empty group, and woke
        this thread only for it to set a timer, while the loop thread was busy with the same
        request: a context switch and a taking of the GIL per request, for nothing.
        """
        while True:
            if self._jobs or self._closing or self._flush_wanted or len(self._pending) >= self._max_group:
                return
            now = time.monotonic()
            timeout = None
            if self._pending:
                timeout = self._first_append_t + self._max_delay_s - now
            if self._committed_lsn > self._durable_lsn:
                due = self._last_sync_t + self._interval_s - now
                timeout = due if timeout is None else min(timeout, due)
            if timeout is not None and timeout <= 0:
                return
            if timeout is None:
                linger = self._last_group_t + self._max_delay_s - now
                if linger > 0:  # see the NOTE: appends meanwhile do not wake this thread
                    self._cv.wait(linger)
                    continue
            self._idle = timeout is None
            self._cv.wait(timeout)
            self._idle = False

    def _gather(self) -> None:
        """Under ``_cv``, with a flush wanted (``sync="commit"``): let the group grow while
        records keep arriving, up to ``GATHER_MAX_S``.

        NOTE: without it a group holds what arrived during the previous fsync: with many
        sequences committing on one serving thread (~1 ms a request, ~2 ms an fsync here)
        that was ~2 commits an fsync, and every group's Python work took the GIL from the
        serving thread. Waiting while appends still come (each ``GATHER_STEP_S``) lets the
        commits of one burst share an fsync; a lone committer (nothing more arrives) waits
        one step. Only when others commit too: the last group resolved several tickets, or
        several wait now (PostgreSQL's ``commit_delay`` with ``commit_siblings``); a lone
        committer waiting on each commit pays nothing (a step cost it a third of its rate).
        """
        if self._sync != "commit" or not self._flush_wanted or self._jobs or self._closing:
            return
        if self._last_tickets < 2 and self._tickets.num_waiting < 2:
            return  # one committer at a time (the last group served one ticket): no siblings
        deadline = time.monotonic() + GATHER_MAX_S
        while len(self._pending) < self._max_group:
            seen = len(self._pending)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(min(GATHER_STEP_S, left))
            if len(self._pending) == seen or self._jobs or self._closing or self._failure is not None:
                return

    def _take(self) -> Taken:
        """Under ``_cv``: take the pending group (at most ``max_group_records``) and the jobs.

        Records beyond the cap stay pending (and wanted, if a flush waits for them).
        """
        pending = self._pending
        if len(pending) > self._max_group:
            group = pending[: self._max_group]
            del pending[: self._max_group]  # a memmove: a backlog of millions stays cheap
            self._first_append_t = time.monotonic()
        else:
            group, self._pending = pending, []
        last = self._taken_lsn = self._next_lsn - 1 - len(self._pending)
        self._flush_wanted = self._tickets.wanted_beyond(last)
        # A job runs once every record appended before it was submitted is in this group or an
        # earlier one; records appended after it never hold it back (a busy appender would
        # otherwise starve a checkpoint forever).
        jobs = [(job, fut) for job, fut, after in self._jobs if after <= last]
        if jobs:
            self._jobs = [entry for entry in self._jobs if entry[2] > last]
        return Taken(group, last, jobs, self._closing and not self._pending)

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._failure is not None:
                    return
                self._wait_for_work()
                self._gather()
                taken = self._take()
                if len(self._pending) < self._backlog // 2:
                    self._cv.notify_all()  # producers held back by the backlog limit
            try:
                self._step(taken)
            except BaseException as exc:  # noqa: BLE001 - any failure poisons the log
                self._poison(exc, taken.jobs)
                return
            if taken.closing:
                with self._cv:
                    if not self._pending and not self._jobs:
                        return

    def _step(self, taken: Taken) -> None:
        group, last, jobs, closing = taken
        if group:
            self._commit_group(group, last)
            self._last_group_t = time.monotonic()
        for job, job_fut in jobs:
            self._run_job(job, job_fut)
        if self._committed_lsn > self._durable_lsn and (closing or time.monotonic() >= self._last_sync_t + self._interval_s):
            self.sync_now()
        if closing and self._sync == "none":
            self._wenv.sync()
        self._maybe_reader_check()

    def _commit_group(self, group: list[tuple[bytes, bytes]], last: int) -> None:
        t0 = time.perf_counter()

        def put(txn) -> None:
            # NOTE: putmulti releases and retakes the GIL around every put; with a producer
            # running Python on the other core, each retake waited, and a 64-record group took
            # 200 us instead of 20. Holding the append lock parks producers (GIL released)
            # for those 20 us.
            with self._lock:
                consumed, added = txn.cursor(db=self._wenv.log).putmulti(group, append=True)
            if added != len(group):
                raise WalError(f"group commit stored {added} of {len(group)} records (lsn order broken)")
            crash_point("wal_before_commit")

        self._wenv.write(put)  # sync="commit": the env fsyncs inside commit
        crash_point("wal_after_commit")
        elapsed = time.perf_counter() - t0
        self._n_groups += 1
        self._n_records += len(group)
        self._last_size = len(group)
        self._last_s = elapsed
        self._total_s += elapsed
        self._max_s = max(self._max_s, elapsed)
        self._commit_buckets[bisect.bisect_left(COMMIT_S_BOUNDS, elapsed)] += 1
        self._size_buckets[bisect.bisect_left(GROUP_SIZE_BOUNDS, len(group))] += 1
        self._groups_since_reader_check += 1
        with self._cv:
            self._committed_lsn = last
            done = self._tickets.committed(last, synced=self._sync != "interval")
            if self._sync == "interval":
                return
            self._durable_lsn = last
        if self._sync == "commit":
            self._n_syncs += 1
        self._last_tickets = len(done)
        resolve(done, last)

    def sync_now(self) -> int:
        """fsync the environment and resolve every committed-but-unsynced ticket (committer
        thread only). Returns the durable lsn."""
        with self._cv:
            waiting = self._tickets.take_unsynced()
            last = self._committed_lsn
        try:
            self._wenv.sync()
        except BaseException:
            with self._cv:  # the caller poisons the log, which fails every ticket it holds
                self._tickets.give_back(waiting)
            raise
        self._last_sync_t = time.monotonic()
        self._n_syncs += 1
        with self._cv:
            self._durable_lsn = last
        resolve(waiting, last)
        return last

    def _run_job(self, job: Callable[[], object], fut: Future) -> None:
        try:
            result = job()
        except (ValueError, TypeError) as exc:  # caller's bad input; nothing was written
            fut.set_exception(exc)
            return
        # any other failure propagates: the caller poisons the log and fails ``fut``
        fut.set_result(result)

    def _maybe_reader_check(self) -> None:
        now = time.monotonic()
        if self._groups_since_reader_check >= READER_CHECK_GROUPS or now - self._last_reader_check_t >= READER_CHECK_S:
            self._groups_since_reader_check = 0
            self._last_reader_check_t = now
            self._wenv.reader_check()

    def _poison(self, exc: BaseException, jobs) -> None:
        failure = WalFailedError(
            f"write-ahead log {self._wenv.state_dir} failed and accepts nothing more: {exc!r}; "
            f"restart to recover from what reached the disk", self._wenv.state_dir,
        )
        failure.__cause__ = exc
        log.error("wal poisoned path=%s error=%r", self._wenv.state_dir, exc)
        with self._cv:
            self._failure = failure
            futures = self._tickets.take_all()
            futures += [entry[1] for entry in self._jobs] + [f for _, f in jobs]
            self._pending, self._jobs = [], []
            self._cv.notify_all()  # producers waiting on the backlog limit see the failure
        for fut in futures:
            if not fut.done():
                fut.set_exception(failure)
