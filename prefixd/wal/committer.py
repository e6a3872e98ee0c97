"""The committer thread's loop: wait for work, gather, take a group, commit it, sync, run jobs.

``Committer`` is the part of ``GroupCommitter`` (``prefixd.wal.group``) that runs on the
committer thread (``run``; ``step`` also inline from ``GroupCommitter.submit`` on that thread):
it takes the pending group and the due jobs under the lock, then outside it writes the group in
one LMDB txn, makes it durable per the sync policy, resolves the tickets it covers, runs the
jobs, and poisons the log on any failure. It holds the committer-thread counters itself; what
it shares with the producers (``append``, ``flush``, ``submit``, ``close``) is one
``GroupState``: the lock, its condition and every field they guard, whose invariants
``GroupCommitter``'s docstring lists.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

from prefixd.crashpoints import crash_point
from prefixd.wal.env import WalEnv
from prefixd.wal.errors import WalError, WalFailedError, WalNoSpaceError
from prefixd.wal.tickets import Tickets, resolve

log = logging.getLogger(__name__)

READER_CHECK_GROUPS = 4096
READER_CHECK_S = 60.0
GATHER_STEP_S = 0.0003  # a wanted group waits this long for more records, while they keep coming
GATHER_MAX_S = 0.002    # ... at most this long (see GroupCommitter.gather)
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


class GroupState:
    """What the producers and the committer share: the lock, its condition, and what they guard.

    Every field below ``cv`` is read and written under ``cv`` (``durable_lsn`` and ``failure``
    are also read without it, as single reads); the settings above it never change. Invariants:
    those of ``GroupCommitter.check_invariants``.
    """

    __slots__ = ("wenv", "sync", "interval_s", "max_delay_s", "max_group", "backlog", "lock", "cv",
                 "pending", "tickets", "first_append_t", "flush_wanted", "next_lsn", "taken_lsn",
                 "committed_lsn", "durable_lsn", "jobs", "failure", "closing", "idle", "last_tickets")

    def __init__(self, wenv: WalEnv, *, sync: str, next_lsn: int, interval_s: float,
                 max_delay_s: float, max_group_records: int) -> None:
        self.wenv = wenv
        self.sync = sync
        self.interval_s = interval_s
        self.max_delay_s = max_delay_s
        self.max_group = max_group_records
        self.backlog = 16 * max_group_records  # appends wait beyond this many pending records
        self.lock = threading.Lock()  # append takes the lock directly: its C __enter__ is cheaper
        self.cv = threading.Condition(self.lock)
        # --- guarded by cv ---
        self.pending: list[tuple[bytes, bytes]] = []
        self.tickets = Tickets()
        self.first_append_t = 0.0
        self.flush_wanted = False  # a waiter's lsn is still pending: commit without delay
        self.next_lsn = next_lsn
        self.taken_lsn = next_lsn - 1  # the last lsn the committer took
        self.committed_lsn = next_lsn - 1
        self.durable_lsn = next_lsn - 1
        self.jobs: list[tuple[Callable[[], object], Future, int]] = []  # (job, future, after lsn)
        self.failure: WalFailedError | None = None
        self.closing = False
        self.idle = False
        self.last_tickets = 0  # tickets the last group resolved (read by gather)


class Committer:
    """The committer thread's loop over a ``GroupState`` it shares with the producers, and the
    counters only that thread writes (``GroupCommitter.stats`` reads them without the lock)."""

    def __init__(self, state: GroupState) -> None:
        self._s = state
        self.last_sync_t = 0.0
        self.last_group_t = 0.0  # when the last group committed (the linger: wait_for_work)
        self.last_reader_check_t = time.monotonic()
        self.groups_since_reader_check = 0
        self.n_groups = self.n_records = self.last_size = self.n_syncs = self.n_checkpoints = 0
        self.last_s = self.total_s = self.max_s = 0.0
        self.commit_buckets = [0] * (len(COMMIT_S_BOUNDS) + 1)
        self.size_buckets = [0] * (len(GROUP_SIZE_BOUNDS) + 1)

    def wait_for_work(self) -> None:
        """Block (holding ``cv``) until a group, a job, a due fsync or close needs the thread.

        NOTE (linger): for ``max_delay_s`` after a group, with nothing pending, the thread
        waits on a timeout instead of "idle", and an append to the empty group does not wake
        it (``GroupCommitter.append`` wakes an idle committer only): a record appended meanwhile
        is still committed within ``max_delay_s`` of its append (the linger ends before that,
        and the thread then waits out the rest), and a flush wakes it at once as always. On a
        serving daemon the open of a request appended its record to an empty group, and woke
        this thread only for it to set a timer, while the loop thread was busy with the same
        request: a context switch and a taking of the GIL per request, for nothing.
        """
        s = self._s
        while True:
            if s.jobs or s.closing or s.flush_wanted or len(s.pending) >= s.max_group:
                return
            now = time.monotonic()
            timeout = None
            if s.pending:
                timeout = s.first_append_t + s.max_delay_s - now
            if s.committed_lsn > s.durable_lsn:
                due = self.last_sync_t + s.interval_s - now
                timeout = due if timeout is None else min(timeout, due)
            if timeout is not None and timeout <= 0:
                return
            if timeout is None:
                linger = self.last_group_t + s.max_delay_s - now
                if linger > 0:  # see the NOTE: appends meanwhile do not wake this thread
                    s.cv.wait(linger)
                    continue
            s.idle = timeout is None
            s.cv.wait(timeout)
            s.idle = False

    def gather(self) -> None:
        """Under ``cv``, with a flush wanted (``sync="commit"``): let the group grow while
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
        s = self._s
        if s.sync != "commit" or not s.flush_wanted or s.jobs or s.closing:
            return
        if s.last_tickets < 2 and s.tickets.num_waiting < 2:
            return  # one committer at a time (the last group served one ticket): no siblings
        deadline = time.monotonic() + GATHER_MAX_S
        while len(s.pending) < s.max_group:
            seen = len(s.pending)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            s.cv.wait(min(GATHER_STEP_S, left))
            if len(s.pending) == seen or s.jobs or s.closing or s.failure is not None:
                return

    def take(self) -> Taken:
        """Under ``cv``: take the pending group (at most ``max_group_records``) and the jobs.

        Records beyond the cap stay pending (and wanted, if a flush waits for them).
        """
        s = self._s
        pending = s.pending
        if len(pending) > s.max_group:
            group = pending[: s.max_group]
            del pending[: s.max_group]  # a memmove: a backlog of millions stays cheap
            s.first_append_t = time.monotonic()
        else:
            group, s.pending = pending, []
        last = s.taken_lsn = s.next_lsn - 1 - len(s.pending)
        s.flush_wanted = s.tickets.wanted_beyond(last)
        # A job runs once every record appended before it was submitted is in this group or an
        # earlier one; records appended after it never hold it back (a busy appender would
        # otherwise starve a checkpoint forever).
        jobs = [(job, fut) for job, fut, after in s.jobs if after <= last]
        if jobs:
            s.jobs = [entry for entry in s.jobs if entry[2] > last]
        return Taken(group, last, jobs, s.closing and not s.pending)

    def run(self) -> None:
        s = self._s
        while True:
            with s.cv:
                if s.failure is not None:
                    return
                self.wait_for_work()
                self.gather()
                taken = self.take()
                if len(s.pending) < s.backlog // 2:
                    s.cv.notify_all()  # producers held back by the backlog limit
            try:
                self.step(taken)
            except BaseException as exc:  # noqa: BLE001 - any failure poisons the log
                self.poison(exc, taken.jobs)
                return
            if taken.closing:
                with s.cv:
                    if not s.pending and not s.jobs:
                        return

    def step(self, taken: Taken) -> None:
        s = self._s
        group, last, jobs, closing = taken
        if group:
            self.commit_group(group, last)
            self.last_group_t = time.monotonic()
        for job, job_fut in jobs:
            self.run_job(job, job_fut)
        if s.committed_lsn > s.durable_lsn and (closing or time.monotonic() >= self.last_sync_t + s.interval_s):
            self.sync_now()
        if closing and s.sync == "none":
            s.wenv.sync()
        self.maybe_reader_check()

    def commit_group(self, group: list[tuple[bytes, bytes]], last: int) -> None:
        s = self._s
        t0 = time.perf_counter()

        def put(txn) -> None:
            # NOTE: putmulti releases and retakes the GIL around every put; with a producer
            # running Python on the other core, each retake waited, and a 64-record group took
            # 200 us instead of 20. Holding the append lock parks producers (GIL released)
            # for those 20 us.
            with s.lock:
                consumed, added = txn.cursor(db=s.wenv.log).putmulti(group, append=True)
            if added != len(group):
                raise WalError(f"group commit stored {added} of {len(group)} records (lsn order broken)")
            crash_point("wal_before_commit")

        s.wenv.write(put)  # sync="commit": the env fsyncs inside commit
        crash_point("wal_after_commit")
        elapsed = time.perf_counter() - t0
        self.n_groups += 1
        self.n_records += len(group)
        self.last_size = len(group)
        self.last_s = elapsed
        self.total_s += elapsed
        self.max_s = max(self.max_s, elapsed)
        self.commit_buckets[bisect.bisect_left(COMMIT_S_BOUNDS, elapsed)] += 1
        self.size_buckets[bisect.bisect_left(GROUP_SIZE_BOUNDS, len(group))] += 1
        self.groups_since_reader_check += 1
        with s.cv:
            s.committed_lsn = last
            done = s.tickets.committed(last, synced=s.sync != "interval")
            if s.sync == "interval":
                return
            s.durable_lsn = last
        if s.sync == "commit":
            self.n_syncs += 1
        s.last_tickets = len(done)
        resolve(done, last)

    def sync_now(self) -> int:
        """fsync the environment and resolve every committed-but-unsynced ticket (committer
        thread only). Returns the durable lsn."""
        s = self._s
        with s.cv:
            waiting = s.tickets.take_unsynced()
            last = s.committed_lsn
        try:
            s.wenv.sync()
        except BaseException:
            with s.cv:  # the caller poisons the log, which fails every ticket it holds
                s.tickets.give_back(waiting)
            raise
        self.last_sync_t = time.monotonic()
        self.n_syncs += 1
        with s.cv:
            s.durable_lsn = last
        resolve(waiting, last)
        return last

    def run_job(self, job: Callable[[], object], fut: Future) -> None:
        try:
            result = job()
        except (ValueError, TypeError, WalNoSpaceError) as exc:  # nothing was written
            fut.set_exception(exc)
            return
        # any other failure propagates: the caller poisons the log and fails ``fut``
        fut.set_result(result)

    def maybe_reader_check(self) -> None:
        s = self._s
        now = time.monotonic()
        if self.groups_since_reader_check >= READER_CHECK_GROUPS or now - self.last_reader_check_t >= READER_CHECK_S:
            self.groups_since_reader_check = 0
            self.last_reader_check_t = now
            s.wenv.reader_check()

    def poison(self, exc: BaseException, jobs) -> None:
        s = self._s
        failure = WalFailedError(
            f"write-ahead log {s.wenv.state_dir} failed and accepts nothing more: {exc!r}; "
            f"restart to recover from what reached the disk", s.wenv.state_dir,
        )
        failure.__cause__ = exc
        log.error("wal poisoned path=%s error=%r", s.wenv.state_dir, exc)
        with s.cv:
            s.failure = failure
            futures = s.tickets.take_all()
            futures += [entry[1] for entry in s.jobs] + [f for _, f in jobs]
            s.pending, s.jobs = [], []
            s.cv.notify_all()  # producers waiting on the backlog limit see the failure
        for fut in futures:
            if not fut.done():
                fut.set_exception(failure)
