"""Recovery: open a ``DurableCache`` on its state directory.

Checkpoint load, log tail replay, reconciliation (``prefixd.engine.replay``), allocators and
eviction queues rebuilt, recovered sequences held for reclaim, then a RECOVER record (or, on a
first start, an empty checkpoint naming the pool files) before the cache is ready. Timings of
each phase land in ``DurableCache.recovery``.
"""

from __future__ import annotations

import logging
import os
import struct
import time

from prefixd.engine import snapshot as ckpt
from prefixd.cache.errors import CacheError
from prefixd.engine.errors import IndexLostError, TierLostError
from prefixd.engine.reconcile import surviving
from prefixd.cache.hashing import root_hash
from prefixd.cache.node import DISK, HOST
from prefixd.cache.prefix_cache import PrefixCache
from prefixd.engine.reclaim import RecoveredSeq
from prefixd.engine.records import ZERO_HASH
from prefixd.engine.replay import Replayer, ReplayError
from prefixd.api.tiers import Tier
from prefixd.storage.tier_store import TierStore
from prefixd.wal import Kind, WalCorruptError

log = logging.getLogger(__name__)

# What decoding checksum-valid but wrong checkpoint bytes raises (msgpack's errors are ValueErrors)
_UNDECODABLE = (ValueError, KeyError, IndexError, TypeError, struct.error)


def recover(self, layout, num_blocks, tenant_salt, write_policy, policy, verify, shm_dir,
            reclaim_grace_s, use_cuda, phases, t0) -> None:
    """Open ``self`` (a ``DurableCache``) on its state directory: the recovery procedure.

    ``self.forget_missing_tier`` (default False): a disk pool file that is gone while the index
    names blocks in it is refused (``TierLostError``) unless it is set; then those blocks are
    dropped from the index and counted in ``recovery["forgotten_blocks"]``.

    Raises:
        WalCorruptError: the log or the checkpoint is damaged (a record that does not fit the
            state replay reached included). TierLostError, IndexLostError, StateFormatError,
            StorageError (a pool file is refused), WalError.

    NOTE: whatever fails, every resource recovery opened (the tiers' files, mappings and
    threads, the log-prefetch thread, a pool file it created to replace a lost one) is closed
    before the error leaves; the caller closes the Wal it opened.
    """
    self.store = None
    self._replaced_pool = None  # a pool file recovery created for a lost one (removed on failure)
    try:
        _recover(self, layout, num_blocks, tenant_salt, write_policy, policy, verify, shm_dir,
                 reclaim_grace_s, use_cuda, phases, t0)
    except BaseException as exc:
        _close_opened(self)
        if isinstance(exc, ReplayError):  # the log does not fit the checkpoint: a damaged log
            raise WalCorruptError(None, f"a record does not fit the state replay reached: {exc}",
                                  self.wal.state_dir) from exc
        raise
    self._replaced_pool = None


def _close_opened(self) -> None:
    """Close what a failed recovery opened (never raises over the error that got us here)."""
    store, self.store = self.store, None
    if store is not None:
        try:
            store.close()
        except Exception:  # noqa: BLE001 - logged; the recovery error is what the caller needs
            log.exception("closing the tiers after a failed recovery failed state_dir=%s", self.state_dir)
    if self._replaced_pool is not None and os.path.exists(self._replaced_pool):
        os.unlink(self._replaced_pool)  # nothing was written to it; the next start sees it missing again


