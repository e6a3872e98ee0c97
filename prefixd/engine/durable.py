"""The durable cache: the cache core, its storage tiers and its write-ahead log, together.

``DurableCache`` owns one state directory: the WAL (LMDB), the disk pool, and shm pools for the
host (and, without a GPU, the device) tier. Every operation runs the cache core, then logs the
events it produced, in order, through ``OrderedLog``; a commit returns a ticket (a
``concurrent.futures.Future``) that resolves once it is as durable as asked: no call waits for
an fsync. Opening the state directory recovers: checkpoint, log tail, reconciliation (see
``prefixd.engine.recovery``), then a RECOVER record.

Composed of: the ``Recovered`` value ``recover`` returns (the cache core, its tiers, the
recovered sequences), assigned by ``__init__``; the WAL and its ``OrderedLog``; the ``Upkeep``
(``prefixd.engine.upkeep``: the event path into the log, the work after each step, and the
checkpoint, whose parts a caller that runs them apart calls on ``upkeep`` itself); and the
``WriteOrder`` (``prefixd.engine.write_order``), which owns the write order of a commit.

Not thread-safe: one caller at a time (the daemon serializes cache operations on one thread).
Internal threads: the WAL's committer, the disk writer and the disk sync thread; tickets
resolve on them, so a ticket's callbacks must not call back into the cache (the daemon's
``prefixd.daemon.ack_wait.durable`` hands the result to the loop's own thread with
``call_soon_threadsafe``).
"""

from __future__ import annotations

import gc
import logging
import operator
import os
import time
from concurrent.futures import Future

from prefixd.api.layout import KVLayout
from prefixd.engine import reclaim
from prefixd.engine.checkpoint import CheckpointTrigger
from prefixd.engine.kv_io import PoolKV
from prefixd.engine.reclaim import Reclaimed
from prefixd.api.tiers import Tier
from prefixd.cache.node import DEVICE
from prefixd.engine.ordered_log import OrderedLog
from prefixd.wal.tickets import DONE_NONE
from prefixd.engine.records import CHECKPOINT_BLOCKS
from prefixd.engine.recovery import recover
from prefixd.engine.upkeep import TICK_PERIOD_S, Upkeep, poison_on_storage_error
from prefixd.engine.write_order import WriteOrder
from prefixd.wal import Wal

log = logging.getLogger(__name__)

DURABILITY = ("index", "crash", "power")
# TICK_PERIOD_S lives in ``upkeep`` with ``tick``; re-exported here, where the daemon imports it
__all__ = ["DURABILITY", "TICK_PERIOD_S", "DurableCache", "Reclaimed"]


def _delegated(part: str, name: str, doc: str) -> property:
    """A settable attribute of the pool that lives in its part ``part`` (a dotted path)."""
    get_part = operator.attrgetter(part)
    return property(lambda self: getattr(get_part(self), name),
                    lambda self, value: setattr(get_part(self), name, value), doc=doc)


