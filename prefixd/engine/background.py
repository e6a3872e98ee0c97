"""The engine's background work: spill, tick, checkpoint, headroom and forced reclaim.

``BackgroundWork`` is the half of ``DurableCache`` (``prefixd.engine.durable``) that is not an
operation's own write order: the periodic work the daemon's loop drives through ``tick`` and the
log step runs after each operation (``DurableCache._log``): disk write-through batches
(``spill``), free-slot headroom ahead of an eviction (``_keep_headroom``), the quarantine's
reclaim (``_reclaim``, and ``_force_reclaim`` when a tier is short only of quarantined slots),
and folding the log into a checkpoint (``checkpoint``).

NOTE: a mixin, not an object of its own: every step reads the same state the operations do (the
cache, the store, the WAL, ``OrderedLog``, the quarantine, the checkpoint counters) and logs
through ``DurableCache._submit_events``; a separate object would need all of it passed in or
reached into. The split is by concept, for the reader; ``DurableCache`` is still the one class,
with one set of invariants (``DurableCache.check_invariants``).
"""

from __future__ import annotations

import functools

from prefixd.crashpoints import crash_point
from prefixd.engine.checkpointer import Picture
from prefixd.storage.errors import StorageError

TICK_PERIOD_S = 0.1  # how often the daemon's loop is expected to call ``DurableCache.tick``


def poison_on_storage_error(method):
    """A storage error inside an operation leaves events that can never be logged (and bytes
    the kernel may have dropped): poison the log so nothing more is acknowledged; a restart
    recovers from what is durable."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except StorageError as exc:
            raise self.wal.fail(exc) from exc

    return guarded


class BackgroundWork:
    """The background half of ``DurableCache``; not used alone (see the module's NOTE).

    Expects of its subclass: ``cache``, ``store``, ``wal``, ``cluster``, ``recovered``,
    ``spill_blocks``, ``_order``, ``_quarantine``, ``_sessions``, ``_since_checkpoint``,
    ``_tail_blocks``, and the methods ``_log``, ``_submit_events`` and ``_expire_if_due``.
    Invariants: those of ``DurableCache.check_invariants``; this half holds no state of its own.
    """

    def _keep_headroom(self) -> None:
        quarantine = self._quarantine
        if quarantine.low():
            quarantine.evict_ahead()  # see prefixd.engine.quarantine
            self._submit_events()

    def _reclaim(self) -> None:
        """Free before reuse, by watermark (``Quarantine.release_durable``): cheap when idle."""
        self._quarantine.release_durable()

    def _force_reclaim(self) -> None:
        """A lower tier is short only of quarantined slots: make their drops durable now (the
        one place the serving thread waits for the disk and the log), and keep more headroom."""
        self._submit_events()
        self._order.settle()
        if self.wal.sync == "interval":
            self.wal.commit_now()  # not the next periodic fsync: now
        else:
            self.wal.flush().result()  # durable as ``sync`` defines it
        self._quarantine.after_force()

    @property
    def forced_reclaims(self) -> int:
        """How often a tier short only of quarantined slots made the serving thread wait."""
        return self._quarantine.num_forced

    def _settle(self) -> None:
        """Log every event and wait until no record is held behind a disk barrier (before a
        checkpoint dump, which must not include effects whose records are not yet in the log)."""
        self._submit_events()
        self._order.settle()

    @poison_on_storage_error
    def spill(self) -> int:
        """Write-through to disk for the runs waiting for it: queued writes, one fdatasync for
        the batch on the disk sync thread (their records wait for it in order)."""
        moved = self.cache.tiering.spill()
        if moved:
            self._log()
        return moved

    def tick(self) -> None:
        """Periodic work the daemon's loop calls about every 100 ms (``TICK_PERIOD_S``): spill
        write-through runs waiting for disk (else they wait for ``spill_blocks`` of them), keep
        the headroom an ``open`` left, and release unclaimed recovered sequences (which every
        mutating call also does)."""
        if self.cluster is not None:
            self._write_down_promoted()
        self.spill()
        self._reclaim()
        self._tick_headroom()
        self._order.durable_position()  # drops the marks of durable records (else they pile up)
        self._expire_if_due()

    @poison_on_storage_error
    def _tick_headroom(self) -> None:
        """What an ``open`` left undone when no other call came before the tick."""
        self._keep_headroom()

    @poison_on_storage_error
    def _write_down_promoted(self) -> None:
        """Runs promoted from the cluster were indexed at the device alone (``ClusterTier.tick``)."""
        if self.cluster.tick():
            self._log()

    # -- checkpoint: a picture on the engine's thread, its bytes anywhere, the write on the log's
    # committer (``prefixd.engine.checkpointer``); ``checkpoint`` runs the three in a row, the
    # daemon runs them apart so that its loop serves meanwhile (``prefixd.daemon.offloop``)

    on_checkpoint_due = None  # None: the log step checkpoints inline; else called instead

    def _checkpoint_due(self) -> None:
        """The log step's trigger fired (records or blocks since the last checkpoint)."""
        if self.on_checkpoint_due is None:
            self.checkpoint()
        else:
            self.on_checkpoint_due()

    def checkpoint_barrier(self):
        """The disk barrier (a Future) a checkpoint would wait for now, or None: a caller that
        must not block waits for it first, then ``begin_checkpoint`` does not block."""
        self._submit_events()
        return self._order.pending_barrier()

    @poison_on_storage_error
    def begin_checkpoint(self) -> Picture:
        """Settle the log and picture the state at its last lsn (on the engine's thread)."""
        self._settle()  # every event logged, none held behind a disk barrier: the picture
        # holds no effect whose record is not in the log before its ``lsn``
        return Picture.take(self.cache, self._sessions, self.recovered.values(),
                            self.store.file_ids, self.wal.stats().next_lsn - 1,
                            self._since_checkpoint, self._tail_blocks)

    def submit_checkpoint(self, picture: Picture, index: dict, seqs: dict):
        """Hand ``picture``'s values (``Picture.values``) to the log; returns the Future of
        the write (any thread)."""
        crash_point("checkpoint_dumped")
        return self.wal.submit_checkpoint(picture.lsn, index, seqs)

    @poison_on_storage_error
    def end_checkpoint(self, picture: Picture) -> None:
        """After ``picture``'s checkpoint is durable (on the engine's thread): the records
        logged since the picture count towards the next one; free what the log allows."""
        self._since_checkpoint = max(self._since_checkpoint - picture.since_records, 0)
        self._tail_blocks = max(self._tail_blocks - picture.tail_blocks, 0)
        self._reclaim()

    @poison_on_storage_error
    def checkpoint(self) -> int:
        """Fold the log into a checkpoint of the current state; returns its lsn."""
        picture = self.begin_checkpoint()
        index, seqs = picture.values()
        self.submit_checkpoint(picture, index, seqs).result()
        self.end_checkpoint(picture)
        return picture.lsn
