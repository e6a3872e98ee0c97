"""Free before reuse for the host and disk tiers: quarantined slots come back by watermark.

A host or disk slot freed by an eviction may still be named by a durable record (the log says
block H is in slot S until the BLOCK_DROP that frees S is durable), so it waits in its
allocator's quarantine (``SlotAllocator.defer_free``). Each batch of events the engine logs
seals the open quarantine batch with the ``OrderedLog`` position of its last record (the record
that freed those slots is at or before it); ``release_durable`` makes every batch whose position
the durable watermark covers allocatable. The engine calls it on its own thread at every log
step and tick: a deque peek per tier when there is nothing to do.

Headroom: freed slots come back one fsync (and maybe one disk barrier) later, so a tier under
steady eviction would find only quarantined slots at its next allocation and force the log
(``Upkeep.force_release``, the one wait for the disk on the serving thread). Each force
raises the tier's headroom: every log step then keeps that many free or quarantined slots by
evicting ahead, as kswapd keeps free pages.

Invariants (``check_invariants``): ``headroom[k]`` is within ``[0, cap[k]]``, the cap being
``MAX_HEADROOM_BATCHES`` first-headroom batches, at most an eighth of the tier and
``HEADROOM_BYTES``; every sealed
batch's mark is at most the engine's last position.
"""

from __future__ import annotations

import logging

from prefixd.cache.node import DISK, HOST

log = logging.getLogger(__name__)

MAX_HEADROOM_BATCHES = 8  # headroom cap, in ``first_headroom`` batches (class NOTE)
HEADROOM_BYTES = 1 << 20  # ... and in bytes, per tier of a pool (class NOTE)


class Quarantine:
    """The host and disk allocators of one cache, their watermark and their headroom.

    Args:
        cache: the ``PrefixCache`` (its allocators and ``evict``), or ``None`` (no tiers yet).
        order: the ``OrderedLog`` (positions and the durable watermark).
        first_headroom: the headroom after the first force (the engine's ``spill_blocks``).

    NOTE: no headroom until a shortage forces the log: a cache that never waits keeps all of
    its capacity. The first force sets it to ``first_headroom``, each next one doubles it, up to
    ``MAX_HEADROOM_BATCHES`` batches (and an eighth of a small tier), and ``HEADROOM_BYTES``
    of ``block_bytes`` blocks. Headroom is capacity the cache does not use: bounded by a
    fraction of the tier alone, a busy 1M-block disk tier kept 131k blocks empty (and a state
    that had to reach 1M blocks never did); a few batches are what one group commit frees,
    which is all that waiting for the watermark needs. In bytes: every pool's file is as large
    as its tier's budget, so an eighth of it was an eighth of the whole budget per pool, kept
    empty by each pool of the tier (``bench/budget.py``: shared/static 1.21 uncapped, 1.44 at
    1 MiB with 100 forced waits in 3,000 requests, 1.41 at 512 KiB with 831).
    """

    def __init__(self, cache, order, first_headroom: int, block_bytes: int | None = None) -> None:
        self._cache = cache
        self._order = order
        self._first = first_headroom
        # (no cache: the engine's stand-in during recovery, which quarantines nothing yet)
        self.tiers = [t for t in (HOST, DISK) if cache is not None and cache.allocators[t] is not None]
        self.allocs = [cache.allocators[t] for t in self.tiers]
        self.headroom = [0] * len(self.allocs)
        byte_cap = 1 << 62 if not block_bytes else max(1, HEADROOM_BYTES // block_bytes)
        self.caps = [min(first_headroom * MAX_HEADROOM_BATCHES, a.num_slots // 8, byte_cap)
                     for a in self.allocs]
        self.num_forced = 0

    def seal(self, pos: int) -> None:
        """Slots quarantined since the last call were freed by records at or before ``pos``."""
        for alloc in self.allocs:
            alloc.seal_deferred(pos)

    def release_durable(self) -> None:
        """Make allocatable every quarantined batch whose records are durable."""
        durable = -1
        for alloc in self.allocs:
            mark = alloc.next_deferred_mark()
            if mark is not None:
                if durable < 0:
                    durable = self._order.durable_position()
                if mark <= durable:
                    alloc.release_deferred(durable)

    def low(self) -> bool:
        """Whether a tier has fewer free or quarantined slots than its headroom."""
        for alloc, want in zip(self.allocs, self.headroom):
            if alloc.num_free + alloc.num_deferred < want:
                return True
        return False

    def evict_ahead(self) -> None:
        """Evict in each tier below its headroom (the caller logs the events)."""
        for tier, alloc, want in zip(self.tiers, self.allocs, self.headroom):
            short = want - alloc.num_free - alloc.num_deferred
            if short > 0:
                self._cache.evict(short, tier)

    def after_force(self) -> None:
        """The log was made durable by force: release everything, raise the headroom."""
        for k, alloc in enumerate(self.allocs):
            alloc.release_all_deferred()
            self.headroom[k] = min(max(2 * self.headroom[k], self._first), self.caps[k])
        self.num_forced += 1
        log.debug("quarantine forced headroom=%s", self.headroom)

    def check_invariants(self) -> None:
        for alloc, want, cap in zip(self.allocs, self.headroom, self.caps):
            assert 0 <= want <= max(0, cap), "headroom out of range"
            mark = alloc.next_deferred_mark()
            assert mark is None or mark <= self._order.position, "a batch sealed past the last position"