def _recover(self, layout, num_blocks, tenant_salt, write_policy, policy, verify, shm_dir,
             reclaim_grace_s, use_cuda, phases, t0) -> None:
    wal = self.wal
    sizes = tuple(num_blocks)
    t = time.perf_counter()
    phases["open_s"] = t - t0
    # NOTE: a helper thread reads the log tail's pages while the checkpoint loads: after a
    # reboot both come from disk, and the log's leaves are scattered 4 KiB pages.
    prefetching = wal.prefetch()
    try:
        # NOTE: the checkpoint is read inside one read transaction, straight from the map: a
        # 1M-block checkpoint is ~90 MB, and joining its chunks first cost a copy of all of it.
        lsn, first_start, keep_host, loaded, seqs, lost = wal.with_checkpoint(
            lambda lsn, index, seq_values: _from_checkpoint(
                self, lsn, index, seq_values, layout, sizes, tenant_salt, write_policy, policy,
                shm_dir, use_cuda))
        cache = self.cache
        tree = cache.tree
        t2 = time.perf_counter()
        phases["checkpoint_load_s"] = t2 - t
        replayer = Replayer(tree, seqs, cache.block_bytes)
        ckpt_meta, placed = loaded.meta, loaded.placed
        if loaded.nodes:
            replayer.use_checkpoint(loaded.nodes, loaded.hash_lo)
        for seq in seqs.values():  # checkpointed sequences name their node by hash
            if isinstance(seq[1], bytes):
                seq[1] = replayer.ending_at(seq[1])
        batches = wal.replay_batches(lsn)
        if self.progress is not None:
            self.progress.begin(wal.durable_lsn - lsn)
            batches = self.progress.counting(batches)
        replayer.apply_batches(batches)
    finally:
        # its read transaction must end before anything can close the Wal; stopped, not joined:
        # replay has read what it would have, and an error must not wait on a helper
        prefetching.stop()
    max_seq = max(max(seqs, default=0), replayer.max_seq_id)
    t3 = time.perf_counter()
    phases["replay_s"] = t3 - t2
    phases["records_replayed"] = replayer.records
    phases["blocks_replayed"] = replayer.blocks
    replayer.restart(keep_host)  # the end of the log: what this restart drops, as a RECOVER does
    phases["forgotten_blocks"] = 0 if lost is None else _forget_lost_tier(self, tree, seqs, DISK, lost)
    phases["device_runs_missed"] = replayer.device_runs_missed  # a bug if not 0: see Replayer.restart
    order = list(tree.nodes())  # one walk serves the allocators and the queues
    slot_lists = [n.slots for n in order]
    for tier in (HOST, DISK):
        used = placed.used(slot_lists, tier)
        if cache.allocators[tier] is not None:
            cache.allocators[tier].take(used)
        elif used.size:
            raise CacheError(f"the saved index holds blocks in tier {tier}, which is now absent")
    cache.restore_next_seq_id(max(max_seq, ckpt_meta.get("next_seq_id", 1) - 1) + 1)
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
        phases["verified_blocks"] = verify_disk(self)
    t4 = time.perf_counter()
    phases["reconcile_s"] = t4 - t3
    self._since_checkpoint = self._tail_blocks = 0
    if first_start:
        self.checkpoint()
    else:
        # NOTE: the one record appended beside the event path (``DurableCache._log``): it is
        # about the engine's restart, not a change of the cache, and it must come first in the
        # new epoch, before any event of it, while nothing else is queued.
        wal.append(Kind.RECOVER, wal.open_epoch(), int(keep_host))
        self._log()
        wal.flush().result()
        if lost is not None or (not keep_host and Tier.HOST in self.store.file_ids):
            # NOTE: the host pool was just created with a new file id, and file ids are
            # persisted only by checkpoints: without one, the next restart on this boot
            # would find this file, expect the old id and refuse to start. The same for a disk
            # pool recreated in place of a lost one.
            self.checkpoint()
        else:
            # NOTE: the replayed tail stays in the log until the next checkpoint, so it counts
            # toward the trigger; set only now, so that a checkpoint it makes due is taken by
            # the first operation after ready rather than before it.
            self._since_checkpoint, self._tail_blocks = replayer.records, replayer.blocks
    self._reclaim_deadline = time.monotonic() + reclaim_grace_s
    phases["ready_s"] = time.perf_counter() - t0
    phases["keep_host"] = keep_host
    phases["epoch"] = wal.open_epoch()
    phases["blocks"] = list(tree.num_blocks_in)
    self.recovery = phases
    log.info("prefixd cache ready state_dir=%s epoch=%d blocks=%s recovered_seqs=%d ready_s=%.3f",
             self.state_dir, wal.open_epoch(), tree.num_blocks_in, len(self.recovered), phases["ready_s"])

