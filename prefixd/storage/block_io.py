"""The bytes in and out of a ``TierStore`` by slot: ``read``, ``write``, ``checksum``, ``verify``.

A part of ``TierStore`` (tier_store.py), apart from the movement between tiers: what tests,
the engine's KV path and recovery's checks use to see or set a block's bytes. The store hands
it what it needs: the layout, how to find a tier's pool and check slots, and, for DISK, its
writer, staging buffer and helper threads.
"""

from __future__ import annotations

from typing import Sequence

import torch

from prefixd.api.tiers import Tier
from prefixd.storage import checksum, movement
from prefixd.storage.pools import DiskPool, TensorPool


class BlockIO:
    """Slot-addressed reads, writes and checksums of one store's pools (see the module).

    Args:
        layout: the store's ``KVLayout``.
        pool: ``pool(tier)``: the store's pool of a tier. check_range: ``check_range(tier,
            slots)``: raises ValueError unless every slot is in the tier's range.
        writer, staging, helper: the store's ``DiskWriter``, ``Staging`` (None without a DISK
            tier) and helper thread pool; a DISK access first waits for the writes queued
            before it.

    Holds no state of its own beyond these.
    """

    def __init__(self, layout, pool, check_range, writer, staging, helper) -> None:
        self.layout = layout
        self.pool = pool
        self._check_range = check_range
        self._writer = writer
        self._staging = staging
        self._helper = helper

    def read(self, tier: Tier, slots: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks, ``[n, *layout.block_shape]``. DISK bytes are returned unchecked."""
        slots = list(slots)
        self._check_range(tier, slots)
        pool = self.pool(tier)
        if isinstance(pool, DiskPool):
            self._writer.wait_written()
            out = torch.empty(len(slots), self.layout.block_bytes, dtype=torch.uint8)
            movement.read_from_disk(pool, slots, out, list(range(len(slots))), None, self._staging, self._helper)
            return out.view(self.layout.torch_dtype()).view(self.layout.pool_shape(len(slots)))
        return pool.tensor.index_select(0, torch.tensor(slots, dtype=torch.long, device=pool.tensor.device))

    def write(self, tier: Tier, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """Overwrite the blocks at ``slots`` with ``blocks`` (``[n, *layout.block_shape]``).

        Raises:
            ValueError: wrong shape or dtype, slots out of range.
        """
        slots = list(slots)
        self._check_range(tier, slots)
        want = self.layout.pool_shape(len(slots))
        if tuple(blocks.shape) != want or blocks.dtype != self.layout.torch_dtype():
            raise ValueError(f"write expects {want} of {self.layout.dtype}, got {tuple(blocks.shape)} {blocks.dtype}")
        pool = self.pool(tier)
        if isinstance(pool, DiskPool):
            self._writer.wait_written()  # keeps writes to one slot in call order
            rows = blocks.contiguous().cpu().view(len(slots), -1).view(torch.uint8).numpy()
            movement.write_to_disk(rows, list(range(len(slots))), pool, slots, self._helper)
        else:
            src = blocks.to(pool.tensor.device).contiguous()
            movement.copy_rows(src, list(range(len(slots))), pool.tensor, slots)

    def checksum(self, tier: Tier, slots: Sequence[int]) -> list[int]:
        """Checksums of the blocks' current bytes (for DISK, as read from the file)."""
        slots = list(slots)
        self._check_range(tier, slots)
        pool = self.pool(tier)
        if isinstance(pool, DiskPool):
            self._writer.wait_written()
            return movement.read_from_disk(pool, slots, None, slots, None, self._staging, self._helper).checksums
        rows = host_rows(pool, slots)
        return checksum.checksum_rows(rows, row_slots(pool, slots))

    def verify(self, tier: Tier, slots: Sequence[int], checksums: Sequence[int]) -> list[bool]:
        """Per-block: do the blocks' current bytes match ``checksums``?"""
        return checksum.compare(self.checksum(tier, slots), checksums)


def host_rows(pool: TensorPool, slots: list):
    """The rows of ``slots`` as host memory: the pool's own mapping when it has one (a host or
    CPU pool), else a copy (a GPU pool; then indexed ``0 .. len(slots)``: ``row_slots``)."""
    if pool.rows is not None:
        return pool.rows
    idx = torch.tensor(slots, dtype=torch.long, device=pool.tensor.device)  # pragma: no cover - GPU
    return pool.raw.index_select(0, idx).cpu().numpy()  # pragma: no cover - GPU


def row_slots(pool: TensorPool, slots: list) -> list[int]:
    """Where ``slots`` are in ``host_rows(pool, slots)``."""
    return slots if pool.rows is not None else list(range(len(slots)))
