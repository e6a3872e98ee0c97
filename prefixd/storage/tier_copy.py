"""Copies between the tiers of a ``TierStore``, and the write-behind path into DISK.

``TierCopier`` is the part of ``prefixd.storage.tier_store.TierStore`` that moves blocks from
one slot list to another: between memory tiers (``movement.copy_tensors``, or one ``copyto``
for a run into a run), from DISK (checked reads through the staging buffer), into DISK
(``movement.write_to_disk``), and, with ``write_behind``, into DISK behind the caller: the
source rows are snapshotted into a ``SpillBuffers`` buffer and hashed on the calling thread,
and the store's ``DiskWriter`` pwritevs them in order. It holds the store's pools (the same
dict), its pool lookup and range check, and the store's writer, staging buffer, helper threads
and spill buffers.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from prefixd.api.tiers import DEVICE, DISK, Tier
from prefixd.storage import checksum, movement
from prefixd.storage.block_io import host_rows, row_slots
from prefixd.storage.movement import CopyResult
from prefixd.storage.pools import DiskPool, TensorPool
from prefixd.storage.spill_buffers import SpillBuffers


class TierCopier:
    """Moves blocks between the slots of a store's tiers (see the module docstring).

    Thread safety: as ``TierStore``: copies may run on several threads at once provided no
    two touch the same slot.
    """

    def __init__(self, pools, pool, check_range, writer, staging, helper, spill_buffers) -> None:
        self._pools = pools  # the store's ``Tier -> TensorPool | DiskPool`` (shared, not copied)
        self.pool = pool  # the store's lookup by tier (refuses an absent one)
        self._check_range = check_range  # the store's range check (``TierStore._check_range``)
        self._writer = writer  # the store's ``DiskWriter``, None without DISK
        self._staging = staging
        self._helper = helper
        self._spill_buffers = spill_buffers
        self.write_behind = False  # the durable engine sets it once recovered

    def copy(self, src_tier: Tier, src_slots: Sequence[int], dst_tier: Tier, dst_slots: Sequence[int], *,
             verify: Sequence[int] | None = None, durable: bool = False, checksums: bool = True) -> CopyResult:
        """Copy blocks ``src_slots`` of one tier into ``dst_slots`` of another, as one batch.

        Args:
            verify: expected checksums, one per block, when the source is DISK; a block that
                does not match is reported ``ok=False`` and its bytes are not written.
            durable: when the destination is DISK, fdatasync before returning.
            checksums: ``False``: a copy between memory tiers does not hash what it wrote
                (``CopyResult.checksums`` is None); a copy into or out of DISK always does.
        Returns:
            CopyResult (see the module docstring).
        Raises:
            ValueError: unequal lengths, slots out of range, ``verify`` with a non-DISK source.
            StorageError: an I/O error, naming the file and offset.
        """
        # NOTE: the tiers are compared with the plain ints ``DEVICE``/``DISK`` on this path:
        # ``Tier.DISK`` is a lookup through the enum metaclass's ``__getattr__`` on Python
        # 3.11 (~1 us), and a request's commit copies several times.
        src_slots, dst_slots = list(src_slots), list(dst_slots)
        src, dst = self.pool(src_tier), self.pool(dst_tier)
        _check_count(src_slots, dst_slots)
        if verify is not None and src_tier != DISK:
            raise ValueError("verify= is for copies from DISK; memory tiers are not re-checked")
        if not src_slots:
            return CopyResult([] if dst_tier != DEVICE else None, [] if verify is not None else None)
        self._check_range(src_tier, src_slots)
        # a destination that is one run (a write-down's fresh allocation mostly is) is checked
        # by its ends, and copied into as a slice (``movement._gather_inline``)
        dst_first = movement.run_start(dst_slots)
        self._check_range(dst_tier, dst_slots, dst_first)
        if isinstance(dst, DiskPool) and not isinstance(src, DiskPool) and self.write_behind:
            return self._write_behind(src, src_slots, dst, dst_slots, durable)
        if self._writer is not None and (isinstance(src, DiskPool) or isinstance(dst, DiskPool)):
            self._writer.wait_written()
        if isinstance(src, DiskPool):
            target = dst if isinstance(dst, DiskPool) else dst.raw
            result = movement.read_from_disk(src, src_slots, target, dst_slots, verify, self._staging, self._helper)
        elif isinstance(dst, DiskPool):
            result = movement.write_to_disk(host_rows(src, src_slots), row_slots(src, src_slots),
                                            dst, dst_slots, self._helper)
        else:
            result = movement.copy_tensors(src, src_slots, dst, dst_slots, self._helper,
                                           want_checksums=checksums and dst_tier != DEVICE,
                                           dst_first=-1 if dst_first is None else dst_first)
        if durable and dst_tier == DISK:
            self._writer.sync().result()
        return result

    def copy_run(self, src_tier: Tier, src_slots: list[int], dst_tier: Tier, dst_slots: list[int]) -> bool:
        """``copy`` for one run of slots into one run, both tiers in host memory (a commit's
        write-through: fresh device slots into fresh host slots): one ``copyto``, no checksums.
        False, with nothing copied, when either side is not one ascending run, or a tier is
        DISK or CUDA (``copy`` moves those).

        Raises ValueError: unequal lengths, or a run out of its tier's range.

        NOTE: ``copy``'s general path (list copies, per-call checks, the checksum and writer
        decisions, the gather's own run tests) is most of a small commit's write-through; a
        run to a run needs none of it."""
        src_rows = getattr(self._pools.get(src_tier), "rows", None)  # a DiskPool has none,
        dst_rows = getattr(self._pools.get(dst_tier), "rows", None)  # a CUDA pool None
        if src_rows is None or dst_rows is None or not src_slots:
            return False
        _check_count(src_slots, dst_slots)
        s0, d0 = movement.run_start(src_slots), movement.run_start(dst_slots)
        if s0 is None or d0 is None:
            return False
        n = len(src_slots)
        self._check_range(src_tier, src_slots, s0)
        self._check_range(dst_tier, dst_slots, d0)
        np.copyto(dst_rows[d0:d0 + n], src_rows[s0:s0 + n])
        return True

    def _write_behind(self, src: TensorPool, src_slots: list[int], disk: DiskPool, dst_slots: list[int],
                      durable: bool) -> CopyResult:
        """Snapshot and hash the source rows here; the writer thread pwritevs them."""
        n = len(src_slots)
        if src.rows is not None:  # one gather into a reused buffer: the snapshot
            rows = self._spill_buffers.take(src.rows, src_slots)
            job = functools.partial(_write_then_give_back, self._spill_buffers, rows, disk, dst_slots)
        else:  # pragma: no cover - a GPU source; host_rows is already a copy
            rows = host_rows(src, src_slots)
            job = functools.partial(movement.write_to_disk, rows, range(n), disk, dst_slots, None, False)
        sums = checksum.checksum_rows(rows, range(n))
        self._writer.submit(job, n * disk.block_bytes)
        if durable:
            self._writer.sync().result()
        return CopyResult(sums, None)

    def copy_within(self, tier: Tier, src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
        """Copy blocks inside one tier (copy-on-write). Source and destination slots must be disjoint.

        Raises:
            ValueError: overlapping or out-of-range slots.
        """
        if set(src_slots) & set(dst_slots):
            raise ValueError("copy_within: source and destination slots overlap")
        pool = self.pool(tier)
        if isinstance(pool, DiskPool):
            self.copy(tier, src_slots, tier, dst_slots)  # waits for queued writes
            return
        src_slots, dst_slots = list(src_slots), list(dst_slots)
        _check_count(src_slots, dst_slots)
        self._check_range(tier, src_slots)
        self._check_range(tier, dst_slots)
        movement.copy_rows(pool.tensor, src_slots, pool.tensor, dst_slots)


def _write_then_give_back(buffers: SpillBuffers, rows, disk: DiskPool, dst_slots: list[int]) -> None:
    """The writer thread's job for a snapshot in a ``SpillBuffers`` buffer: write, then hand
    the buffer back (not on failure: the writer is failed for good and the buffer just goes)."""
    movement.write_to_disk(rows, range(len(dst_slots)), disk, dst_slots, None, False)
    buffers.give_back(rows)


def _check_count(src_slots: list, dst_slots: list) -> None:
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"copy needs as many destination slots as source slots: {len(src_slots)} != {len(dst_slots)}")
