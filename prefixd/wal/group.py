"""Group commit: appenders buffer records; one committer thread owns every LMDB write txn.

Structure::

    append() --(lock: lsn, key, pending list)--> pending group
    flush()  --> a Future for "every lsn <= the last appended one is durable" (one per lsn)
    committer thread: take the pending group (at most max_group_records) + queued jobs under the
        lock, then outside it: one write txn (cursor.putmulti(append=True)) -> durable per sync
        -> resolve every flush Future whose lsn the group covers
        jobs (checkpoint, sync-now) run after the group they were queued behind

Invariants (under ``_cv``):

- lsns are assigned in append order, so ``pending`` keys ascend and are all > ``taken_lsn``;
  ``durable_lsn <= committed_lsn <= taken_lsn < next_lsn`` and ``pending`` holds exactly
  ``taken_lsn + 1 .. next_lsn - 1``.
- A flush ticket (``prefixd.wal.tickets``) resolves with lsn L only when every record <= L is
  durable per the sync policy.
- Once ``failure`` is set it never clears: every open and future ticket fails with
  :class:`WalFailedError`, ``append`` raises it, and the committer has exited.

NOTE: why one thread owns the writes: LMDB allows one write txn at a time per environment and the
txn must be committed by the thread that began it; a dedicated committer lets appends continue
while a commit (two fdatasyncs, GIL released) is in flight, which is exactly what makes groups.

NOTE: Future callbacks run on the committer thread. They must not block on this Wal;
``checkpoint``/``commit_now`` called from that thread run inline instead of queueing.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

from prefixd.crashpoints import crash_point
from prefixd.wal.codec import encode, pack_key
from prefixd.wal.env import WalEnv, _pid
from prefixd.wal.errors import WalClosedError, WalError, WalFailedError
from prefixd.wal.tickets import Tickets, done, failed

log = logging.getLogger(__name__)

SYNC_POLICIES = ("commit", "interval", "none")
READER_CHECK_GROUPS = 4096
READER_CHECK_S = 60.0
GATHER_STEP_S = 0.0003  # a wanted group waits this long for more records, while they keep coming
GATHER_MAX_S = 0.002    # ... at most this long (see GroupCommitter._gather)
# histogram bucket upper bounds (the daemon exports them as prefixd_wal_commit_seconds and
# prefixd_wal_group_records; one more bucket counts what is above the last bound)
COMMIT_S_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5)
GROUP_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


class WalStats(NamedTuple):
    """Counters for metrics (``prefixd_wal_*``). Times in seconds."""

    groups_committed: int
    records_committed: int
    last_group_size: int
    last_commit_s: float
    total_commit_s: float
    max_commit_s: float
    syncs: int
    checkpoints: int
    map_grows: int
    next_lsn: int
    committed_lsn: int
    durable_lsn: int
    # per-group counts by bucket (``COMMIT_S_BOUNDS``, ``GROUP_SIZE_BOUNDS``; last: above them)
    commit_s_buckets: tuple[int, ...] = ()
    group_size_buckets: tuple[int, ...] = ()


class _Taken(NamedTuple):
    """What the committer took under the lock for one step."""

    group: list[tuple[bytes, bytes]]
    last_lsn: int
    jobs: list[tuple[Callable[[], object], Future]]
    closing: bool


class GroupCommitter:
    """The pending group, the tickets waiting on it, and the thread that commits it."""

    def __init__(self, wenv: WalEnv, *, sync: str, next_lsn: int, interval_s: float,
                 max_delay_s: float, max_group_records: int) -> None:
        if sync not in SYNC_POLICIES:
            raise ValueError(f"sync must be one of {SYNC_POLICIES}, got {sync!r}")
        self._wenv = wenv
        self._sync = sync
        self._interval_s = interval_s
        self._max_delay_s = max_delay_s
        self._max_group = max_group_records
        self._backlog = 16 * max_group_records  # appends wait beyond this many pending records
        self._pid = wenv.pid
        self._lock = threading.Lock()  # append takes the lock directly: its C __enter__ is cheaper
        self._cv = threading.Condition(self._lock)
        # --- guarded by _cv ---
        self._pending: list[tuple[bytes, bytes]] = []
        self._tickets = Tickets()
        self._first_append_t = 0.0
        self._flush_wanted = False  # a waiter's lsn is still pending: commit without delay
        self._next_lsn = next_lsn
        self._taken_lsn = next_lsn - 1  # the last lsn the committer took
        self._committed_lsn = next_lsn - 1
        self._durable_lsn = next_lsn - 1
        self._jobs: list[tuple[Callable[[], object], Future, int]] = []  # (job, future, after lsn)
        self._failure: WalFailedError | None = None
        self._closing = False
        self._idle = False
        self._last_tickets = 0  # tickets the last group resolved (read by _gather)
        # --- committer thread only ---
        self._last_sync_t = 0.0
        self._last_reader_check_t = time.monotonic()
        self._groups_since_reader_check = 0
        self._n_groups = self._n_records = self._last_size = self._n_syncs = self._n_checkpoints = 0
        self._last_s = self._total_s = self._max_s = 0.0
        self._commit_buckets = [0] * (len(COMMIT_S_BOUNDS) + 1)
        self._size_buckets = [0] * (len(GROUP_SIZE_BOUNDS) + 1)
        self._thread = threading.Thread(target=self._run, name="prefixd-wal-committer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # --- producer side ----------------------------------------------------------------------------

    def append(self, kind: int, *fields: int | float, blob: bytes = b"") -> int:
        """Buffer one record; see ``Wal.append`` (which is bound to this method)."""
        return self._add((encode(kind, fields, blob),))

    def append_many(self, records) -> int:
        """``append`` for several ``(kind, fields, blob)`` records, encoded outside the lock and
        added under one acquisition; returns the last lsn (the one before, if none)."""
        return self._add([encode(kind, fields, blob) for kind, fields, blob in records])

    def _add(self, values) -> int:
        """Give encoded ``values`` the next lsns, in order, under one lock; returns the last."""
        if self._pid != _pid[0]:
            self._wenv.check_usable()  # raises ForkedEnvError
        with self._lock:
            if len(self._pending) >= self._backlog and threading.current_thread() is not self._thread:
                # Backpressure: a producer that outruns the disk waits for the committer
                # instead of growing the backlog (and its memory) without bound.
                self._cv.wait_for(lambda: len(self._pending) < self._backlog // 2
                                  or self._failure is not None or self._closing)
            if self._failure is not None:
                raise self._failure
            if self._closing:
                raise WalClosedError(f"write-ahead log {self._wenv.state_dir} is closed")
            lsn = self._next_lsn
            pending = self._pending
            was_empty = not pending
            for value in values:
                pending.append((pack_key(lsn), value))
                lsn += 1
            self._next_lsn = lsn
            if was_empty and values:
                self._first_append_t = time.monotonic()
                if self._idle:
                    self._cv.notify_all()
            elif len(pending) >= self._max_group:
                self._cv.notify_all()
        return lsn - 1

    def flush(self) -> Future:
        """A ticket for everything appended so far; see ``Wal.flush``."""
        self._wenv.check_usable()
        with self._cv:
            if self._failure is not None:
                return failed(self._failure)
            last = self._next_lsn - 1
            if last <= self._durable_lsn:
                return done(self._durable_lsn)
            fut = self._tickets.ticket(last, self._committed_lsn)
            if last > self._taken_lsn and not self._flush_wanted:
                self._flush_wanted = True
                self._cv.notify_all()
            return fut

    def submit(self, job: Callable[[], object]) -> Future:
        """Run ``job()`` on the committer after the pending group; its result resolves the Future.
        From the committer thread itself the job runs inline (queueing would deadlock)."""
        self._wenv.check_usable()
        if threading.current_thread() is self._thread:
            return self._run_inline(job)
        fut: Future = Future()
        with self._cv:
            if self._failure is not None:
                return failed(self._failure)
            if self._closing:
                raise WalClosedError(f"write-ahead log {self._wenv.state_dir} is closed")
            self._jobs.append((job, fut, self._next_lsn - 1))
            self._cv.notify_all()
        return fut

    def _run_inline(self, job: Callable[[], object]) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._failure is not None:
                return failed(self._failure)
            taken = self._take()
        jobs = taken.jobs + [(job, fut)]
        try:
            self._step(taken._replace(jobs=jobs))
        except BaseException as exc:  # noqa: BLE001 - same rule as the thread loop
            self._poison(exc, jobs)
        return fut

    def close(self) -> None:
        """Commit what is pending, make it durable (all policies), stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    # --- committer thread -------------------------------------------------------------------------

    def _wait_for_work(self) -> None:
        """Block (holding ``_cv``) until a group, a job, a due fsync or close needs the thread."""
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

    def _take(self) -> _Taken:
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
        return _Taken(group, last, jobs, self._closing and not self._pending)

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

    def _step(self, taken: _Taken) -> None:
        group, last, jobs, closing = taken
        if group:
            self._commit_group(group, last)
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
        for fut in done:
            fut.set_result(last)

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
        for fut in waiting:
            fut.set_result(last)
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

    # --- introspection -----------------------------------------------------------------------------

    @property
    def failure(self) -> WalFailedError | None:
        return self._failure

    @property
    def durable_lsn(self) -> int:
        """Every record <= this lsn is durable per the sync policy (a plain read: no lock)."""
        return self._durable_lsn

    def stats(self) -> WalStats:
        with self._cv:
            lsns = (self._next_lsn, self._committed_lsn, self._durable_lsn)
        return WalStats(self._n_groups, self._n_records, self._last_size, self._last_s, self._total_s,
                        self._max_s, self._n_syncs, self._n_checkpoints, self._wenv.num_map_grows, *lsns,
                        tuple(self._commit_buckets), tuple(self._size_buckets))

    def count_checkpoint(self) -> None:
        self._n_checkpoints += 1

    def check_invariants(self) -> None:
        with self._cv:
            assert self._durable_lsn <= self._committed_lsn <= self._taken_lsn < self._next_lsn, "lsn order broken"
            self._tickets.check(self._committed_lsn)
            keys = [k for k, _ in self._pending]
            assert keys == sorted(keys), "pending keys out of order"
            if keys:
                assert keys[-1] == pack_key(self._next_lsn - 1), "pending does not end at next_lsn - 1"
            if self._failure is not None:
                assert not self._pending and not self._tickets, "a poisoned log holds records"
