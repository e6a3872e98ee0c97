"""The durable cache: the cache core, its storage tiers and its write-ahead log, together.

``DurableCache`` owns one state directory: the WAL (LMDB), the disk pool, and shm pools for the
host (and, without a GPU, the device) tier. Every operation runs the cache core, then logs the
events it produced; a commit at ``crash`` or ``power`` durability waits for its records to be
durable. Opening the state directory recovers: checkpoint, log tail, reconciliation (see
``prefixd.cache.replay``), then a RECOVER record. The write order lives in ``_make_durable``.

Not thread-safe: one caller at a time (the daemon serializes cache operations on one thread;
the WAL's committer thread is internal).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from itertools import chain
from typing import NamedTuple

from prefixd.api.layout import KVLayout
from prefixd.cache import checkpoint as ckpt
from prefixd.cache.errors import CacheError, UnknownSequence
from prefixd.cache.events import BlocksMoved
from prefixd.cache.hashing import root_hash
from prefixd.cache.node import DEVICE, DISK, HOST, path_to
from prefixd.cache.prefix_cache import PrefixCache
from prefixd.cache.records import event_records
from prefixd.cache.replay import ZERO_HASH, Replayer, reconcile
from prefixd.faults import crash_point
from prefixd.storage.errors import StorageError
from prefixd.storage.tiers import Tier, TierStore
from prefixd.wal import Kind, Wal

log = logging.getLogger(__name__)

DURABILITY = ("index", "crash", "power")


class DurabilityError(CacheError):
    """A commit could not be made as durable as asked (a lower tier has no room left)."""


class RecoveredSeq(NamedTuple):
    """A sequence that was live before the restart, cut back to its surviving blocks."""

    seq_id: int
    session_id: int
    node: object
    extra: bytes

    @property
    def num_tokens(self) -> int:
        """Tokens that survived (whole blocks on the path to ``node``)."""
        return sum(len(n.tokens) for n in path_to(self.node)) // 4


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
        write_policy, policy: see ``PrefixCache``.
        verify: ``lazy`` (disk checksums checked when a block is promoted) or ``eager`` (all
            disk blocks checked during recovery too).
        shm_dir: where the host (and CPU device) pool files live.
        reclaim_grace_s: how long recovered sequences wait for their client.
        checkpoint_records: fold the log into a checkpoint after this many records.
        spill_blocks: batch size of write-through to disk (runs wait until this many blocks).
    """

    def __init__(self, state_dir: str, layout: KVLayout, num_blocks, *, tenant_salt: bytes = b"",
                 sync: str = "commit", write_policy: str = "write_through", policy: str = "lru",
                 verify: str = "lazy", shm_dir: str = "/dev/shm", reclaim_grace_s: float = 30.0,
                 checkpoint_records: int = 100_000, spill_blocks: int = 256,
                 use_cuda: bool | None = False) -> None:
        if verify not in ("lazy", "eager"):
            raise ValueError(f"verify must be 'lazy' or 'eager', got {verify!r}")
        t0 = time.perf_counter()
        self.layout = layout
        self.state_dir = state_dir
        self.checkpoint_records = checkpoint_records
        self.spill_blocks = spill_blocks
        os.makedirs(state_dir, exist_ok=True)
        phases = {}
        self.wal = Wal(state_dir, layouts=layout.to_bytes(), sync=sync)
        try:
            # NOTE: recovery allocates millions of objects that all stay alive; the collector
            # would walk them again and again for nothing (measured: a third of a 1M-block
            # recovery), so it is paused until ready.
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                self._open(layout, num_blocks, tenant_salt, write_policy, policy, verify, shm_dir,
                           reclaim_grace_s, use_cuda, phases, t0)
            finally:
                if gc_was_enabled:
                    gc.enable()
        except BaseException:
            self.wal.close()
            raise

    # -- recovery ----------------------------------------------------------------------------

    def _open(self, layout, num_blocks, tenant_salt, write_policy, policy, verify, shm_dir,
              reclaim_grace_s, use_cuda, phases, t0) -> None:
        wal = self.wal
        sizes = tuple(num_blocks)
        t = time.perf_counter()
        phases["open_s"] = t - t0
        lsn, index, seq_values = wal.load_checkpoint()
        first_start = not index
        name = f"prefixd-{wal.root_seed[:6].hex()}-{layout.digest()[:6].hex()}"
        meta = wal.meta
        host_path = os.path.join(shm_dir, f"{name}.host.pool")
        keep_host = (not first_start and meta.previous_boot_id == meta.boot_id
                     and os.path.exists(host_path))
        dev_path = os.path.join(shm_dir, f"{name}.device.pool")
        for path, drop in ((dev_path, True), (host_path, not keep_host)):
            if drop and os.path.exists(path):
                os.unlink(path)
        saved_ids = {}
        if index:
            import msgpack

            saved = msgpack.unpackb(index[b"meta"]).get("file_ids", {})
            saved_ids = {Tier(int(k)): bytes.fromhex(v) for k, v in saved.items()
                         if int(k) == DISK or (int(k) == HOST and keep_host)}
        self.store = TierStore(layout, {Tier.DEVICE: sizes[0], Tier.HOST: sizes[1], Tier.DISK: sizes[2]},
                               state_dir=self.state_dir, shm_dir=shm_dir, name=name,
                               fresh=first_start, file_ids=saved_ids, use_cuda=use_cuda)
        root = root_hash(wal.root_seed, tenant_salt, layout.digest())
        self.cache = cache = PrefixCache(sizes, layout.block_size, root_hash=root, policy=policy,
                                         data=self.store, write_policy=write_policy)
        tree = cache.tree
        ckpt_meta, ckpt_nodes = ckpt.load(tree, index, cache.block_bytes)
        seqs: dict = {}
        if seq_values:
            import msgpack

            for seq_id, session_id, deepest, extra in msgpack.unpackb(seq_values[b"seqs"]):
                root_node = tree.root(extra)
                seqs[seq_id] = [session_id, root_node if deepest == ZERO_HASH else deepest, extra]
        t2 = time.perf_counter()
        phases["checkpoint_load_s"] = t2 - t
        replayer = Replayer(tree, seqs, cache.block_bytes)
        if ckpt_nodes:
            replayer.use_checkpoint(ckpt_nodes, index[b"blocks.hashes"])
        for seq in seqs.values():  # checkpointed sequences name their node by hash
            if isinstance(seq[1], bytes):
                seq[1] = replayer.ending_at(seq[1])
        apply = replayer.apply
        for rec in wal.replay(lsn):
            apply(rec)
        max_seq = max(max(seqs, default=0), replayer.max_seq_id)
        t3 = time.perf_counter()
        phases["replay_s"] = t3 - t2
        phases["records_replayed"] = replayer.records
        # one walk of the tree serves reconciliation, the allocators and the queues
        order = list(tree.nodes())
        reconcile(tree, keep_host=keep_host, seqs=seqs, order=order)
        slot_lists = [n.slots for n in order]
        for tier in (HOST, DISK):
            used = list(chain.from_iterable([s[tier] for s in slot_lists if s[tier] is not None]))
            if cache.allocators[tier] is not None:
                cache.allocators[tier].take(used)
            elif used:
                raise CacheError(f"the saved index holds blocks in tier {tier}, which is now absent")
        cache._next_id = max(max_seq, ckpt_meta.get("next_seq_id", 1) - 1) + 1
        self.recovered: dict[int, RecoveredSeq] = {}
        for seq_id, (session_id, node, extra) in seqs.items():
            tree.lock(node)
            self.recovered[seq_id] = RecoveredSeq(seq_id, session_id, node, extra)
        tree.rebuild_queues(order)
        tiering = cache.tiering
        tiering.defer_frees = True
        tiering.defer_disk = True
        cache.on_deferred_shortage = self._force_reclaim
        self._sessions: dict[int, int] = {}  # live seq id -> session id
        cache.drain_events()
        if verify == "eager":
            phases["verified_blocks"] = self._verify_disk()
        t4 = time.perf_counter()
        phases["reconcile_s"] = t4 - t3
        self._since_checkpoint = 0
        if first_start:
            self.checkpoint()
        else:
            wal.append(Kind.RECOVER, wal.open_epoch(), int(keep_host))
            self._log()
            wal.flush().result()
            if not keep_host and Tier.HOST in self.store.file_ids:
                # NOTE: the host pool was just created with a new file id, and file ids are
                # persisted only by checkpoints: without one, the next restart on this boot
                # would find this file, expect the old id and refuse to start.
                self.checkpoint()
        self._reclaim_deadline = time.monotonic() + reclaim_grace_s
        phases["ready_s"] = time.perf_counter() - t0
        phases["keep_host"] = keep_host
        phases["epoch"] = wal.open_epoch()
        phases["blocks"] = list(tree.num_blocks_in)
        self.recovery = phases
        log.info("prefixd cache ready state_dir=%s epoch=%d blocks=%s recovered_seqs=%d ready_s=%.3f",
                 self.state_dir, wal.open_epoch(), tree.num_blocks_in, len(self.recovered), phases["ready_s"])

    def _verify_disk(self) -> int:
        """Eager verification: every disk block against its checksum; bad ones cut."""
        checked = 0
        for node in [n for n in self.cache.tree.nodes() if n.slots[DISK] is not None]:
            if node.slots[DISK] is None or node.checksums is None:
                continue
            ok = self.store.verify(Tier.DISK, node.slots[DISK], node.checksums)
            checked += len(ok)
            if not all(ok):
                self.cache.tiering.cut_corrupt(node, ok.index(False))
        return checked

    # -- operations --------------------------------------------------------------------------

    def open(self, tokens, extra: bytes = b"", *, session_id: int = 0):
        seq = self.cache.open(tokens, extra)
        self._sessions[seq.id] = session_id
        self._log(session_id)
        return seq

    def extend(self, seq_id: int, tokens) -> list[int]:
        slots = self.cache.extend(seq_id, tokens)
        self._log()
        return slots

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

    def commit(self, seq_id: int, durability: str = "crash") -> int:
        """Index the sequence's full blocks; return once they are as durable as asked.

        Raises:
            UnknownSequence, ValueError (bad durability), DurabilityError,
            prefixd.wal.WalFailedError (the log can no longer make anything durable; also when
            the disk pool's fdatasync failed, which poisons the log).
        """
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        seq = self.cache.sequence(seq_id)
        added = self.cache.commit(seq_id)
        self._make_durable(seq, durability)
        return added

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
        for node in path_to(seq.node):
            if node.slots[DISK] is not None or (want == HOST and node.slots[HOST] is not None):
                continue
            if not tiering.write_down(node, want if self.cache.allocators[want] else DISK):
                raise DurabilityError(f"cannot make sequence {seq.id} {durability}-durable: "
                                      f"no room in the {'disk' if want == DISK else 'host'} tier")
        crash_point("data_written")
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
                crash_point("data_synced")
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
        crash_point("checkpoint_inside")
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
