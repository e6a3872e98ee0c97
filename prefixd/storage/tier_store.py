"""The storage facade the cache core calls: three tiers of one KV layout and the bytes between them.

API (slots are lists of ints, one per block; positions in the lists pair source and destination)::

    store = TierStore(layout, {Tier.DEVICE: n0, Tier.HOST: n1, Tier.DISK: n2},
                      state_dir=..., shm_dir="/dev/shm", name=None, fresh=False, file_ids=None,
                      ledgers=None, tenant="default")
    store.tiers                                  # the present tiers (a tier with 0 blocks is absent)
    store.allocator(tier) -> SlotAllocator       # owned by the cache core; storage never allocates
                                                 # (an ExtentSlotAllocator for a sparse pool file)
    store.held_bytes(tier) -> int                # what the tier's file takes (charged to its ledger)
    store.extent_of(tier, slot) -> int           # the extent a slot starts in
    store.extent_slots(tier, extent) -> range    # the slots that keep an extent allocated
    store.shrink(tier) -> int                    # punch every idle extent; the bytes given back
    store.grow_refusals(tier) -> int             # grows the budget or the filesystem refused
    store.no_space(tier) -> (int, bool)          # ... the filesystem refused; the last did
    store.file_ids -> dict[Tier, bytes]          # persist these; pass them back as file_ids= on reopen
    store.descriptor(tier) -> dict               # shm path, offset, shape, strides, dtype (Attach)
    store.copy(src_tier, src_slots, dst_tier, dst_slots, *, verify=None, durable=False, checksums=True) -> CopyResult
    store.copy_async(...same...) -> Future[CopyResult]
    store.copy_within(tier, src_slots, dst_slots) -> None        # copy-on-write inside one tier
    store.sync(tier) -> None                     # DISK: fdatasync if anything was written; else no-op
    store.sync_async(tier) -> Future             # DISK: the same on the sync thread, shared by waiters
    store.write_behind = True                    # copies into DISK return before their pwritev
    store.read(tier, slots) -> Tensor            # [n, *layout.block_shape], a copy (DISK: unchecked)
    store.write(tier, slots, blocks) -> None     # blocks: [n, *layout.block_shape] of layout dtype
    store.checksum(tier, slots) -> list[int]
    store.verify(tier, slots, checksums) -> list[bool]
    store.close()

``CopyResult.checksums`` holds the checksum of every block written to HOST (unless the copy was
asked not to hash: ``checksums=False``) or DISK, or read from DISK; ``CopyResult.ok`` the
per-block verdict when ``verify`` (expected checksums) was given for a DISK source: a block with
``ok=False`` was not written to the destination and must be dropped.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping, Sequence

import torch

from prefixd.api.layout import KVLayout
from prefixd.api.tiers import Tier
from prefixd.crashpoints import crash_point
from prefixd.storage import movement
from prefixd.storage.block_io import BlockIO
from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.extent_slots import ExtentSlotAllocator
from prefixd.storage.movement import CopyResult, Staging
from prefixd.storage.pools import DEFAULT_TENANT, UNBOUNDED, DiskPool, TensorPool, open_pool
from prefixd.storage.slots import SlotAllocator
from prefixd.storage.spill_buffers import SpillBuffers
from prefixd.storage.tier_copy import TierCopier
from prefixd.storage.write_behind import DiskWriter

log = logging.getLogger(__name__)

__all__ = ["CopyResult", "Tier", "TierStore"]


class TierStore:
    """The pools of one KV layout, one per present tier, with their slot allocators.

    Data structure: ``_pools[tier]`` is a ``TensorPool`` (DEVICE, HOST) or a ``DiskPool`` (DISK);
    ``_allocators[tier]`` counts its free slots. Files: DISK in ``state_dir/<name>.disk.pool``;
    HOST, and DEVICE when there is no GPU, in ``shm_dir/<name>.<tier>.pool``.

    Byte budgets: every pool file but a CUDA pool is sparse, charged extent by extent to its
    tier's ``BudgetLedger`` (``ledgers``: one per tier, shared by every pool) under ``tenant``;
    its ``ExtentSlotAllocator`` grows, refuses (``None``: the cache evicts in this pool) and
    punches. A cross-pool evictor empties an extent of its choice (``extent_of``,
    ``extent_slots``) and gives its bytes back with ``shrink``.

    Invariants: every present tier has a pool and an allocator of the same size; absent tiers
    have neither.

    Thread safety: ``copy``/``copy_within``/``read``/``write``/``checksum`` may run on several
    threads at once provided no two touch the same slot; reads from DISK share one staging
    buffer and run one at a time. The allocators are not locked: the cache core owns them.
    Calls block until their bytes have moved; ``copy_async`` runs a copy on the store's own
    worker thread (FIFO) so an event loop never waits on disk.

    Write-behind (``write_behind = True``, set by the durable engine): a copy from a memory tier
    into DISK snapshots and hashes the source blocks on the calling thread and returns; the
    ``DiskWriter`` (``prefixd.storage.write_behind``) writes them in order, and ``sync_async``
    makes them durable with fdatasyncs shared by every waiter. Anything that reads the disk pool
    (or writes it directly) first waits until queued writes are written, so it never sees a
    slot's old bytes. NOTE: the snapshot lets the source slots be reused as soon as the copy
    returns (a device slot is freed at once on eviction); it costs one memcpy, like a host copy.

    NOTE: reopening is the default (the daemon restarts and recovers from the files);
    ``fresh=True`` is the one way to start empty, and it replaces every pool file of this name.
    """

    def __init__(self, layout: KVLayout, num_blocks: Mapping[Tier, int], *, state_dir: str,
                 shm_dir: str = "/dev/shm", name: str | None = None, fresh: bool = False,
                 file_ids: Mapping[Tier, bytes] | None = None, use_cuda: bool | None = None,
                 ledgers: Mapping[Tier, BudgetLedger] | None = None, tenant: str = DEFAULT_TENANT) -> None:
        """Open (or create) the pools.

        Args:
            num_blocks: blocks per tier; a tier missing or with 0 blocks is absent.
            state_dir: where the DISK pool file lives. shm_dir: where the HOST (and CPU DEVICE) files live.
            name: file name stem, unique per pool on this host (default: from the layout digest).
            fresh: replace existing pool files instead of reopening them.
            file_ids: the ids the caller persisted for existing files; a mismatch is refused.
            use_cuda: put DEVICE on the GPU (default: when CUDA is available).
            ledgers: the ledger each tier's file is charged to; None (or a tier missing): each
                tier gets its own unbounded ledger.
            tenant: whom the files are charged to.
        Raises:
            SpaceError: a tier's header extent does not fit (message has the asked and free bytes).
            BudgetExceededError: nor its ledger.
            HeaderMismatchError: an existing file belongs to another layout, version or file id.
            PoolFileMissingError: a tier in ``file_ids`` has no file (never recreated under the
                saved id: an empty file would pass for the one the caller's index describes).
        """
        self.layout = layout
        self.name = name or f"prefixd-{layout.digest().hex()[:16]}"
        cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        file_ids, ledgers = file_ids or {}, ledgers or {}
        self._pools: dict[Tier, TensorPool | DiskPool] = {}
        self._allocators: dict[Tier, SlotAllocator] = {}
        try:
            for tier in Tier:
                n = int(num_blocks.get(tier, 0))
                if n < 0:
                    raise ValueError(f"num_blocks[{tier.name}] must be >= 0, got {n}")
                if n == 0:
                    continue
                ledger = ledgers.get(tier) or BudgetLedger(tier.name.lower(), UNBOUNDED)
                pool = open_pool(layout, tier, n, state_dir=state_dir, shm_dir=shm_dir, name=self.name,
                                 fresh=fresh, file_id=file_ids.get(tier), cuda=cuda, ledger=ledger,
                                 tenant=tenant)
                self._pools[tier] = pool
                self._allocators[tier] = (SlotAllocator(n) if pool.sparse is None else
                                          ExtentSlotAllocator(pool.sparse, recovered=fresh))
        except BaseException:
            self._close_pools()
            raise
        self._helper = ThreadPoolExecutor(movement.HELPER_THREADS, thread_name_prefix="prefixd-storage-io")
        self._async = ThreadPoolExecutor(1, thread_name_prefix="prefixd-storage-async")
        self._staging = Staging(layout.block_bytes, pin=cuda) if Tier.DISK in self._pools else None
        self._writer = DiskWriter(self._sync_disk, self._pools[Tier.DISK].path) if Tier.DISK in self._pools else None
        if self._writer is not None and isinstance(self._allocators[Tier.DISK], ExtentSlotAllocator):
            # a queued write into a punched extent would allocate it again behind the ledger
            self._allocators[Tier.DISK].may_shrink = self._writer.idle
        self._spill_buffers = SpillBuffers(layout.block_bytes) if self._writer is not None else None
        # copies between tiers, and the write-behind path into DISK (``copy``, ``copy_within``)
        self.copier = TierCopier(self._pools, self.pool, self._check_range, self._writer, self._staging,
                                 self._helper, self._spill_buffers)
        # reads, writes and checksums by slot (``read``, ``write``, ``checksum``, ``verify``)
        self.blocks = BlockIO(layout, self.pool, self._check_range, self._writer, self._staging, self._helper)
        log.info("tier store open name=%s blocks=%s block_bytes=%d", self.name,
                 {t.name: p.num_blocks for t, p in self._pools.items()}, layout.block_bytes)

    # ----------------------------------------------------------------------------- queries
    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(self._pools)

    def allocator(self, tier: Tier) -> SlotAllocator:
        return self._allocators[self._present(tier)]

    def held_bytes(self, tier: Tier) -> int:
        """Bytes the tier's pool takes, as charged to its ledger (a CUDA pool: all of it)."""
        pool = self.pool(tier)
        return pool.sparse.charged if pool.sparse is not None else pool.fixed_bytes

    def is_fixed(self, tier: Tier) -> bool:
        """Whether the tier's pool is allocated whole (CUDA): no extent to grow or give back."""
        return not isinstance(self.allocator(tier), ExtentSlotAllocator)

    def extent_of(self, tier: Tier, slot: int) -> int:
        """The extent of the tier's file that ``slot`` starts in (0 for a CUDA pool).
        Raises ValueError: out of range."""
        alloc = self.allocator(tier)
        return alloc.extent_of(slot) if isinstance(alloc, ExtentSlotAllocator) else 0

    def extent_slots(self, tier: Tier, extent: int) -> range:
        """The slots that keep ``extent`` allocated: once all are free (released from the
        quarantine), ``shrink`` gives it back. Raises ValueError: out of range."""
        alloc = self.allocator(tier)
        if isinstance(alloc, ExtentSlotAllocator):
            return alloc.extent_slots(extent)
        if extent:
            raise ValueError(f"{Tier(tier).name} is not sparse: its one extent is 0")
        return range(alloc.num_slots)

    def shrink(self, tier: Tier) -> int:
        """Punch every idle extent of the tier's file; returns the bytes given back to its
        ledger. Raises StorageError: a punch failed (not one the filesystem cannot do)."""
        alloc = self.allocator(tier)
        return alloc.shrink() if isinstance(alloc, ExtentSlotAllocator) else 0

    def grow_refusals(self, tier: Tier) -> int:
        """Grows of the tier's file refused so far (budget full, ENOSPC or EDQUOT)."""
        alloc = self.allocator(tier)
        return alloc.gate.grow_refusals if isinstance(alloc, ExtentSlotAllocator) else 0

    def no_space(self, tier: Tier) -> tuple[int, bool]:
        """Grows the filesystem refused so far (ENOSPC, EDQUOT), and whether the last one tried
        was refused so (False again once a grow succeeds: the daemon's metric and warning)."""
        alloc = self.allocator(tier)
        if not isinstance(alloc, ExtentSlotAllocator):
            return 0, False
        return alloc.gate.no_space_refusals, alloc.gate.out_of_space

    def read(self, tier: Tier, slots: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks (``BlockIO.read``)."""
        return self.blocks.read(tier, slots)

    def write(self, tier: Tier, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """Overwrite the blocks at ``slots`` (``BlockIO.write``)."""
        self.blocks.write(tier, slots, blocks)

    def checksum(self, tier: Tier, slots: Sequence[int]) -> list[int]:
        """Checksums of the blocks' current bytes (``BlockIO.checksum``)."""
        return self.blocks.checksum(tier, slots)

    def verify(self, tier: Tier, slots: Sequence[int], checksums: Sequence[int]) -> list[bool]:
        """Per block: do its current bytes match ``checksums`` (``BlockIO.verify``)?"""
        return self.blocks.verify(tier, slots, checksums)

    def pool(self, tier: Tier) -> TensorPool | DiskPool:
        pool = self._pools.get(tier)  # Tier is an IntEnum: a plain int finds it too
        return pool if pool is not None else self._pools[self._present(tier)]

    @property
    def file_ids(self) -> dict[Tier, bytes]:
        return {t: p.file_id for t, p in self._pools.items() if p.file_id is not None}

    def descriptor(self, tier: Tier) -> dict:
        pool = self.pool(tier)
        if isinstance(pool, DiskPool):
            raise ValueError("the DISK tier is not mapped by clients; only DEVICE and HOST have descriptors")
        return pool.descriptor()

    # ----------------------------------------------------------------------------- movement
    def copy(self, src_tier: Tier, src_slots: Sequence[int], dst_tier: Tier, dst_slots: Sequence[int], *,
             verify: Sequence[int] | None = None, durable: bool = False, checksums: bool = True) -> CopyResult:
        """Copy blocks ``src_slots`` of one tier into ``dst_slots`` of another, as one batch
        (``TierCopier.copy``: the arguments, the result and what it raises)."""
        return self.copier.copy(src_tier, src_slots, dst_tier, dst_slots,
                                verify=verify, durable=durable, checksums=checksums)

    def copy_run(self, src_tier: Tier, src_slots: list[int], dst_tier: Tier, dst_slots: list[int]) -> bool:
        """``copy`` for one run of slots into one run in host memory (``TierCopier.copy_run``);
        False, with nothing copied, where it does not apply."""
        return self.copier.copy_run(src_tier, src_slots, dst_tier, dst_slots)

    @property
    def write_behind(self) -> bool:
        """True: copies from a memory tier into DISK return before their pwritev (see the class)."""
        return self.copier.write_behind

    @write_behind.setter
    def write_behind(self, value: bool) -> None:
        self.copier.write_behind = value

    def copy_async(self, src_tier: Tier, src_slots: Sequence[int], dst_tier: Tier, dst_slots: Sequence[int], *,
                   verify: Sequence[int] | None = None, durable: bool = False) -> Future:
        """``copy`` on the store's worker thread; copies run in submission order."""
        return self._async.submit(self.copy, src_tier, list(src_slots), dst_tier, list(dst_slots),
                                  verify=verify, durable=durable)

    def copy_within(self, tier: Tier, src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
        """Copy blocks inside one tier (copy-on-write; ``TierCopier.copy_within``).

        Raises:
            ValueError: overlapping or out-of-range slots.
        """
        self.copier.copy_within(tier, src_slots, dst_slots)

    def sync(self, tier: Tier) -> None:
        """Make written bytes durable: one fdatasync for DISK (queued writes included); nothing
        for shm or CUDA tiers. Raises StorageError if a write or the fdatasync failed."""
        self.sync_async(tier).result()

    def sync_async(self, tier: Tier) -> Future:
        """``sync`` on the disk sync thread: a Future resolved once every copy into DISK made
        before this call is durable (failed with the StorageError of a failed write or
        fdatasync). Waiters share fdatasyncs. Already done for a tier that needs none."""
        if isinstance(self.pool(tier), DiskPool):
            return self._writer.sync()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @property
    def disk_syncs(self) -> int:
        """fdatasyncs of the disk pool so far (for benchmarks and metrics)."""
        return self._writer.num_syncs if self._writer is not None else 0

    def _sync_disk(self) -> None:  # the disk sync thread
        if self._pools[Tier.DISK].sync():
            crash_point("disk_data_synced")

    # ----------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop the workers and release files and mappings; bytes stay in the files. Idempotent."""
        if getattr(self, "_helper", None) is not None:
            self._async.shutdown(wait=True)
            if self._writer is not None:
                self._writer.close()
            self._helper.shutdown(wait=True)
            self._helper = None
        self._close_pools()

    def __enter__(self) -> "TierStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_invariants(self) -> None:
        assert set(self._pools) == set(self._allocators)
        for tier, pool in self._pools.items():
            alloc = self._allocators[tier]
            assert alloc.num_slots == pool.num_blocks, f"{tier.name}: allocator and pool sizes differ"
            alloc.check_invariants()
            pool.check_invariants()
        if self._writer is not None:
            self._writer.check_invariants()
            self._spill_buffers.check_invariants()

    # ----------------------------------------------------------------------------- helpers
    def _present(self, tier: Tier) -> Tier:
        tier = Tier(tier)
        if tier not in self._pools:
            raise ValueError(f"tier {tier.name} is absent from pool {self.name} (configured with 0 blocks)")
        return tier

    def _check_range(self, tier: Tier, slots: Sequence[int], run_first: int | None = None) -> None:
        """Every slot is in the tier's range; ``run_first``: ``slots`` is known to be one run
        from there (``movement.run_start``), so its ends say it all."""
        n = self.pool(tier).num_blocks
        if not slots:
            return
        if run_first is not None:
            lo, hi = run_first, run_first + len(slots) - 1
        else:
            lo, hi = min(slots), max(slots)
        if lo < 0 or hi >= n:
            raise ValueError(f"{Tier(tier).name} slots must be in [0, {n}), got {lo}..{hi}")

    def _close_pools(self) -> None:
        for pool in getattr(self, "_pools", {}).values():
            pool.close()
