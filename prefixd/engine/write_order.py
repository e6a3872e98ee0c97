"""The write order of a commit: block bytes -> (fsync) -> WAL commit -> acknowledged.

``WriteOrder`` is the part of ``prefixd.engine.durable.DurableCache`` that makes a commit as
durable as asked: it copies the sequence's blocks down to a tier that survives what was asked,
runs the pool's log step, and hands back the ticket. It holds the cache core, the pool's
``OrderedLog`` and the pool's log step (a callable returning the position of the last record it
logged).
"""

from __future__ import annotations

from concurrent.futures import Future

from prefixd.cache.node import DISK, HOST
from prefixd.crashpoints import crash_point
from prefixd.engine.errors import DurabilityError
from prefixd.wal.tickets import done, failed


class WriteOrder:
    """Makes committed blocks durable, in THE write order (``make_durable``)."""

    def __init__(self, cache, order, log_step) -> None:
        self.cache = cache
        self._order = order  # the pool's ``OrderedLog``: tickets by log position
        self._log = log_step  # the pool's log step: drain the events, return the last position

    def make_durable(self, seq, durability: str, value, then=None) -> Future:
        """THE write order of a commit: block bytes -> (fsync) -> WAL commit -> acknowledged.

        1. ``index``: the blocks are already shareable; their records ride in the next group.
        2. Bytes down: every run on the sequence's path gets a copy in a tier that survives
           what was asked (``crash``: host shm or disk; ``power``: disk). Disk writes are
           queued on the store's writer thread (``TierStore.write_behind``).
        3. ``then()`` when given (a committing release drops its sequence here): its records
           follow the commit's in the same submission.
        4. The log step: the records go into the ordered queue (``OrderedLog``); if one names
           a disk slot as holding data, it and everything after it wait for an fdatasync of
           the disk pool that covers the written bytes (data before metadata), then are
           appended in order.
        5. The ticket resolves once the WAL group holding this commit's last record is
           committed and fsynced; only then may the commit be acknowledged. Slots freed by
           evictions on the way become reusable once their records are durable
           (``Upkeep.release_durable``).

        Returns the ticket, resolved with ``value``.

        NOTE: one log step for a committing release, not one for the commit and one for the
        release: the second submission and its periodic checks ran after the WAL was asked
        for the group, while the committer waited for the GIL the serving thread held (the
        ``flush_to_woken`` stage of ``bench/rpc_stages.py``).
        """
        short = None
        if durability != "index":
            short = self.bytes_down(seq, durability)
            if short is None:
                crash_point("commit_data_written")
        if then is not None:
            then()
        pos = self._log()  # a short commit's blocks are indexed: their records go down as ``index``'s
        if short is not None:
            return failed(short)
        if durability == "index":
            return done(value)
        return self._order.ticket(pos, value)

    def bytes_down(self, seq, durability: str) -> DurabilityError | None:
        """Step 2 of ``make_durable``: None once every run on ``seq``'s path has a copy that
        survives ``durability``, else the error (no room in the tier)."""
        want = DISK if durability == "power" else HOST
        if self.cache.allocators[want] is None:
            if want == DISK:
                return DurabilityError("power durability needs a disk tier; this cache has none")
            want = DISK  # crash durability without a host tier: the disk serves
        if self.cache.tiering.write_path_down(seq.node, want):
            return None
        return DurabilityError(f"cannot make sequence {seq.id} {durability}-durable: "
                               f"no room in the {'disk' if want == DISK else 'host'} tier")