class DurableCache:
    """A crash-safe prefix cache over one state directory.

    Args:
        state_dir: WAL, disk pool and lock live here (created if missing).
        layout: the KV layout (a state directory saved with another layout is refused).
        num_blocks: ``(device, host, disk)`` pool sizes in blocks.
        tenant_salt: mixed into the root hash: tenants never share blocks.
        sync: WAL fsync policy, ``commit`` / ``interval`` / ``none``.
        sync_interval_ms: the fsync period of ``interval``.
        write_policy, policy: see ``PrefixCache``.
        verify: ``lazy`` (disk checksums checked when a block is promoted) or ``eager`` (all
            disk blocks checked during recovery too).
        shm_dir: where the host (and CPU device) pool files live.
        reclaim_grace_s: how long recovered sequences wait for their client.
        checkpoint_records: fold the log into a checkpoint after this many records.
        checkpoint_blocks: ... or once replaying the records since the last checkpoint would
            decode this many blocks (``records.Scan.blocks``; see the NOTE), whichever comes first.
        spill_blocks: batch size of write-through to disk (runs wait until this many blocks).
        forget_missing_tier: a disk pool file that is gone while the index names blocks in it
            is refused (``TierLostError``); True drops those blocks at recovery instead and
            counts them in ``recovery["forgotten_blocks"]``.
        progress: a ``prefixd.engine.progress.RecoveryProgress`` that counts replayed records.
        cluster: a ``ClusterConfig``: the Redis Cluster tier below disk (write-behind of
            committed blocks, fetch on a local miss: ``prefixd.engine.cluster_tier``), or None.
        ledgers, tenant: the ``BudgetLedger`` of each ``Tier`` the pool files are charged to,
            under ``tenant`` (None: unbounded ledgers of the pool's own).

    NOTE (checkpoint trigger): see ``prefixd.engine.records.CHECKPOINT_BLOCKS``.

    NOTE (expiry without a timer): recovered sequences hold their blocks for
    ``reclaim_grace_s``; every mutating call (open, extend, fork, commit, release) first
    releases them once that has passed, so expiry never waits for ``tick``. The engine keeps
    no timer thread: ``tick`` is periodic work the daemon's loop calls about every
    ``TICK_PERIOD_S`` (disk write-through batches, and expiry on an idle cache).
    """

    def __init__(self, state_dir: str, layout: KVLayout, num_blocks, *, tenant_salt: bytes = b"",
                 sync: str = "commit", write_policy: str = "write_through", policy: str = "lru",
                 verify: str = "lazy", shm_dir: str = "/dev/shm", reclaim_grace_s: float = 30.0,
                 checkpoint_records: int = 100_000, checkpoint_blocks: int = CHECKPOINT_BLOCKS,
                 spill_blocks: int = 256,
                 use_cuda: bool | None = False, sync_interval_ms: float = 1000.0,
                 forget_missing_tier: bool = False, progress=None, cluster=None,
                 ledgers=None, tenant: str = "default") -> None:
        if verify not in ("lazy", "eager"):
            raise ValueError(f"verify must be 'lazy' or 'eager', got {verify!r}")
        sizes = tuple(num_blocks)
        if len(sizes) != 3 or not all(isinstance(n, int) and n >= 0 for n in sizes) or sizes[0] < 1:
            raise ValueError(f"num_blocks must be (device, host, disk) block counts, device >= 1; got {num_blocks!r}")
        if not sizes[1] and not sizes[2]:
            raise ValueError("a durable cache needs a host or a disk tier: device blocks do not "
                             "survive a restart; give num_blocks a host or disk size")
        t0 = time.perf_counter()
        self.layout = layout
        self.state_dir = state_dir
        self.spill_blocks = spill_blocks
        self.forget_missing_tier = forget_missing_tier
        self.progress = progress  # a ``RecoveryProgress`` to count replayed records into, or None
        self.shared_clock = None  # the engine's ``tier_lru.SharedClock``: keys compare across pools
        self.cluster = None  # a ``ClusterTier`` once recovered, if configured
        os.makedirs(state_dir, exist_ok=True)
        self.wal = Wal(state_dir, layouts=layout.to_bytes(), sync=sync, interval_ms=sync_interval_ms)
        self._order = OrderedLog(self.wal)
        try:
            # NOTE: recovery allocates millions of objects that all stay alive; the collector
            # would walk them again and again for nothing (measured: a third of a 1M-block
            # recovery), so it is paused until ready.
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                rec = recover(self.wal, state_dir, layout, sizes, tenant_salt=tenant_salt,
                              write_policy=write_policy, policy=policy, verify=verify,
                              shm_dir=shm_dir, use_cuda=use_cuda,
                              forget_missing_tier=forget_missing_tier, progress=progress, t0=t0,
                              ledgers=ledgers, tenant=tenant)
                self.cache, self.store = rec.cache, rec.store
                self.kv = PoolKV(self.cache, self.store, layout)  # the KV API (``kv_io``)
                self.recovered = rec.recovered  # seq id -> ``RecoveredSeq``, waiting for reclaim
                self._sessions: dict[int, int] = {}  # live seq id -> session id
                self.upkeep = Upkeep(self.cache, self.store, self.wal, self._order, self._sessions,
                                     self.recovered, spill_blocks=spill_blocks,
                                     trigger=CheckpointTrigger(checkpoint_records, checkpoint_blocks))
                self.cache.on_deferred_shortage = self.upkeep.force_release
                self.write_order = WriteOrder(self.cache, self._order, self._log)
                try:
                    self.upkeep.open_epoch(rec)
                except BaseException:  # close what recovery opened, as a failed recovery does
                    rec.abandon()
                    raise
            finally:
                if gc_was_enabled:
                    gc.enable()
            self._reclaim_deadline = time.monotonic() + reclaim_grace_s
            self.recovery = rec.ready(state_dir, self.wal.open_epoch(), t0)  # phase timings and counts
            self.store.write_behind = True  # from now on, disk writes go behind the caller
            if cluster is not None:  # imported only then: no redis, no thread without a cluster
                from prefixd.engine.cluster_tier import ClusterTier

                self.cluster = ClusterTier(self.cache, self.store, layout, tenant_salt, cluster)
        except BaseException:
            self.wal.close()
            raise

    # -- settings and counters of the pool's parts --------------------------------------------

    checkpoint_records = _delegated(
        "upkeep.trigger", "records", "Fold the log into a checkpoint after this many records (settable).")
    checkpoint_blocks = _delegated(
        "upkeep.trigger", "blocks", "... or once replaying the tail would decode this many blocks (settable).")
    on_checkpoint_due = _delegated(
        "upkeep", "on_checkpoint_due", "None: a due checkpoint is taken inline by the log step; "
        "else called instead (the daemon runs the checkpoint's parts beside its loop).")
    event_listener = _delegated(
        "upkeep", "event_listener", "Called with each drained batch of cache events once they are "
        "logged (the daemon's KV-event journal); O(events), must not raise. None: nobody listens.")

    @property
    def forced_releases(self) -> int:
        """How often a tier short only of quarantined slots made the serving thread wait."""
        return self.upkeep.quarantine.num_forced

    # -- operations --------------------------------------------------------------------------

    @poison_on_storage_error
    def open(self, tokens, extra: bytes = b"", *, session_id: int = 0):
        self._expire_if_due()
        cluster = self.cluster  # with a cluster tier: a run past the local match promoted first
        seq = self.cache.open(tokens, extra) if cluster is None else cluster.open(tokens, extra)
        self._sessions[seq.id] = session_id
        self._log(session_id, keep_headroom=False)  # on the request's path: see ``_log``
        return seq

    @poison_on_storage_error
    def extend(self, seq_id: int, tokens) -> list[int]:
        self._expire_if_due()
        slots = self.cache.extend(seq_id, tokens)
        self._log()
        return slots

    @poison_on_storage_error
    def fork(self, seq_id: int, num_children: int):
        self._expire_if_due()
        cluster = self.cluster  # fork indexes the parent's full blocks: the policy sees them
        children = (self.cache.fork(seq_id, num_children) if cluster is None
                    else cluster.fork(seq_id, num_children))
        session = self._sessions.get(seq_id, 0)
        for child in children:
            self._sessions[child.id] = session
        self._log()
        return children

    def flush(self) -> Future:
        """A ticket resolved (``None``) once every change made so far is durable in the log
        (disk barriers included); fails with ``WalFailedError``. Never waits itself."""
        return self._order.ticket(self.upkeep.submit(), None)

    def lookup(self, tokens, extra: bytes = b""):
        """How many tokens of ``tokens`` are cached, without pinning anything
        (``prefixd.cache.LookupResult``). ``cached_tokens`` counts only tokens an ``open``
        will serve: after a restart, disk blocks whose checksums were not checked yet (lazy
        verify) are reported apart, as ``unverified_tokens``."""
        return self.cache.lookup(tokens, extra)

    def sequence(self, seq_id: int):
        return self.cache.sequence(seq_id)

    def write_kv(self, seq, start: int, kv) -> None:
        """Write ``kv`` (``[num_layers, 2, n, num_kv_heads, head_dim]``) as the KV of tokens
        ``start .. start + n`` of a live sequence (or id); see ``PoolKV.write`` (only blocks the
        sequence owns alone: ``SharedBlockError`` otherwise)."""
        self.kv.write(seq, start, kv)

    def read_kv(self, seq, start: int, n: int):
        """The KV of tokens ``start .. start + n`` of a live sequence, as a new tensor
        ``[num_layers, 2, n, num_kv_heads, head_dim]`` on the device pool's device.

        Raises:
            UnknownSequence; ValueError: tokens past the sequence's end.
        """
        return self.kv.read(seq, start, n)

    @poison_on_storage_error
    def commit(self, seq_id: int, durability: str = "crash") -> Future:
        """Index the sequence's full blocks; return a ticket for their durability.

        Never waits for an fsync. The ticket is a ``concurrent.futures.Future`` resolved with the
        number of blocks that entered the index once they are as durable as asked (already done
        at ``index``). An asyncio loop awaits it through a done-callback that settles a loop
        future with ``call_soon_threadsafe`` (``prefixd.daemon.ack_wait.durable``: no thread per
        waiter); never ``asyncio.wrap_future``, which cancels the ticket when the awaiting task is
        cancelled. Until it resolves, nothing about
        this commit may be acknowledged to anyone.

        Raises (at once, nothing indexed): UnknownSequence, ValueError (bad durability),
            prefixd.wal.WalFailedError (the log already failed).
        The ticket fails with:
            DurabilityError: the blocks are indexed (as at ``index``) but cannot be made as
                durable as asked (no room in the tier); nothing was acknowledged.
            prefixd.wal.WalFailedError: the log can no longer make anything durable (also when
                a disk write or its fdatasync failed, which poisons the log).
        """
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        self._expire_if_due()
        seq = self.cache.sequence(seq_id)
        added = self.cache.commit(seq_id)
        if self.cluster is not None:
            self.cluster.after_commit(seq, durability, added)
        return self.write_order.make_durable(seq, durability, added)

    @poison_on_storage_error
    def release(self, seq_id: int, *, commit: bool = False, durability: str = "crash") -> Future:
        """Drop the sequence (committing it first when asked); returns a ticket resolved with
        ``None`` once that commit is as durable as asked (already done without ``commit``).
        Raises and fails as ``commit``; the sequence is released either way."""
        if commit and durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        self._expire_if_due()
        if commit:
            seq = self.cache.sequence(seq_id)
            added = self.cache.commit(seq_id)
            if self.cluster is not None:
                self.cluster.after_commit(seq, durability, added)
            return self.write_order.make_durable(seq, durability, None, then=lambda: self._drop(seq_id))
        self._drop(seq_id)
        self._log()
        return DONE_NONE

    def _drop(self, seq_id: int) -> None:
        self.cache.release(seq_id)
        self._sessions.pop(seq_id, None)

    def _log(self, session_id: int = 0, keep_headroom: bool = True) -> int:
        """The log step (``Upkeep.log_step``): drain the cache's events into the ordered
        queue, then the periodic work. Returns the position of the last record this call
        logged. ``open`` passes ``keep_headroom=False`` (see ``Upkeep.log_step``'s NOTE)."""
        pos = self.upkeep.log_step(session_id, keep_headroom)
        if self.shared_clock is not None:
            self.shared_clock.leave(self.cache.tree)
        return pos

    @poison_on_storage_error
    def settle_room(self, tier: int) -> int:
        """After evictions another pool of the tier asked for (``prefixd.engine.tier_lru``):
        log the drops, make them durable so their slots are released, and give back the
        extents left idle. Returns the bytes given back to the tier's budget."""
        self._log()
        if tier != DEVICE:
            self.upkeep.force_release()
        return self.store.shrink(Tier(tier))

    # -- periodic work -------------------------------------------------------------------------

    def spill(self) -> int:
        """Write-through to disk for the runs waiting for it (``Upkeep.spill``)."""
        return self.upkeep.spill()

    def tick(self) -> None:
        """Periodic work the daemon's loop calls about every 100 ms (``TICK_PERIOD_S``): write
        down runs promoted from the cluster, spill write-through runs waiting for disk (else
        they wait for ``spill_blocks`` of them), keep the headroom an ``open`` left
        (``Upkeep.tick``), and release unclaimed recovered sequences (which every mutating call
        also does)."""
        if self.cluster is not None:
            self._write_down_promoted()
        self.upkeep.tick()
        self._expire_if_due()

    @poison_on_storage_error
    def _write_down_promoted(self) -> None:
        """Runs promoted from the cluster were indexed at the device alone (``ClusterTier.tick``)."""
        if self.cluster.tick():
            self._log()

    def checkpoint(self) -> int:
        """Fold the log into a checkpoint of the current state (``Upkeep.checkpoint``);
        returns its lsn. Runs on the caller's thread; waits for held records and the write."""
        return self.upkeep.checkpoint()

    # -- recovered sequences -------------------------------------------------------------------

    def _expire_if_due(self) -> None:
        """Release the unclaimed recovered sequences once ``reclaim_grace_s`` has passed; run
        first by every mutating call, so that expiry never depends on ``tick`` being called.
        First of all, the pool's clock catches up with the engine's (``shared_clock``)."""
        if self.shared_clock is not None:
            self.shared_clock.enter(self.cache.tree)
        if self.recovered and time.monotonic() >= self._reclaim_deadline:
            self.expire_recovered()

    def expire_recovered(self) -> int:
        """Release every recovered sequence not reclaimed (their blocks stay cached)."""
        n = reclaim.expire(self.cache, self.recovered)
        self._log()
        return n

    @poison_on_storage_error
    def reclaim(self, session_id: int, new_session_id: int | None = None) -> list[Reclaimed]:
        """Reopen the recovered sequences of ``session_id`` on their surviving blocks
        (``prefixd.engine.reclaim``); see ``reclaim.reopen`` for a refusal halfway. They
        belong to ``new_session_id`` from then on (default: ``session_id``), in memory and in
        the log, so a later restart finds them under the session that reclaimed them."""
        owner = session_id if new_session_id is None else new_session_id
        out = []
        for item in reclaim.reopen(self.cache, self.recovered, session_id):
            if item.seq is not None:
                self._sessions[item.seq.id] = owner
            self._log(owner)
            out.append(item)
        return out

    def close(self) -> None:
        """Log what is pending and close the WAL and the pools (no checkpoint); open tickets
        resolve (or fail) before it returns."""
        if self.cluster is not None:
            self.cluster.close()  # drops what is still queued for the cluster
        try:
            if self.wal.failure is None:  # a failed log was reported to every ticket already
                self.upkeep.settle()
        finally:
            try:
                self.wal.close()
            finally:
                self.store.close()

    def __enter__(self) -> "DurableCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_invariants(self) -> None:
        self.cache.check_invariants([r.node for r in self.recovered.values()])
        self.wal.check_invariants()
        self._order.check_invariants()
        self.upkeep.check_invariants()
        if self.cluster is not None:
            self.cluster.check_invariants()
        assert self.recovery["device_runs_missed"] == 0, "replay missed device runs (see Replayer.restart)"
