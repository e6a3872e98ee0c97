"""The durable cache: the cache core, its storage tiers and its write-ahead log, together.

``DurableCache`` owns one state directory: the WAL (LMDB), the disk pool, and shm pools for the
host (and, without a GPU, the device) tier. Every operation runs the cache core, then logs the
events it produced; a commit at ``crash`` or ``power`` durability waits for its records to be
durable. Opening the state directory recovers: checkpoint, log tail, reconciliation (see
``prefixd.engine.replay``), then a RECOVER record. The write order lives in ``_make_durable``.

Not thread-safe: one caller at a time (the daemon serializes cache operations on one thread;
the WAL's committer thread is internal).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
from typing import NamedTuple

from prefixd.api.layout import KVLayout
from prefixd.engine import snapshot as ckpt
from prefixd.engine.errors import DurabilityError
from prefixd.cache.events import BlocksMoved
from prefixd.cache.node import DISK, HOST, path_to
from prefixd.engine.records import event_records
from prefixd.engine.recovery import recover
from prefixd.engine.replay import ZERO_HASH
from prefixd.crashpoints import crash_point
from prefixd.storage.errors import StorageError
from prefixd.api.tiers import Tier
from prefixd.wal import Kind, Wal

log = logging.getLogger(__name__)

DURABILITY = ("index", "crash", "power")


def _poison_on_storage_error(method):
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


class Reclaimed(NamedTuple):
    """A reclaimed sequence: its old id, the new live sequence (``None`` if nothing survived)
    and how many tokens survived."""

    old_id: int
    seq: object
    num_tokens: int


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
        spill_blocks: batch size of write-through to disk (runs wait until this many blocks).
        forget_missing_tier: a disk pool file that is gone while the index names blocks in it
            is refused (``TierLostError``); True drops those blocks at recovery instead and
            counts them in ``recovery["forgotten_blocks"]``.
    """

    def __init__(self, state_dir: str, layout: KVLayout, num_blocks, *, tenant_salt: bytes = b"",
                 sync: str = "commit", write_policy: str = "write_through", policy: str = "lru",
                 verify: str = "lazy", shm_dir: str = "/dev/shm", reclaim_grace_s: float = 30.0,
                 checkpoint_records: int = 100_000, spill_blocks: int = 256,
                 use_cuda: bool | None = False, sync_interval_ms: float = 1000.0,
                 forget_missing_tier: bool = False) -> None:
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
        self.checkpoint_records = checkpoint_records
        self.spill_blocks = spill_blocks
        self.forget_missing_tier = forget_missing_tier
        os.makedirs(state_dir, exist_ok=True)
        phases = {}
        self.wal = Wal(state_dir, layouts=layout.to_bytes(), sync=sync, interval_ms=sync_interval_ms)
        try:
            # NOTE: recovery allocates millions of objects that all stay alive; the collector
            # would walk them again and again for nothing (measured: a third of a 1M-block
            # recovery), so it is paused until ready.
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                recover(self, layout, num_blocks, tenant_salt, write_policy, policy, verify,
                        shm_dir, reclaim_grace_s, use_cuda, phases, t0)
            finally:
                if gc_was_enabled:
                    gc.enable()
        except BaseException:
            self.wal.close()
            raise

    # -- operations --------------------------------------------------------------------------

    @_poison_on_storage_error
    def open(self, tokens, extra: bytes = b"", *, session_id: int = 0):
        seq = self.cache.open(tokens, extra)
        self._sessions[seq.id] = session_id
        self._log(session_id)
        return seq

    @_poison_on_storage_error
    def extend(self, seq_id: int, tokens) -> list[int]:
        slots = self.cache.extend(seq_id, tokens)
        self._log()
        return slots

    @_poison_on_storage_error
    def fork(self, seq_id: int, num_children: int):
        children = self.cache.fork(seq_id, num_children)
        session = self._sessions.get(seq_id, 0)
        for child in children:
            self._sessions[child.id] = session
        self._log()
        return children

    def lookup(self, tokens, extra: bytes = b""):
        return self.cache.lookup(tokens, extra)

    def sequence(self, seq_id: int):
        return self.cache.sequence(seq_id)

    @_poison_on_storage_error
    def commit(self, seq_id: int, durability: str = "crash") -> int:
        """Index the sequence's full blocks; return once they are as durable as asked.

        Raises:
            UnknownSequence, ValueError (bad durability),
            DurabilityError: the blocks are indexed (as at ``index``) but not as durable as
                asked; nothing was acknowledged.
            prefixd.wal.WalFailedError (the log can no longer make anything durable; also when
            the disk pool's fdatasync failed, which poisons the log).
        """
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        seq = self.cache.sequence(seq_id)
        added = self.cache.commit(seq_id)
        self._make_durable(seq, durability)
        return added

    @_poison_on_storage_error
    def release(self, seq_id: int, *, commit: bool = False, durability: str = "crash") -> None:
        if commit:
            self.commit(seq_id, durability)
        self.cache.release(seq_id)
        self._sessions.pop(seq_id, None)
        self._log()

    # -- the write order -----------------------------------------------------------------------

    def _make_durable(self, seq, durability: str) -> None:
        """THE write order of a commit: block bytes -> (fsync) -> WAL commit -> acknowledged.

        1. ``index``: the blocks are already shareable; their records ride in the next group.
        2. Bytes down: every run on the sequence's path gets a copy in a tier that survives
           what was asked (``crash``: host shm or disk; ``power``: disk).
        3. ``_log``: if any record names a disk slot as holding data, the disk pool is
           fdatasync'd first (data before metadata); then the records are appended.
        4. The WAL group holding them is committed and fsynced; only then is the commit
           acknowledged. Slots freed by evictions on the way are reusable only after this.
        """
        if durability == "index":
            self._log()
            return
        tiering = self.cache.tiering
        want = DISK if durability == "power" else HOST
        if self.cache.allocators[want] is None:
            if want == DISK:
                raise DurabilityError("power durability needs a disk tier; this cache has none")
            want = DISK  # crash durability without a host tier: the disk serves
        for node in path_to(seq.node):
            if node.slots[DISK] is not None or (want == HOST and node.slots[HOST] is not None):
                continue
            if not tiering.write_down(node, want):
                raise DurabilityError(f"cannot make sequence {seq.id} {durability}-durable: "
                                      f"no room in the {'disk' if want == DISK else 'host'} tier")
        crash_point("commit_data_written")
        self._log()
        self.wal.flush().result()
        self._reclaim()

    def _log(self, session_id: int = 0) -> None:
        events = self.cache.drain_events()
        if not events:
            return
        if self.wal.failure is not None:  # no more fdatasyncs: nothing will be acknowledged
            raise self.wal.failure
        for e in events:
            if type(e) is BlocksMoved and e.tier == DISK:
                try:
                    self.store.sync(Tier.DISK)
                except StorageError as exc:
                    # NOTE: these events are drained and can never be logged, and the kernel may
                    # have dropped the pages it failed to write (a retried fdatasync can
                    # "succeed" over lost bytes): poison the log, so that nothing more is
                    # acknowledged and the log never goes on without them.
                    raise self.wal.fail(exc) from exc
                crash_point("commit_data_synced")
                break
        append = self.wal.append
        for e in events:
            kind, fields, blob = event_records(e, session_id)
            append(kind, *fields, blob=blob)
        self._since_checkpoint += len(events)
        if self.cache.tiering.pending_disk_blocks >= self.spill_blocks:
            self.spill()
        if self._since_checkpoint >= self.checkpoint_records:
            self.checkpoint()

    def _reclaim(self) -> None:
        for tier in (HOST, DISK):
            alloc = self.cache.allocators[tier]
            if alloc is not None:
                alloc.reclaim_deferred()

    def _force_reclaim(self) -> None:
        """A lower tier is short only of quarantined slots: make their drops durable now."""
        self._log()
        self.wal.commit_now()
        self._reclaim()

    # -- background work -------------------------------------------------------------------------

    @_poison_on_storage_error
    def spill(self) -> int:
        """Write-through to disk for the runs waiting for it, one fdatasync for the batch."""
        done = self.cache.tiering.spill()
        if done:
            self._log()
        return done

    def tick(self) -> None:
        """Periodic work: spill to disk, release unclaimed recovered sequences, checkpoint."""
        self.spill()
        if self.recovered and time.monotonic() >= self._reclaim_deadline:
            self.expire_recovered()

    def expire_recovered(self) -> int:
        """Release every recovered sequence not reclaimed (their blocks stay cached)."""
        n = len(self.recovered)
        for rec in self.recovered.values():
            self.cache.tree.unlock(rec.node)
            self.wal.append(Kind.RELEASE, rec.seq_id)
        self.recovered.clear()
        return n

    @_poison_on_storage_error
    def reclaim(self, session_id: int) -> list[Reclaimed]:
        """Reopen the recovered sequences of ``session_id`` on their surviving blocks."""
        out = []
        for old_id in [k for k, r in self.recovered.items() if r.session_id == session_id]:
            rec = self.recovered.pop(old_id)
            path = path_to(rec.node)
            tokens = b"".join(n.tokens for n in path)
            seq = None
            if tokens:
                seq = self.cache.open(tokens, rec.extra, full_match=True)
                self._sessions[seq.id] = session_id
            self.cache.tree.unlock(rec.node)
            self._log(session_id)
            self.wal.append(Kind.RELEASE, old_id)
            out.append(Reclaimed(old_id, seq, seq.cached_tokens if seq else 0))
        return out

    @_poison_on_storage_error
    def checkpoint(self) -> int:
        """Fold the log into a checkpoint of the current state; returns its lsn."""
        self._log()
        seqs = []
        for seq_id, seq in self.cache._seqs.items():
            node = seq.node
            seqs.append([seq_id, self._sessions.get(seq_id, 0),
                         node.hashes[-1] if node.parent is not None else ZERO_HASH, seq.extra])
        for rec in self.recovered.values():
            node = rec.node
            seqs.append([rec.seq_id, rec.session_id,
                         node.hashes[-1] if node.parent is not None else ZERO_HASH, rec.extra])
        meta = {"next_seq_id": self.cache._next_id,
                "file_ids": {str(int(t)): fid.hex() for t, fid in self.store.file_ids.items()}}
        index, seq_values = ckpt.dump(self.cache, meta, seqs)
        lsn = self.wal.stats().next_lsn - 1
        crash_point("checkpoint_dumped")
        self.wal.checkpoint(lsn, index, seq_values)
        self._since_checkpoint = 0
        self._reclaim()
        return lsn

    def close(self) -> None:
        """Log what is pending and close the WAL and the pools (no checkpoint)."""
        try:
            self._log()
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
        assert self.recovery["device_runs_missed"] == 0, "replay missed device runs (see Replayer.restart)"
