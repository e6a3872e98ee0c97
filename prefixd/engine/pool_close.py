"""``PoolCloser``: the engine closes a pool that holds nothing, and returns what it took.

A pool is *empty* when its index holds no block in any tier, and no sequence (live or
recovered and waiting for its client) holds a block. Nothing in it can be a hit, so keeping
it open only costs: its mappings, fds, the log's environment and threads, its files' first
extents and its log's room. The daemon closes an empty pool that no session uses (it knows
the sessions: ``Engine.close_empty_pools``, which ``PoolCloser.close_empty_pools`` does); the
next Attach of its layout opens it again, through the ordinary recovery, which finds an empty
index, and its counters carry on from where they were (``closed_stats``, ``reopened``).

Closing, in order (``close``):

1. every pending record is logged and made durable, and every quarantined slot released
   (``Upkeep.force_release``): no committed record names a block any more;
2. every extent of every tier's file is punched (the header's excepted), charges released;
3. the pool is closed (log, files, mappings, threads; the files' header extents released);
4. the shm files (device, host) are unlinked: their memory goes back whole. The next open
   finds no host file, as after a reboot, and starts the tier empty; the device tier is
   always started empty;
5. the disk file keeps only its header page (the rest of its first extent punched: a reopen
   allocates it again before any slot in it is used), and the log's room is punched
   (``LogRoom.release``);
6. what the pool's directory still takes (manifest, header page, the log's pages: tens of
   KiB) is charged to the tenant on the disk ledger (``leftovers``) until the pool opens
   again: a tenant's closed pools are its bytes too.

A kill at any point leaves a pool that recovers as an empty one: the log says the index is
empty before step 2 begins, and every later step only gives back what it does not name.

When: candidates are pools whose last session ended, pools an eviction of another pool left
with no block (``TierLRU.emptied``), every pool a start recovered (once), and every pool
whose last recovered sequences the tick expired; the daemon tries them on its tick (never
per request). A candidate that is not empty yet is dropped (a later session end, eviction
or expiry names it again); one whose log or disk writer is busy is kept for the next tick,
``MAX_TRIES`` ticks at most.
"""

from __future__ import annotations

import logging
import os

from prefixd.api.tiers import Tier
from prefixd.engine.budgets import bytes_under
from prefixd.storage import falloc
from prefixd.storage.errors import BudgetExceededError, StorageError
from prefixd.storage.extents import EXTENT_BYTES
from prefixd.storage.poolfile import DATA_OFFSET

log = logging.getLogger(__name__)

NOT_EMPTY, BUSY, CLOSED = "not empty", "busy", "closed"
MAX_TRIES = 50  # a pool BUSY this many ticks in a row (5 s) is dropped until it is named again


def is_empty(dc) -> bool:
    """No indexed block in any tier and no sequence, live or recovered."""
    cache = dc.cache
    return (not any(cache.tree.num_blocks_in) and not dc.recovered
            and next(iter(cache.sequences()), None) is None)


