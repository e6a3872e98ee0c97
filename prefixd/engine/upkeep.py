"""The log step of one pool and the upkeep that follows it: spill, headroom, quarantine release,
checkpoint.

Every operation of a ``DurableCache`` ends with a log step (``Upkeep.log_step``): the cache's
events go into the ordered queue (``submit``), then the periodic work runs: quarantined slots
whose records are durable come back (``release_durable``), the free-slot headroom is kept ahead
of an eviction (``keep_headroom``), write-through runs waiting for the disk are spilled once a
batch is full (``spill``) and the log is folded into a checkpoint once the trigger says so
(``checkpoint``). The daemon's loop drives the same work through ``tick`` when no call comes.
A tier short only of quarantined slots makes the log durable at once (``force_release``).
"""

from __future__ import annotations

import functools
import logging

from prefixd.cache.node import DISK
from prefixd.crashpoints import crash_point
from prefixd.engine.checkpoint import NO_SPACE_RETRY_S, CheckpointTrigger
from prefixd.engine.checkpointer import Picture
from prefixd.engine.picture_walk import PictureWalk
from prefixd.engine.quarantine import Quarantine
from prefixd.engine.records import scan_events
from prefixd.storage.errors import StorageError
from prefixd.wal import Kind, WalNoSpaceError

log = logging.getLogger(__name__)

TICK_PERIOD_S = 0.1  # how often the daemon's loop is expected to call ``DurableCache.tick``


def poison_on_storage_error(method):
    """A storage error inside an operation leaves events that can never be logged (and bytes
    the kernel may have dropped): poison the log (the ``wal`` of the method's object) so
    nothing more is acknowledged; a restart recovers from what is durable."""

    @functools.wraps(method)
    def guarded(obj, *args, **kwargs):
        try:
            return method(obj, *args, **kwargs)
        except StorageError as exc:
            raise obj.wal.fail(exc) from exc

    return guarded