def _from_checkpoint(self, lsn, index, seq_values, layout, sizes, tenant_salt, write_policy, policy,
                     shm_dir, use_cuda) -> tuple:
    """The part of recovery that reads the checkpoint (values as chunk lists, valid only
    during this call): refuse another format, open the tiers, rebuild the tree."""
    import msgpack

    wal = self.wal
    try:
        ckpt.check_format(index, self.state_dir)  # before anything in the directory is touched
    except _UNDECODABLE as exc:  # NOTE: chunk checksums cover values, not keys: a flipped key loses one
        raise WalCorruptError(lsn, f"the checkpoint's meta does not decode: {exc!r}", self.state_dir) from exc
    first_start = not index
    name = f"prefixd-{wal.root_seed[:6].hex()}-{layout.digest()[:6].hex()}"
    meta = wal.meta
    if first_start:
        # a pool of another root seed: the log that named its blocks is gone (our own pool from
        # a first start that crashed before its first checkpoint has our name, and is redone)
        orphans = sorted(f for f in os.listdir(self.state_dir)
                         if f.endswith(".disk.pool") and f != f"{name}.disk.pool")
        if orphans:
            raise IndexLostError(self.state_dir, orphans)
    host_path = os.path.join(shm_dir, f"{name}.host.pool")
    keep_host = (not first_start and meta.previous_boot_id == meta.boot_id
                 and os.path.exists(host_path))
    dev_path = os.path.join(shm_dir, f"{name}.device.pool")
    for path, drop in ((dev_path, True), (host_path, not keep_host)):
        if drop and os.path.exists(path):
            os.unlink(path)
    saved_ids = {}
    if index:
        saved_ids = _saved_file_ids(index, lsn, self.state_dir, keep_host)
    lost = None
    disk_path = os.path.join(self.state_dir, f"{name}.disk.pool")
    if Tier.DISK in saved_ids and not os.path.exists(disk_path):
        # NOTE: never recreated under the saved id (an empty file would pass for the lost one,
        # and every block the index names there would be dropped on use, silently): a new
        # file with a new id; once replay has said what the index names there, recovery
        # refuses or forgets (``_forget_lost_tier``).
        del saved_ids[Tier.DISK]
        lost = self._replaced_pool = disk_path
    self.store = TierStore(layout, {Tier.DEVICE: sizes[0], Tier.HOST: sizes[1], Tier.DISK: sizes[2]},
                           state_dir=self.state_dir, shm_dir=shm_dir, name=name,
                           fresh=first_start, file_ids=saved_ids, use_cuda=use_cuda)
    root = root_hash(wal.root_seed, tenant_salt, layout.digest())
    self.cache = cache = PrefixCache(sizes, layout.block_size, root_hash=root, policy=policy,
                                     data=self.store, write_policy=write_policy)
    tree = cache.tree
    seqs: dict = {}
    try:
        loaded = ckpt.load(tree, index, cache.block_bytes)
        if seq_values:
            for seq_id, session_id, deepest, extra in msgpack.unpackb(ckpt.whole(seq_values[b"seqs"])):
                root_node = tree.root(extra)
                seqs[seq_id] = [session_id, root_node if deepest == ZERO_HASH else deepest, extra]
    except _UNDECODABLE as exc:  # every chunk passed its checksum: written wrong, or damaged in place
        raise WalCorruptError(lsn, f"the checkpoint does not decode: {exc!r}", self.state_dir) from exc
    return lsn, first_start, keep_host, loaded, seqs, lost


def _saved_file_ids(index, lsn: int, state_dir: str, keep_host: bool) -> dict:
    """The pool file ids the checkpoint saved, for the tiers whose files must be reopened."""
    import msgpack

    try:
        saved = msgpack.unpackb(ckpt.whole(index[b"meta"])).get("file_ids", {})
        return {Tier(int(k)): bytes.fromhex(v) for k, v in saved.items()
                if int(k) == DISK or (int(k) == HOST and keep_host)}
    except _UNDECODABLE as exc:
        raise WalCorruptError(lsn, f"the checkpoint's meta does not decode: {exc!r}", state_dir) from exc


def _forget_lost_tier(self, tree, seqs: dict, tier: int, path: str) -> int:
    """The tier's pool file was lost (``path`` is its empty replacement): refuse, or, when
    ``forget_missing_tier`` is set, drop the tier's residency from every run (runs resident
    nowhere are forgotten, children first; sequences move to their deepest survivor). Returns
    the blocks dropped.

    Raises:
        TierLostError: the index names blocks in the tier and forgetting was not asked for.
    """
    num_blocks = tree.num_blocks_in[tier]
    if not num_blocks:
        log.warning("pool file missing, recreated empty (the index named no block in it) path=%s", path)
        return 0
    if not getattr(self, "forget_missing_tier", False):
        raise TierLostError(self.state_dir, path, num_blocks)
    for node in reversed(list(tree.nodes())):  # children before their parents
        if node.slots[tier] is not None:
            tree.unplace(node, tier)
    for seq in seqs.values():
        seq[1] = surviving(seq[1])
    log.warning("pool file missing: its blocks are forgotten (forget_missing_tier) path=%s blocks=%d",
                path, num_blocks)
    return num_blocks


def verify_disk(self) -> int:
    """Eager verification: every disk block against its checksum; bad ones cut."""
    checked = 0
    for node in [n for n in self.cache.tree.nodes() if n.slots[DISK] is not None]:
        if node.slots[DISK] is None or node.checksums is None:
            continue
        ok = self.store.verify(Tier.DISK, node.slots[DISK], node.checksums)
        checked += len(ok)
        if all(ok):
            node.disk_verified = True
            continue
        head = self.cache.tiering.cut_corrupt(node, ok.index(False))
        if head is not None:
            head.disk_verified = True
    return checked