class PoolCloser:
    """The pools to try closing (``candidates``, keys ``(tenant, layout)`` of the engine's
    pools), the count closed, and the counters of the pools closed (``closed_stats``).

    Holds the engine's maps a closed pool leaves: ``pools`` (key -> ``DurableCache``),
    ``rooms`` (key -> ``PoolRoom``), ``log_rooms`` (pool directory -> ``LogRoom``), the
    ``Budgets`` (their ``fixed_device``) and the ``TierLRU`` (its ``emptied`` keys become
    candidates).

    NOTE: those maps are the engine's own dicts, shared, never rebound by either side: the
    engine adds a pool to them as it opens one, and a close here takes it out of every one,
    so closing stays in this one class.

    Invariant: ``closed_stats`` names no open pool (``reopened`` takes a pool's counters back
    when it opens again).

    Thread safety: the engine's thread only.
    """

    def __init__(self, pools: dict, rooms: dict, log_rooms: dict, budgets, tier_lru) -> None:
        self.candidates: set = set()
        self.num_closed = 0
        self.closed_stats: dict = {}  # key -> a closed pool's CacheStats (exported: never go down)
        self.leftovers: dict = {}  # key -> disk bytes a closed pool's directory takes, charged
        self._tries: dict = {}  # key -> BUSY outcomes in a row
        self._pools = pools
        self._rooms = rooms
        self._log_rooms = log_rooms
        self._budgets = budgets
        self._tier_lru = tier_lru

    def note(self, key) -> None:
        self.candidates.add(key)
        self._tries.pop(key, None)

    def retry(self, key) -> bool:
        """A close of ``key`` was BUSY: whether to try again (at most ``MAX_TRIES`` in a row: a
        filesystem that cannot punch keeps its extents for good)."""
        n = self._tries.get(key, 0) + 1
        if n >= MAX_TRIES:
            self._tries.pop(key, None)
            return False
        self._tries[key] = n
        return True

    def close_empty_pools(self, used, busy=None) -> list:
        """Close every candidate pool that holds nothing and that no session uses; returns the
        keys closed. Cheap when there is no candidate. See ``Engine.close_empty_pools``.

        Args:
            used: the keys ``(tenant, layout)`` of the pools sessions use now (never closed;
                their last session's end names them again).
            busy: ``busy(cache)``: True while something else works on the pool (a checkpoint
                beside the loop); it is tried again at the next call.
        """
        self.candidates |= self._tier_lru.emptied
        self._tier_lru.emptied.clear()
        closed = []
        for key in list(self.candidates):
            dc = self._pools.get(key)
            if dc is None or key in used:
                self.candidates.discard(key)
                continue
            if busy is not None and busy(dc):
                continue
            try:
                outcome = self.close(dc)
            except Exception as exc:  # noqa: BLE001 - the pool stays open, as it was
                log.error("closing an empty pool failed tenant=%s model=%s error=%r", key[0],
                          key[1].model_id, exc)
                outcome = None
            if outcome != BUSY or not self.retry(key):
                self.candidates.discard(key)
            if outcome == CLOSED:
                self._forget(key, dc)
                closed.append(key)
                log.info("pool closed (no session, no cached block) tenant=%s model=%s path=%s",
                         key[0], key[1].model_id, dc.state_dir)
        return closed

    def reopened(self, key, dc) -> None:
        """The pool ``key`` is open again as ``dc``: a closed pool's counters carry on in it."""
        closed = self.closed_stats.pop(key, None)
        if closed is not None:
            dc.cache.stats.absorb(closed)
        left = self.leftovers.pop(key, 0)
        if left:
            self._budgets.ledgers["disk"].release(key[0], left)

    def close(self, dc) -> str:
        """Close ``dc`` if it is empty (see the module docstring); returns ``CLOSED``,
        ``NOT_EMPTY`` (nothing done) or ``BUSY`` (records made durable and extents punched,
        but a tier still holds more than its header: try again later).

        Raises:
            WalFailedError, StorageError: the log or a punch failed (the pool stays open).
        """
        if not is_empty(dc):
            return NOT_EMPTY
        dc.upkeep.force_release()
        store = dc.store
        for tier in store.tiers:
            store.shrink(tier)
        header = {t: store.pool(t).sparse.extent_map.charge(0) for t in store.tiers
                  if store.pool(t).sparse is not None}
        if any(store.held_bytes(t) > first for t, first in header.items()) or not is_empty(dc):
            return BUSY
        shm = [store.pool(t).path for t in (Tier.DEVICE, Tier.HOST)
               if t in store.tiers and store.pool(t).path is not None]
        disk = store.pool(Tier.DISK).path if Tier.DISK in store.tiers else None
        dc.close()
        for path in shm:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if disk is not None:
            _keep_header_only(disk)
        self.num_closed += 1
        return CLOSED

    def check_invariants(self) -> None:
        assert not self.closed_stats.keys() & self._pools.keys(), "an open pool in closed_stats"
        assert not self.leftovers.keys() & self._pools.keys(), "an open pool in leftovers"

    def _forget(self, key, dc) -> None:
        """A closed pool leaves the engine: its charges back, its log's room punched."""
        del self._pools[key]
        self.closed_stats[key] = dc.cache.stats  # exported until it opens again (``reopened``)
        self._rooms.pop(key, None)
        self._budgets.fixed_device.pop(key, None)
        room = self._log_rooms.pop(dc.state_dir, None)
        if room is not None:
            room.release(punch=True)
        self._charge_leftovers(key, dc.state_dir)

    def _charge_leftovers(self, key, state_dir: str) -> None:
        """Charge what the closed pool's directory still takes to its tenant (disk ledger;
        none without a disk budget). It fits, since the close gave back more; if another
        pool took that room meanwhile, the bytes stay uncharged and it is logged."""
        if not self._budgets.budget.disk:
            return
        left = bytes_under(state_dir)
        try:
            self._budgets.ledgers["disk"].charge(key[0], left)
        except BudgetExceededError as exc:
            log.info("a closed pool's files are not charged tenant=%s path=%s error=%s", key[0],
                     state_dir, exc)
            return
        self.leftovers[key] = left


def _keep_header_only(path: str) -> None:
    """Punch a closed disk pool file's first extent past its header page (best effort: a
    filesystem that cannot punch keeps it allocated, as a shrink does)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        length = min(EXTENT_BYTES, os.fstat(fd).st_size) - DATA_OFFSET
        if length > 0:
            falloc.punch(fd, path, DATA_OFFSET, length)
            os.fsync(fd)
    except (falloc.PunchUnsupportedError, StorageError, OSError) as exc:
        log.info("a closed pool's disk file keeps its first extent path=%s error=%s", path, exc)
    finally:
        os.close(fd)
