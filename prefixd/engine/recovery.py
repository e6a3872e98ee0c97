"""Recovery: what a ``DurableCache`` is rebuilt from, read from its state directory.

``recover`` reads, top-down: the checkpoint (``_load``: tiers opened, tree rebuilt), the log
tail replayed onto it (``prefixd.engine.replay``), the restart reconciled (what does not
survive it is dropped: ``Replayer.restart``, ``prefixd.engine.reconcile``), a lost disk pool
refused or forgotten, allocators and eviction queues rebuilt, recovered sequences held for
reclaim, and (``eager``) every disk block verified. It returns a ``Recovered`` value and
writes nothing to the log: the caller assigns it, then takes the first checkpoint or appends
the RECOVER record (``Upkeep.open_epoch``, from ``DurableCache.__init__``).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import NamedTuple

from prefixd.engine import checkpoint
from prefixd.cache.errors import CacheError
from prefixd.engine.errors import IndexLostError, TierLostError
from prefixd.engine.reconcile import forget_tier
from prefixd.cache.hashing import root_hash
from prefixd.cache.node import DISK, HOST
from prefixd.cache.prefix_cache import PrefixCache
from prefixd.engine.reclaim import RecoveredSeq
from prefixd.engine.records import ZERO_HASH
from prefixd.engine.replay import Replayer, ReplayError
from prefixd.api.tiers import Tier
from prefixd.storage.tier_store import TierStore
from prefixd.wal import WalCorruptError

log = logging.getLogger(__name__)

# What decoding checksum-valid but wrong checkpoint bytes raises (msgpack's errors are ValueErrors)
_UNDECODABLE = (ValueError, KeyError, IndexError, TypeError, struct.error)


class Recovered(NamedTuple):
    """What recovery rebuilt, for ``DurableCache.__init__`` to assign.

    ``cache`` and ``store`` are open (the caller owns them from here on, and closes ``store``);
    ``recovered`` holds the sequences that were live before the restart, each locked on its
    deepest surviving node; ``phases`` holds the timings and counts of ``DurableCache.recovery``
    so far.
    """

    cache: PrefixCache
    store: TierStore
    recovered: dict[int, RecoveredSeq]
    first_start: bool  # an empty state directory: the caller takes the first checkpoint
    keep_host: bool  # the host pool survived (same boot)
    new_file_ids: bool  # a pool file got a new id: only a checkpoint persists it
    replaced_pool: str | None  # a disk pool file made for a lost one (the caller removes it on failure)
    tail_records: int  # records replayed since the last checkpoint (they count toward the next)
    tail_blocks: int  # ... and the blocks they decoded (``records.Scan.blocks``)
    phases: dict

    def ready(self, state_dir: str, epoch: int, t0: float) -> dict:
        """The pool is ready (its epoch opened): ``phases`` completed, and logged."""
        phases = self.phases
        phases["ready_s"] = time.perf_counter() - t0
        phases["keep_host"] = self.keep_host
        phases["epoch"] = epoch
        phases["blocks"] = list(self.cache.tree.num_blocks_in)
        log.info("prefixd cache ready state_dir=%s epoch=%d blocks=%s recovered_seqs=%d ready_s=%.3f",
                 state_dir, epoch, self.cache.tree.num_blocks_in, len(self.recovered),
                 phases["ready_s"])
        return phases

    def abandon(self) -> None:
        """Close what recovery opened (the tiers, a pool file made for a lost one), when what
        follows it fails; never raises over the error that got us here."""
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 - logged; the first error is what the caller needs
            log.exception("closing the tiers after a failed recovery failed path=%s", self.store.name)
        if self.replaced_pool is not None and os.path.exists(self.replaced_pool):
            os.unlink(self.replaced_pool)  # nothing was written to it; the next start sees it missing again


def recover(wal, state_dir: str, layout, num_blocks, *, tenant_salt: bytes, write_policy: str, policy: str,
            verify: str, shm_dir: str, use_cuda, forget_missing_tier: bool, progress,
            t0: float, ledgers=None, tenant: str = "default") -> Recovered:
    """Rebuild a ``DurableCache``'s state from ``wal`` and the pool files of ``state_dir``.

    ``forget_missing_tier``: a disk pool file that is gone while the index names blocks in it
    is refused (``TierLostError``) unless it is set; then those blocks are dropped from the
    index and counted in ``phases["forgotten_blocks"]``. ``t0``: when opening began (the
    ``open_s`` phase). ``ledgers`` (by ``Tier``) and ``tenant``: whom the pool files are
    charged to (``TierStore``).

    Raises:
        WalCorruptError: the log or the checkpoint is damaged (a record that does not fit the
            state replay reached included). TierLostError, IndexLostError, StateFormatError,
            StorageError (a pool file is refused), WalError.

    NOTE: whatever fails, every resource recovery opened (the tiers' files, mappings and
    threads, the log-prefetch thread, a pool file it created to replace a lost one) is closed
    before the error leaves; the caller closes the Wal it opened.
    """
    run = _Recovery(wal, state_dir, layout, tuple(num_blocks), tenant_salt, shm_dir, use_cuda,
                    forget_missing_tier)
    run.ledgers, run.tenant = ledgers, tenant
    try:
        return run.recover(write_policy, policy, verify, progress, t0)
    except BaseException as exc:
        run.close_opened()
        if isinstance(exc, ReplayError):  # the log does not fit the checkpoint: a damaged log
            raise WalCorruptError(None, f"a record does not fit the state replay reached: {exc}",
                                  wal.state_dir) from exc
        raise


class _Recovery:
    """One recovery's inputs and what it has opened so far (closed again if it fails)."""

    def __init__(self, wal, state_dir: str, layout, sizes: tuple, tenant_salt: bytes, shm_dir: str, use_cuda,
                 forget_missing_tier: bool) -> None:
        self.wal = wal
        self.state_dir = state_dir
        self.layout = layout
        self.sizes = sizes
        self.tenant_salt = tenant_salt
        self.shm_dir = shm_dir
        self.use_cuda = use_cuda
        self.forget_missing_tier = forget_missing_tier
        self.ledgers, self.tenant = None, "default"  # whom the pool files are charged to
        self.store: TierStore | None = None  # once opened
        self.replaced_pool: str | None = None  # a pool file made for a lost one

    def close_opened(self) -> None:
        """Close what a failed recovery opened (never raises over the error that got us here)."""
        store, self.store = self.store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - logged; the recovery error is what the caller needs
                log.exception("closing the tiers after a failed recovery failed state_dir=%s", self.state_dir)
        if self.replaced_pool is not None and os.path.exists(self.replaced_pool):
            os.unlink(self.replaced_pool)  # nothing was written to it; the next start sees it missing again

    def recover(self, write_policy: str, policy: str, verify: str, progress, t0: float) -> Recovered:
        wal = self.wal
        phases: dict = {}
        t = time.perf_counter()
        phases["open_s"] = t - t0
        # NOTE: a helper thread reads the log tail's pages while the checkpoint loads: after a
        # reboot both come from disk, and the log's leaves are scattered 4 KiB pages.
        prefetching = wal.prefetch()
        try:
            # NOTE: the checkpoint is read inside one read transaction, straight from the map: a
            # 1M-block checkpoint is ~90 MB, and joining its chunks first cost a copy of all of it.
            lsn, first_start, keep_host, loaded, seqs, lost, cache = wal.with_checkpoint(
                lambda lsn, index, seq_values: self._load(lsn, index, seq_values, write_policy, policy))
            tree = cache.tree
            t2 = time.perf_counter()
            phases["checkpoint_load_s"] = t2 - t
            replayer = Replayer(tree, seqs, cache.block_bytes)
            if loaded.nodes:
                replayer.use_checkpoint(loaded.nodes, loaded.hash_lo)
            for seq in seqs.values():  # checkpointed sequences name their node by hash
                if isinstance(seq[1], bytes):
                    seq[1] = replayer.ending_at(seq[1])
            batches = wal.replay_batches(lsn)
            if progress is not None:
                progress.begin(wal.durable_lsn - lsn)
                batches = progress.counting(batches)
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
        phases["forgotten_blocks"] = 0 if lost is None else self._forget_lost_tier(tree, seqs, DISK, lost)
        phases["device_runs_missed"] = replayer.device_runs_missed  # a bug if not 0: see Replayer.restart
        order = list(tree.nodes())  # one walk serves the allocators and the queues
        slot_lists = [n.slots for n in order]
        for tier in (HOST, DISK):
            used = loaded.placed.used(slot_lists, tier)
            if cache.allocators[tier] is not None:
                cache.allocators[tier].take(used)
            elif used.size:
                raise CacheError(f"the saved index holds blocks in tier {tier}, which is now absent")
        cache.restore_next_seq_id(max(max_seq, loaded.meta.get("next_seq_id", 1) - 1) + 1)
        recovered: dict[int, RecoveredSeq] = {}
        for seq_id, (session_id, node, extra) in seqs.items():
            tree.lock(node)
            recovered[seq_id] = RecoveredSeq(seq_id, session_id, node, extra)
        tree.rebuild_queues(order)
        tiering = cache.tiering
        tiering.defer_frees = True
        tiering.defer_disk = True
        cache.drain_events()
        if verify == "eager":
            phases["verified_blocks"] = verify_disk(cache, self.store)
        phases["reconcile_s"] = time.perf_counter() - t3
        store = self.store
        new_file_ids = lost is not None or (not keep_host and Tier.HOST in store.file_ids)
        return Recovered(cache, store, recovered, first_start, keep_host, new_file_ids,
                         self.replaced_pool, replayer.records, replayer.blocks, phases)

    def _load(self, lsn, index, seq_values, write_policy: str, policy: str) -> tuple:
        """The part of recovery that reads the checkpoint (values as chunk lists, valid only
        during this call): refuse another format, open the tiers, rebuild the tree."""
        import msgpack

        wal, state_dir, layout, sizes = self.wal, self.state_dir, self.layout, self.sizes
        try:
            checkpoint.check_format(index, state_dir)  # before anything in the directory is touched
        except _UNDECODABLE as exc:  # NOTE: chunk checksums cover values, not keys: a flipped key loses one
            raise WalCorruptError(lsn, f"the checkpoint's meta does not decode: {exc!r}", state_dir) from exc
        first_start = not index
        name = f"prefixd-{wal.root_seed[:6].hex()}-{layout.digest()[:6].hex()}"
        meta = wal.meta
        if first_start:
            # a pool of another root seed: the log that named its blocks is gone (our own pool from
            # a first start that crashed before its first checkpoint has our name, and is redone)
            orphans = sorted(f for f in os.listdir(state_dir)
                             if f.endswith(".disk.pool") and f != f"{name}.disk.pool")
            if orphans:
                raise IndexLostError(state_dir, orphans)
        host_path = os.path.join(self.shm_dir, f"{name}.host.pool")
        keep_host = (not first_start and meta.previous_boot_id == meta.boot_id
                     and os.path.exists(host_path))
        dev_path = os.path.join(self.shm_dir, f"{name}.device.pool")
        for path, drop in ((dev_path, True), (host_path, not keep_host)):
            if drop and os.path.exists(path):
                os.unlink(path)
        saved_ids = {}
        if index:
            saved_ids = _saved_file_ids(index, lsn, state_dir, keep_host)
        lost = None
        disk_path = os.path.join(state_dir, f"{name}.disk.pool")
        if Tier.DISK in saved_ids and not os.path.exists(disk_path):
            # NOTE: never recreated under the saved id (an empty file would pass for the lost one,
            # and every block the index names there would be dropped on use, silently): a new
            # file with a new id; once replay has said what the index names there, recovery
            # refuses or forgets (``_forget_lost_tier``).
            del saved_ids[Tier.DISK]
            lost = self.replaced_pool = disk_path
        self.store = TierStore(layout, {Tier.DEVICE: sizes[0], Tier.HOST: sizes[1], Tier.DISK: sizes[2]},
                               state_dir=state_dir, shm_dir=self.shm_dir, name=name,
                               fresh=first_start, file_ids=saved_ids, use_cuda=self.use_cuda,
                               ledgers=self.ledgers, tenant=self.tenant)
        root = root_hash(wal.root_seed, self.tenant_salt, layout.digest())
        cache = PrefixCache(sizes, layout.block_size, root_hash=root, policy=policy,
                            data=self.store, write_policy=write_policy)
        tree = cache.tree
        seqs: dict = {}
        try:
            loaded = checkpoint.load(tree, index, cache.block_bytes)
            if seq_values:
                for seq_id, session_id, deepest, extra in msgpack.unpackb(checkpoint.whole(seq_values[b"seqs"])):
                    root_node = tree.root(extra)
                    seqs[seq_id] = [session_id, root_node if deepest == ZERO_HASH else deepest, extra]
        except _UNDECODABLE as exc:  # every chunk passed its checksum: written wrong, or damaged in place
            raise WalCorruptError(lsn, f"the checkpoint does not decode: {exc!r}", state_dir) from exc
        return lsn, first_start, keep_host, loaded, seqs, lost, cache

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
        if not self.forget_missing_tier:
            raise TierLostError(self.state_dir, path, num_blocks)
        forget_tier(tree, tier, seqs)
        log.warning("pool file missing: its blocks are forgotten (forget_missing_tier) path=%s blocks=%d",
                    path, num_blocks)
        return num_blocks


def _saved_file_ids(index, lsn: int, state_dir: str, keep_host: bool) -> dict:
    """The pool file ids the checkpoint saved, for the tiers whose files must be reopened."""
    import msgpack

    try:
        saved = msgpack.unpackb(checkpoint.whole(index[b"meta"])).get("file_ids", {})
        return {Tier(int(k)): bytes.fromhex(v) for k, v in saved.items()
                if int(k) == DISK or (int(k) == HOST and keep_host)}
    except _UNDECODABLE as exc:
        raise WalCorruptError(lsn, f"the checkpoint's meta does not decode: {exc!r}", state_dir) from exc


def verify_disk(cache, store) -> int:
    """Eager verification: every disk block of ``cache`` against its checksum (read through
    ``store``); bad ones cut. Returns the blocks checked."""
    checked = 0
    for node in [n for n in cache.tree.nodes() if n.slots[DISK] is not None]:
        if node.slots[DISK] is None or node.checksums is None:
            continue
        ok = store.verify(Tier.DISK, node.slots[DISK], node.checksums)
        checked += len(ok)
        if all(ok):
            node.disk_verified = True
            continue
        head = cache.tiering.cut_corrupt(node, ok.index(False))
        if head is not None:
            head.disk_verified = True
    return checked
