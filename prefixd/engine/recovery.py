"""Recovery: open a ``DurableCache`` on its state directory.

Checkpoint load, log tail replay, reconciliation (``prefixd.engine.replay``), allocators and
eviction queues rebuilt, recovered sequences held for reclaim, then a RECOVER record (or, on a
first start, an empty checkpoint naming the pool files) before the cache is ready. Timings of
each phase land in ``DurableCache.recovery``.
"""

from __future__ import annotations

import logging
import os
import time
from itertools import chain
from typing import NamedTuple

import numpy as np

from prefixd.engine import snapshot as ckpt
from prefixd.cache.errors import CacheError
from prefixd.engine.errors import IndexLostError
from prefixd.cache.hashing import root_hash
from prefixd.cache.node import DISK, HOST, path_to
from prefixd.cache.prefix_cache import PrefixCache
from prefixd.engine.replay import ZERO_HASH, Replayer
from prefixd.api.tiers import Tier
from prefixd.storage.tier_store import TierStore
from prefixd.wal import Kind

log = logging.getLogger(__name__)


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


def recover(self, layout, num_blocks, tenant_salt, write_policy, policy, verify, shm_dir,
            reclaim_grace_s, use_cuda, phases, t0) -> None:
    """Open ``self`` (a ``DurableCache``) on its state directory: the recovery procedure."""
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
        lsn, first_start, keep_host, ckpt_meta, ckpt_nodes, ckpt_hashes, seqs = wal.with_checkpoint(
            lambda lsn, index, seq_values: _from_checkpoint(
                self, lsn, index, seq_values, layout, sizes, tenant_salt, write_policy, policy,
                shm_dir, use_cuda))
        cache = self.cache
        tree = cache.tree
        t2 = time.perf_counter()
        phases["checkpoint_load_s"] = t2 - t
        replayer = Replayer(tree, seqs, cache.block_bytes)
        if ckpt_nodes:
            replayer.use_checkpoint(ckpt_nodes, ckpt_hashes)
        for seq in seqs.values():  # checkpointed sequences name their node by hash
            if isinstance(seq[1], bytes):
                seq[1] = replayer.ending_at(seq[1])
        replayer.apply_batches(wal.replay_batches(lsn))
    finally:
        prefetching.join()  # its read transaction must end before anything can close the Wal
    max_seq = max(max(seqs, default=0), replayer.max_seq_id)
    t3 = time.perf_counter()
    phases["replay_s"] = t3 - t2
    phases["records_replayed"] = replayer.records
    replayer.restart(keep_host)  # the end of the log: what this restart drops, as a RECOVER does
    phases["device_runs_missed"] = replayer.device_runs_missed  # a bug if not 0: see Replayer.restart
    order = list(tree.nodes())  # one walk serves the allocators and the queues
    slot_lists = [n.slots for n in order]
    for tier in (HOST, DISK):
        used = np.fromiter(chain.from_iterable([s[tier] for s in slot_lists if s[tier] is not None]),
                           dtype=np.int64)
        if cache.allocators[tier] is not None:
            cache.allocators[tier].take(used)
        elif used.size:
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
        phases["verified_blocks"] = verify_disk(self)
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

def _from_checkpoint(self, lsn, index, seq_values, layout, sizes, tenant_salt, write_policy, policy,
                     shm_dir, use_cuda) -> tuple:
    """The part of recovery that reads the checkpoint (values as chunk lists, valid only
    during this call): refuse another format, open the tiers, rebuild the tree."""
    import msgpack

    wal = self.wal
    ckpt.check_format(index, self.state_dir)  # before anything in the directory is touched
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
        saved = msgpack.unpackb(ckpt.whole(index[b"meta"])).get("file_ids", {})
        saved_ids = {Tier(int(k)): bytes.fromhex(v) for k, v in saved.items()
                     if int(k) == DISK or (int(k) == HOST and keep_host)}
    self.store = TierStore(layout, {Tier.DEVICE: sizes[0], Tier.HOST: sizes[1], Tier.DISK: sizes[2]},
                           state_dir=self.state_dir, shm_dir=shm_dir, name=name,
                           fresh=first_start, file_ids=saved_ids, use_cuda=use_cuda)
    root = root_hash(wal.root_seed, tenant_salt, layout.digest())
    self.cache = cache = PrefixCache(sizes, layout.block_size, root_hash=root, policy=policy,
                                     data=self.store, write_policy=write_policy)
    tree = cache.tree
    ckpt_meta, ckpt_nodes, ckpt_hashes = ckpt.load(tree, index, cache.block_bytes)
    seqs: dict = {}
    if seq_values:
        for seq_id, session_id, deepest, extra in msgpack.unpackb(ckpt.whole(seq_values[b"seqs"])):
            root_node = tree.root(extra)
            seqs[seq_id] = [session_id, root_node if deepest == ZERO_HASH else deepest, extra]
    return lsn, first_start, keep_host, ckpt_meta, ckpt_nodes, ckpt_hashes, seqs


def verify_disk(self) -> int:
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
