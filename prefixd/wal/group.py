"""Group commit: appenders buffer records; one committer thread owns every LMDB write txn.

Structure::

    append() --(lock: lsn, key, pending list)--> pending group
    flush()  --> a Future for "every lsn <= the last appended one is durable" (one per lsn)
    committer thread: take the pending group (at most max_group_records) + queued jobs under the
        lock, then outside it: one write txn (cursor.putmulti(append=True)) -> durable per sync
        -> resolve every flush Future whose lsn the group covers
        jobs (checkpoint, sync-now) run after the group they were queued behind

The committer thread's side is ``prefixd.wal.committer.CommitterLoop`` (a mixin of this class).

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

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

from prefixd.wal.codec import encode, pack_key
from prefixd.wal.committer import COMMIT_S_BOUNDS, GROUP_SIZE_BOUNDS, CommitterLoop
from prefixd.wal.env import WalEnv, _pid
from prefixd.wal.errors import WalClosedError, WalFailedError
from prefixd.wal.tickets import Tickets, done, failed, resolve

log = logging.getLogger(__name__)

SYNC_POLICIES = ("commit", "interval", "none")
# COMMIT_S_BOUNDS, GROUP_SIZE_BOUNDS live in ``committer`` with the loop that counts by them;
# re-exported here, where the daemon's metrics import them from
__all__ = ["COMMIT_S_BOUNDS", "GROUP_SIZE_BOUNDS", "SYNC_POLICIES", "GroupCommitter", "WalStats"]


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


class GroupCommitter(CommitterLoop):
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
        self._last_group_t = 0.0  # when the last group committed (the linger: committer.py)
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

    def append_values(self, values) -> int:
        """Add values encoded already (``codec.frame``), in order, under one lock; returns the
        last lsn. See ``Wal.append_values``."""
        return self._add(values)

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

    def flush_into(self, waiters: list) -> None:
        """``flush`` for futures of the caller's own: resolve each ``(future, value)`` with its
        value once every record appended so far is durable, or fail it as ``flush``'s ticket
        would. The engine's commit ticket is such a future (one Future, not one chained on
        another)."""
        self._wenv.check_usable()
        with self._cv:
            failure = self._failure
            if failure is None:
                last = self._next_lsn - 1
                if last > self._durable_lsn:
                    self._tickets.follow(last, self._committed_lsn, waiters)
                    if last > self._taken_lsn and not self._flush_wanted:
                        self._flush_wanted = True
                        self._cv.notify_all()
                    return
                durable = self._durable_lsn
        if failure is not None:
            for fut, _ in waiters:
                if not fut.done():
                    fut.set_exception(failure)
            return
        resolve(waiters, durable)

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