class Upkeep:
    """One pool's event path into the log and the work that keeps the pool serving.

    Args:
        cache: the recovered ``PrefixCache``.
        store: its ``TierStore`` (the disk barrier a move to disk waits for).
        wal, order: the pool's ``Wal`` and its ``OrderedLog``.
        sessions: live seq id -> session id, and recovered: seq id -> ``RecoveredSeq``: the
            pool's maps, read (never changed) by a checkpoint.
        spill_blocks: batch size of write-through to disk; also the first headroom.
        trigger: when a checkpoint is due.

    Fields: ``quarantine`` (the host and disk allocators' free-before-reuse, and their
    headroom), ``trigger``, ``event_listener`` (called with each batch of events once it is
    submitted; must be O(events) and must not raise), ``on_checkpoint_due`` (None: the log
    step checkpoints inline; else called instead, and the caller runs the checkpoint's parts).

    Invariants (``check_invariants``): the quarantine's (headroom within its cap, no batch
    sealed past the last position) and the trigger's (its tail counts are what was submitted
    since the last checkpoint). Not thread-safe: the pool's caller thread only.
    """

    def __init__(self, cache, store, wal, order, sessions: dict, recovered: dict, *,
                 spill_blocks: int, trigger: CheckpointTrigger) -> None:
        self.cache = cache
        self.store = store
        self.wal = wal
        self.order = order
        self.sessions = sessions
        self.recovered = recovered
        self.spill_blocks = spill_blocks
        self.trigger = trigger
        self.quarantine = Quarantine(cache, order, spill_blocks, store.layout.block_bytes)
        self.event_listener = None
        self.on_checkpoint_due = None
        self.checkpoint_bytes = 0  # the last checkpoint's values (the log's room follows it)

    # -- the log step ----------------------------------------------------------------------------

    def submit(self, session_id: int = 0) -> int:
        """The events as records, in order, into ``OrderedLog``; the quarantine batch they
        freed is sealed with their last position. A move to disk makes the batch a barrier
        behind the disk pool's fdatasync (``TierStore.sync_async``). Returns the position of
        the last record."""
        order = self.order
        events = self.cache.drain_events()
        if not events:
            return order.position
        if self.wal.failure is not None:  # no more fdatasyncs: nothing will be acknowledged
            raise self.wal.failure
        at, blocks = scan_events(events)
        barrier = self.store.sync_async(DISK) if at >= 0 else None  # the int: see TierStore.copy
        pos = order.submit(events, session_id, barrier, at)
        self.quarantine.seal(pos)
        if self.event_listener is not None:
            self.event_listener(events)
        self.trigger.count(len(events), blocks)
        return pos

    def log_step(self, session_id: int = 0, keep_headroom: bool = True) -> int:
        """``submit``, then the periodic work (release durable quarantine, keep headroom,
        spill, checkpoint). Returns the position of the last record this step submitted
        (before any spill it started).

        NOTE: ``DurableCache.open`` passes ``keep_headroom=False``: evicting ahead there
        cascades a whole radix node down a tier (a 128-block run: 47 MB into the disk file) on
        the time to first token, while the client computes its prefill between ``open`` and
        ``commit``. The next log step or ``tick`` keeps the headroom instead."""
        pos = self.submit(session_id)
        self.quarantine.release_durable()
        if keep_headroom:
            self.keep_headroom()
        if self.cache.tiering.pending_disk_blocks >= self.spill_blocks:
            self.spill()
        if self.trigger.due():
            self.checkpoint_due()
        return pos

    def open_epoch(self, recovered) -> None:
        """The first log step after ``recover`` (``recovered``: its ``Recovered``): the first
        checkpoint of a new state directory, or the RECOVER record that opens this restart's
        epoch (then a checkpoint when a pool file got a new id)."""
        wal = self.wal
        if recovered.first_start:
            self.checkpoint()
            return
        # NOTE: the one record appended beside the event path (``submit``): it is about the
        # engine's restart, not a change of the cache, and it must come first in the new epoch,
        # before any event of it, while nothing else is queued.
        wal.append(Kind.RECOVER, wal.open_epoch(), int(recovered.keep_host))
        self.log_step()
        wal.flush().result()
        if recovered.new_file_ids:
            # NOTE: the host pool was just created with a new file id, and file ids are
            # persisted only by checkpoints: without one, the next restart on this boot would
            # find this file, expect the old id and refuse to start. The same for a disk pool
            # recreated in place of a lost one.
            self.checkpoint()
        else:
            # NOTE: the replayed tail stays in the log until the next checkpoint, so it counts
            # toward the trigger; counted only now, so that a checkpoint it makes due is taken
            # by the first operation after ready rather than before it.
            self.trigger.count(recovered.tail_records, recovered.tail_blocks)

    def settle(self) -> None:
        """Submit every event and wait until no record is held behind a disk barrier (before a
        checkpoint dump, which must not include effects whose records are not yet in the log)."""
        self.submit()
        self.order.settle()

    # -- quarantine and headroom -----------------------------------------------------------------

    def release_durable(self) -> None:
        """Free before reuse, by watermark (``Quarantine.release_durable``): cheap when idle."""
        self.quarantine.release_durable()

    def keep_headroom(self) -> None:
        quarantine = self.quarantine
        if quarantine.low():
            quarantine.evict_ahead()  # see prefixd.engine.quarantine
            self.submit()

    def force_release(self) -> None:
        """A lower tier is short only of quarantined slots (the cache's
        ``on_deferred_shortage``): make their drops durable now (the one place the serving
        thread waits for the disk and the log), release them, and keep more headroom."""
        self.submit()
        self.order.settle()
        if self.wal.sync == "interval":
            self.wal.commit_now()  # not the next periodic fsync: now
        else:
            self.wal.flush().result()  # durable as ``sync`` defines it
        self.quarantine.after_force()

    # -- periodic work ---------------------------------------------------------------------------

    @poison_on_storage_error
    def spill(self) -> int:
        """Write-through to disk for the runs waiting for it: queued writes, one fdatasync for
        the batch on the disk sync thread (their records wait for it in order)."""
        moved = self.cache.tiering.spill()
        if moved:
            self.log_step()
        return moved

    def tick(self) -> None:
        """Spill write-through runs waiting for disk (else they wait for ``spill_blocks`` of
        them), release durable quarantine, keep the headroom an ``open`` left, and drop the
        marks of durable records (else they pile up)."""
        self.spill()
        self.release_durable()
        self._tick_headroom()
        self.order.durable_position()

    @poison_on_storage_error
    def _tick_headroom(self) -> None:
        """What an ``open`` left undone when no other call came before the tick."""
        self.keep_headroom()

    # -- checkpoint: a picture on the engine's thread, its bytes anywhere, the write on the log's
    # committer (``prefixd.engine.checkpointer``); ``checkpoint`` runs the three in a row, the
    # daemon runs them apart so that its loop serves meanwhile (``prefixd.daemon.offloop``)

    def checkpoint_due(self) -> None:
        """The log step's trigger fired (records or blocks since the last checkpoint)."""
        if self.on_checkpoint_due is not None:
            self.on_checkpoint_due()
            return
        try:
            self.checkpoint()
        except WalNoSpaceError as exc:
            self.checkpoint_no_space(exc)

    def checkpoint_no_space(self, exc: WalNoSpaceError) -> None:
        """A checkpoint met a full filesystem: the log is intact and keeps every record; the
        next is due in ``NO_SPACE_RETRY_S`` (one WARNING per episode)."""
        if not self.trigger.not_before:
            log.warning("checkpoint postponed: its filesystem is full (the log keeps every "
                        "record; retried every %.0f s) error=%s", NO_SPACE_RETRY_S, exc)
        self.trigger.postpone(NO_SPACE_RETRY_S)

    def checkpoint_barrier(self):
        """The disk barrier (a Future) a checkpoint would wait for now, or None: a caller that
        must not block waits for it first, then ``begin_checkpoint`` does not block."""
        self.submit()
        return self.order.pending_barrier()

    def begin_picture(self) -> PictureWalk:
        """Start the picture of the index (``PictureWalk``): the caller ``step``s it between
        its other work, then hands it to ``begin_checkpoint``, which finishes it."""
        return PictureWalk(self.cache.tree)

    @poison_on_storage_error
    def begin_checkpoint(self, walk: PictureWalk | None = None) -> Picture:
        """Settle the log and picture the state at its last lsn (on the engine's thread):
        finish ``walk`` (stepped to its end), or walk the whole index now."""
        try:
            self.settle()  # every event logged, none held behind a disk barrier: the picture
            # holds no effect whose record is not in the log before its ``lsn``
            trigger = self.trigger
            return Picture.take(self.cache, self.sessions, self.recovered.values(),
                                self.store.file_ids, self.wal.stats().next_lsn - 1,
                                trigger.tail_records, trigger.tail_blocks, walk)
        finally:
            if walk is not None:
                walk.close()

    def submit_checkpoint(self, picture: Picture, index: dict, seqs: dict):
        """Hand ``picture``'s values (``Picture.values``) to the log; returns the Future of
        the write (any thread)."""
        crash_point("checkpoint_dumped")
        self.checkpoint_bytes = sum(_value_bytes(v) for part in (index, seqs) for v in part.values())
        return self.wal.submit_checkpoint(picture.lsn, index, seqs)

    @poison_on_storage_error
    def end_checkpoint(self, picture: Picture) -> None:
        """After ``picture``'s checkpoint is durable (on the engine's thread): the records
        logged since the picture count towards the next one; free what the log allows."""
        self.trigger.taken(picture.since_records, picture.tail_blocks)
        self.release_durable()

    @poison_on_storage_error
    def checkpoint(self) -> int:
        """Fold the log into a checkpoint of the current state; returns its lsn."""
        picture = self.begin_checkpoint()
        index, seqs = picture.values()
        self.submit_checkpoint(picture, index, seqs).result()
        self.end_checkpoint(picture)
        return picture.lsn

    def check_invariants(self) -> None:
        self.quarantine.check_invariants()
        self.trigger.check_invariants()


def _value_bytes(value) -> int:
    """Bytes of a checkpoint value: one buffer, or its list of chunks."""
    if isinstance(value, (list, tuple)):
        return sum(memoryview(c).nbytes for c in value)
    return memoryview(value).nbytes
