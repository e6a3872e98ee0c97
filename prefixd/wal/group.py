"""Group commit: appenders buffer records; one committer thread owns every LMDB write txn.

Structure::

    append() --(lock: lsn, key, pending list)--> pending group
    flush()  --> a Future for "every lsn <= the last appended one is durable" (one per lsn)
    committer thread: take the pending group (at most max_group_records) + queued jobs under the
        lock, then outside it: one write txn (cursor.putmulti(append=True)) -> durable per sync
        -> resolve every flush Future whose lsn the group covers
        jobs (checkpoint, sync-now) run after the group they were queued behind

The committer thread's side is ``prefixd.wal.committer.Committer``, a part this class holds; the
two share one ``GroupState`` (the lock, its condition and what they guard).

Invariants (under ``GroupState.cv``):

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
from prefixd.wal.committer import COMMIT_S_BOUNDS, GROUP_SIZE_BOUNDS, Committer, GroupState
from prefixd.wal.env import WalEnv, _pid
from prefixd.wal.errors import WalClosedError, WalFailedError
from prefixd.wal.tickets import done, failed, resolve

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


class GroupCommitter:
    """The pending group, the tickets waiting on it, and the thread that commits it."""

    def __init__(self, wenv: WalEnv, *, sync: str, next_lsn: int, interval_s: float,
                 max_delay_s: float, max_group_records: int) -> None:
        if sync not in SYNC_POLICIES:
            raise ValueError(f"sync must be one of {SYNC_POLICIES}, got {sync!r}")
        self._state = GroupState(wenv, sync=sync, next_lsn=next_lsn, interval_s=interval_s,
                                 max_delay_s=max_delay_s, max_group_records=max_group_records)
        self._committer = Committer(self._state)
        self._pid = wenv.pid
        self._thread = threading.Thread(target=self._committer.run, name="prefixd-wal-committer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sync_now(self) -> int:
        """fsync now and resolve every committed-but-unsynced ticket (committer thread only);
        returns the durable lsn. See ``Committer.sync_now``."""
        return self._committer.sync_now()

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
        s = self._state
        if self._pid != _pid[0]:
            s.wenv.check_usable()  # raises ForkedEnvError
        with s.lock:
            if len(s.pending) >= s.backlog and threading.current_thread() is not self._thread:
                # Backpressure: a producer that outruns the disk waits for the committer
                # instead of growing the backlog (and its memory) without bound.
                s.cv.wait_for(lambda: len(s.pending) < s.backlog // 2
                                  or s.failure is not None or s.closing)
            if s.failure is not None:
                raise s.failure
            if s.closing:
                raise WalClosedError(f"write-ahead log {s.wenv.state_dir} is closed")
            lsn = s.next_lsn
            pending = s.pending
            was_empty = not pending
            for value in values:
                pending.append((pack_key(lsn), value))
                lsn += 1
            s.next_lsn = lsn
            if was_empty and values:
                s.first_append_t = time.monotonic()
                if s.idle:
                    s.cv.notify_all()
            elif len(pending) >= s.max_group:
                s.cv.notify_all()
        return lsn - 1

    def flush(self) -> Future:
        """A ticket for everything appended so far; see ``Wal.flush``."""
        s = self._state
        s.wenv.check_usable()
        with s.cv:
            if s.failure is not None:
                return failed(s.failure)
            last = s.next_lsn - 1
            if last <= s.durable_lsn:
                return done(s.durable_lsn)
            fut = s.tickets.ticket(last, s.committed_lsn)
            if last > s.taken_lsn and not s.flush_wanted:
                s.flush_wanted = True
                s.cv.notify_all()
            return fut

    def flush_into(self, waiters: list) -> None:
        """``flush`` for futures of the caller's own: resolve each ``(future, value)`` with its
        value once every record appended so far is durable, or fail it as ``flush``'s ticket
        would. The engine's commit ticket is such a future (one Future, not one chained on
        another)."""
        s = self._state
        s.wenv.check_usable()
        with s.cv:
            failure = s.failure
            if failure is None:
                last = s.next_lsn - 1
                if last > s.durable_lsn:
                    s.tickets.follow(last, s.committed_lsn, waiters)
                    if last > s.taken_lsn and not s.flush_wanted:
                        s.flush_wanted = True
                        s.cv.notify_all()
                    return
                durable = s.durable_lsn
        if failure is not None:
            for fut, _ in waiters:
                if not fut.done():
                    fut.set_exception(failure)
            return
        resolve(waiters, durable)

    def submit(self, job: Callable[[], object]) -> Future:
        """Run ``job()`` on the committer after the pending group; its result resolves the Future.
        From the committer thread itself the job runs inline (queueing would deadlock)."""
        s = self._state
        s.wenv.check_usable()
        if threading.current_thread() is self._thread:
            return self._run_inline(job)
        fut: Future = Future()
        with s.cv:
            if s.failure is not None:
                return failed(s.failure)
            if s.closing:
                raise WalClosedError(f"write-ahead log {s.wenv.state_dir} is closed")
            s.jobs.append((job, fut, s.next_lsn - 1))
            s.cv.notify_all()
        return fut

    def _run_inline(self, job: Callable[[], object]) -> Future:
        s = self._state
        fut: Future = Future()
        with s.cv:
            if s.failure is not None:
                return failed(s.failure)
            taken = self._committer.take()
        jobs = taken.jobs + [(job, fut)]
        try:
            self._committer.step(taken._replace(jobs=jobs))
        except BaseException as exc:  # noqa: BLE001 - same rule as the thread loop
            self._committer.poison(exc, jobs)
        return fut

    def close(self) -> None:
        """Commit what is pending, make it durable (all policies), stop the thread."""
        s = self._state
        with s.cv:
            s.closing = True
            s.cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    # --- introspection -----------------------------------------------------------------------------

    @property
    def failure(self) -> WalFailedError | None:
        return self._state.failure

    @property
    def durable_lsn(self) -> int:
        """Every record <= this lsn is durable per the sync policy (a plain read: no lock)."""
        return self._state.durable_lsn

    def stats(self) -> WalStats:
        s = self._state
        s, c = self._state, self._committer
        with s.cv:
            lsns = (s.next_lsn, s.committed_lsn, s.durable_lsn)
        return WalStats(c.n_groups, c.n_records, c.last_size, c.last_s, c.total_s,
                        c.max_s, c.n_syncs, c.n_checkpoints, s.wenv.num_map_grows, *lsns,
                        tuple(c.commit_buckets), tuple(c.size_buckets))

    def count_checkpoint(self) -> None:
        self._committer.n_checkpoints += 1

    def check_invariants(self) -> None:
        s = self._state
        with s.cv:
            assert s.durable_lsn <= s.committed_lsn <= s.taken_lsn < s.next_lsn, "lsn order broken"
            s.tickets.check(s.committed_lsn)
            keys = [k for k, _ in s.pending]
            assert keys == sorted(keys), "pending keys out of order"
            if keys:
                assert keys[-1] == pack_key(s.next_lsn - 1), "pending does not end at next_lsn - 1"
            if s.failure is not None:
                assert not s.pending and not s.tickets, "a poisoned log holds records"
