"""The engine's records into the WAL in the order the cache made them, behind disk barriers.

Structure::

    submit(events, session_id, barrier, at) -> pos
                                          the events' records get positions pos-len+1 .. pos
                                          (engine thread)
        nothing held and no barrier: encoded and appended now (WAL append: a lock, no I/O)
        else events[:at] appended now if nothing is held; from events[at:] on, everything
        (later submissions too) waits until ``barrier`` (the disk fdatasync covering the bytes
        those records name) resolves; the thread that resolves it encodes and appends them,
        in order
    ticket(pos, value) -> Future          resolved with ``value`` once every record <= pos is
                                          durable in the WAL (after its barriers)
    durable_position() -> pos             every record <= pos is durable (engine thread: cheap)
    settle()                              block until nothing is held (checkpoint, close, force)

Invariants (under ``_lock``): held segments are in submission order and their positions follow
``appended`` without a gap; ``marks`` (position, lsn) ascend in both; waiting tickets are for
positions beyond ``appended``. Once ``failure`` is set it never clears: nothing more is appended
and every open and later ticket fails with it.

NOTE: a barrier holds back every later record, not just those naming disk slots: replay applies
records in log order and splits runs where a record names a block inside one, so a BLOCK_MOVE
to disk appended after a later BLOCK_DROP of the same run (or a split of it) would not replay.
See docs/design.md "The write order and free-before-reuse".

NOTE: records are encoded when they are appended (``records.encode_events``), not when they
are submitted: held behind a barrier, which is most of the time under a steady load (a spill's
fdatasync takes milliseconds), they are encoded on the thread that resolves it, a batch at a
time, off the serving thread, where encoding one record at a time cost ~5 us each in cold
caches (docs/design.md, "The write order and free-before-reuse"). This relies on the events being immutable once
made (``prefixd.cache.events``): a payload list changed in place later would be logged as
changed. ``tests/engine/test_ordered_log.py`` holds the engine to it.

NOTE: positions, not lsns, are what the engine hands out: a record held behind a barrier has no
lsn yet. ``marks`` map positions to lsns as records are appended, and the durable watermark
(``durable_position``) is read from the WAL's durable lsn through them.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, NamedTuple

from prefixd.crashpoints import crash_point
from prefixd.engine.records import encode_events

log = logging.getLogger(__name__)


class _Held(NamedTuple):
    barrier: Future | None  # None: only waits for the segments before it
    batches: list  # (events, session_id), in order
    count: int  # events in ``batches``
    last_pos: int


class OrderedLog:
    """Appends the engine's records to ``wal`` in order; hands out tickets by position.

    Args:
        wal: the ``prefixd.wal.Wal`` (``append_values``, ``flush_into``, ``fail``, ``durable_lsn``).
    """

    def __init__(self, wal) -> None:
        self._wal = wal
        self._lock = threading.Lock()
        # --- guarded by _lock ---
        self._held: deque[_Held] = deque()
        self._position = 0  # the last position handed out (engine thread writes it)
        self._appended = 0  # every record <= this position is in the WAL
        self._waiting: deque[tuple[int, Future, Any]] = deque()  # tickets beyond _appended
        self._failure: BaseException | None = None
        # --- marks: appended under _lock, popped by the engine thread only ---
        self._marks: deque[tuple[int, int]] = deque()  # (last position, its lsn)
        self._durable_pos = 0

    @property
    def position(self) -> int:
        """The last position handed out."""
        return self._position

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def num_held(self) -> int:
        return sum(h.count for h in self._held)

    def submit(self, events: list, session_id: int = 0, barrier: Future | None = None, at: int = 0) -> int:
        """Queue the records of ``events`` (the cache's, in order; OPEN records carry
        ``session_id``) after everything submitted before.

        Args:
            barrier: a Future that the records of ``events[at:]`` (and everything after them)
                must wait for.
        Returns:
            The position of the last record.
        Raises:
            WalFailedError (or the barrier's error made one): the log failed; nothing appended.
            An event that has no record fails the log the same way (its effects are in memory
            and can never be logged).
        """
        first = self._position + 1
        last = self._position = self._position + len(events)
        failure = None
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if not self._held:
                now = events if barrier is None else events[:at]
                if now:
                    try:
                        self._append([(now, session_id)], first + len(now) - 1)
                    except BaseException as exc:  # noqa: BLE001 - fails the log, below
                        failure = exc
                if barrier is None or failure is not None:
                    events = []
                else:
                    events = events[at:]
            if events:
                held = self._held
                if barrier is None and held and held[-1].barrier is None:
                    prev = held.pop()
                    held.append(_Held(None, prev.batches + [(events, session_id)], prev.count + len(events), last))
                else:
                    held.append(_Held(barrier, [(events, session_id)], len(events), last))
        if failure is not None:
            self._fail(failure)
            raise self._failure  # type: ignore[misc]
        if barrier is not None:
            barrier.add_done_callback(self._drain)
        return last

    def ticket(self, pos: int, value: Any) -> Future:
        """A Future resolved with ``value`` once every record <= ``pos`` is durable in the WAL,
        or failed with the WAL's error (``WalFailedError``)."""
        fut: Future = Future()
        with self._lock:
            if self._failure is not None:
                fut.set_exception(self._failure)
                return fut
            if pos > self._appended:
                self._waiting.append((pos, fut, value))
                return fut
        self._wal.flush_into([(fut, value)])  # the WAL resolves this very Future
        return fut

    @property
    def num_marks(self) -> int:
        """Appended steps whose durability is not yet folded into ``durable_position``."""
        return len(self._marks)

    def durable_position(self) -> int:
        """Every record at or below the returned position is durable (engine thread only)."""
        marks = self._marks
        if marks:
            durable_lsn = self._wal.durable_lsn
            while marks and marks[0][1] <= durable_lsn:
                self._durable_pos = marks.popleft()[0]
        return self._durable_pos

    def pending_barrier(self):
        """The barrier ``settle`` would wait for now (a Future), or None when nothing is held
        or every barrier passed."""
        with self._lock:
            barrier = next((h.barrier for h in reversed(self._held) if h.barrier is not None), None)
        return barrier if barrier is not None and not barrier.done() else None

    def settle(self) -> None:
        """Block until every record submitted so far is appended (disk barriers passed).

        Raises:
            WalFailedError: the log failed (a barrier's write or fdatasync failed, or the WAL).
        """
        while True:
            with self._lock:
                if self._failure is not None:
                    raise self._failure
                if not self._held:
                    return
                barrier = next((h.barrier for h in reversed(self._held) if h.barrier is not None), None)
            if barrier is not None:
                try:
                    barrier.result()
                except BaseException:  # noqa: BLE001 - _drain turns it into the log's failure
                    pass
            self._drain(barrier)

    # --- internals ---------------------------------------------------------------------------

    def _append(self, batches: list, last_pos: int) -> None:
        """Under ``_lock``: encode ``batches`` (``(events, session_id)``), append them to the
        WAL, remember the mark, resolve tickets now covered."""
        values: list[bytes] = []
        for events, session_id in batches:
            values += encode_events(events, session_id)
        lsn = self._wal.append_values(values)
        self._appended = last_pos
        if values:
            self._marks.append((last_pos, lsn))
        waiting = self._waiting
        if waiting and waiting[0][0] <= last_pos:
            due = []
            while waiting and waiting[0][0] <= last_pos:
                _, fut, value = waiting.popleft()
                due.append((fut, value))
            self._wal.flush_into(due)

    def _drain(self, _barrier: Future | None = None) -> None:
        """Append the held segments whose barriers have resolved, in order (any thread)."""
        failure = None
        with self._lock:
            held = self._held
            while held and self._failure is None:
                head = held[0]
                if head.barrier is not None:
                    if not head.barrier.done():
                        return
                    exc = head.barrier.exception()
                    if exc is not None:
                        failure = exc
                        break
                    crash_point("commit_data_synced")
                held.popleft()
                try:
                    self._append(head.batches, head.last_pos)
                except BaseException as exc:  # noqa: BLE001 - the WAL failed: fail every ticket
                    failure = exc
                    break
        if failure is not None:
            self._fail(failure)

    def _fail(self, cause: BaseException) -> None:
        """A barrier (disk write or fdatasync) or an append failed: poison the WAL (the records
        behind the barrier can never be logged), fail every waiting ticket, drop what is held."""
        from prefixd.wal import WalFailedError

        error = cause if isinstance(cause, WalFailedError) else self._wal.fail(cause)
        with self._lock:
            if self._failure is None:
                self._failure = error
            waiting = [fut for _, fut, _ in self._waiting]
            self._waiting.clear()
            self._held.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(self._failure)
        log.error("ordered log failed: %r", cause)

    def check_invariants(self) -> None:
        with self._lock:
            pos = self._appended
            for h in self._held:
                assert h.count == sum(len(events) for events, _ in h.batches), "a held count is wrong"
                assert h.last_pos - h.count == pos, "held records out of order"
                pos = h.last_pos
            assert pos == self._position, "positions handed out but neither appended nor held"
            marks = list(self._marks)
            assert marks == sorted(marks) and [m[1] for m in marks] == sorted(m[1] for m in marks)
            assert all(p > self._appended for p, _, _ in self._waiting), "a covered ticket waits"
