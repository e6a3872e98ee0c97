"""Write-behind for the disk pool: queued writes on one thread, shared fdatasyncs on another.

Structure::

    submit(job, nbytes) -> n     job n runs on the writer thread, in submission order
    wait_written()               until every job submitted so far has run (not synced)
    sync() -> Future             resolved once an fdatasync that started after every job
                                 submitted before the call had run has returned
    writer thread: run jobs FIFO      sync thread: wait for the writer to pass the oldest
                                      waiter's job, fdatasync once, resolve every waiter it covers

Invariants (under ``_cv``): ``synced <= written <= submitted``; waiters' targets ascend and all
exceed ``synced``; ``pending_bytes`` is the bytes of jobs not yet run. Once ``failure`` is set it
never clears: queued jobs are dropped, ``submit`` raises it, every sync Future fails with it.

NOTE: two threads, not one: a reader of the disk pool waits for queued writes (so it never sees
a slot's old bytes), and that wait must not include an fdatasync queued between two writes. An
fdatasync on the sync thread covers every write the writer finished before it started (and
maybe more), so a waiter is resolved only by an fdatasync that began after its target job ran.

NOTE: a failed write or fdatasync fails the writer for good rather than retrying: the kernel may
have dropped the pages it could not write, and a retried fdatasync can "succeed" over lost bytes
(the engine poisons its log on it, as for a synchronous fdatasync).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable

from prefixd.storage.errors import StorageError

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 64 << 20  # submit waits beyond this much unwritten data (backpressure)


def _done_future() -> Future:
    fut: Future = Future()
    fut.set_result(None)
    return fut


class DiskWriter:
    """Runs the disk pool's writes behind the caller and groups their fdatasyncs.

    Args:
        sync_fn: makes every finished write durable (the pool's fdatasync); runs on the sync
            thread.
        name: for thread names and messages (the pool file).
        max_pending_bytes: ``submit`` blocks while more than this is queued.
    """

    def __init__(self, sync_fn: Callable[[], object], name: str, *,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self._sync_fn = sync_fn
        self.name = name
        self._max_pending = max_pending_bytes
        self._cv = threading.Condition()
        # --- guarded by _cv ---
        self._jobs: deque[tuple[int, Callable[[], object], int]] = deque()
        self._submitted = self._written = self._synced = 0
        self._pending_bytes = 0
        self._waiters: deque[tuple[int, Future]] = deque()  # (job number, Future), ascending
        self._failure: BaseException | None = None
        self._closing = False
        self._writer_done = False
        self.num_syncs = 0
        self._writer = threading.Thread(target=self._write_loop, name="prefixd-disk-writer", daemon=True)
        self._syncer = threading.Thread(target=self._sync_loop, name="prefixd-disk-sync", daemon=True)
        self._writer.start()
        self._syncer.start()

    # --- callers ----------------------------------------------------------------------------------

    def submit(self, job: Callable[[], object], nbytes: int) -> int:
        """Queue ``job`` (a write into the pool); returns its number.

        Raises:
            StorageError: an earlier write or fdatasync failed (nothing more is accepted).
        """
        with self._cv:
            if self._pending_bytes > self._max_pending:
                self._cv.wait_for(lambda: self._pending_bytes <= self._max_pending or self._failure is not None)
            if self._failure is not None:
                raise self._failure
            if self._closing:
                raise StorageError(f"disk writer of {self.name} is closed")
            n = self._submitted = self._submitted + 1
            self._jobs.append((n, job, nbytes))
            self._pending_bytes += nbytes
            if len(self._jobs) == 1:
                self._cv.notify_all()
        return n

    def wait_written(self) -> None:
        """Block until every job submitted so far has run (its bytes are in the file, not synced).

        Raises:
            StorageError: a write failed.
        """
        if self._written == self._submitted:  # racy read, exact for this thread's own jobs
            if self._failure is not None:
                raise self._failure
            return
        with self._cv:
            target = self._submitted
            self._cv.wait_for(lambda: self._written >= target or self._failure is not None)
            if self._failure is not None:
                raise self._failure

    def sync(self) -> Future:
        """A Future for "every job submitted so far is durable"; failed with the StorageError
        of a failed write or fdatasync. Concurrent callers share fdatasyncs."""
        with self._cv:
            if self._failure is not None:
                fut: Future = Future()
                fut.set_exception(self._failure)
                return fut
            target = self._submitted
            if target <= self._synced:
                return _done_future()
            if self._waiters and self._waiters[-1][0] == target:
                return self._waiters[-1][1]
            fut = Future()
            self._waiters.append((target, fut))
            self._cv.notify_all()
            return fut

    def idle(self) -> bool:
        """Whether every job submitted so far has run (a racy read, exact for the thread that
        submits: nothing it queued is still waiting)."""
        return self._written == self._submitted

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def close(self) -> None:
        """Run the queued jobs and pending syncs, then stop both threads. Idempotent."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for thread in (self._writer, self._syncer):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()

    # --- the threads ------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closing or self._failure is not None)
                if self._failure is not None or not self._jobs:
                    self._writer_done = True
                    self._cv.notify_all()
                    return
                n, job, nbytes = self._jobs.popleft()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - any failure fails the writer for good
                self._fail(exc)
                return
            with self._cv:
                self._written = n
                self._pending_bytes -= nbytes
                self._cv.notify_all()

    def _sync_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._failure is not None
                                  or (self._waiters and self._written >= self._waiters[0][0])
                                  or (self._writer_done and not self._waiters))
                if self._failure is not None or not self._waiters:
                    return
                upto = self._written
            try:
                self._sync_fn()
            except BaseException as exc:  # noqa: BLE001
                self._fail(exc)
                return
            done = []
            with self._cv:
                self.num_syncs += 1
                self._synced = max(self._synced, upto)
                while self._waiters and self._waiters[0][0] <= upto:
                    done.append(self._waiters.popleft()[1])
            for fut in done:
                fut.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if not isinstance(exc, StorageError):
            wrapped = StorageError(f"disk write-behind of {self.name} failed: {exc!r}")
            wrapped.__cause__ = exc
            exc = wrapped
        log.error("disk writer failed path=%s error=%r", self.name, exc)
        with self._cv:
            if self._failure is None:
                self._failure = exc
            waiters = [fut for _, fut in self._waiters]
            self._waiters.clear()
            self._jobs.clear()
            self._pending_bytes = 0
            self._cv.notify_all()
        for fut in waiters:
            fut.set_exception(self._failure)

    def check_invariants(self) -> None:
        with self._cv:
            assert self._synced <= self._written <= self._submitted or self._failure is not None
            targets = [t for t, _ in self._waiters]
            assert targets == sorted(set(targets)), "sync waiters out of order"
            assert all(t > self._synced for t in targets), "a covered sync waiter is still waiting"
