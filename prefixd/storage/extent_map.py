"""``ExtentMap``: which extents of a sparse pool file are allocated and how many slots in use
each one holds. Pure bookkeeping (no I/O): ``prefixd.storage.extents.SparsePoolFile`` does the
fallocate and the punch.

Extents are fixed byte ranges of the file, aligned to the file's start: extent ``k`` is
``[k * extent_bytes, (k + 1) * extent_bytes)``, the last one cut at the file's end. They do not
follow slot boundaries: a slot (``data_offset + s * block_bytes``, ``block_bytes`` long) may
straddle two extents, or span many when a block is larger than an extent. A slot in use keeps
every extent it touches allocated. Extent 0 holds the header and is always allocated.

NOTE: byte extents, not a whole number of blocks: a hole is punched in whole filesystem blocks
(a partial page at either end is zeroed instead, which would wipe a neighbour's bytes), and a
block count that is also page aligned can be huge (a 12,345-byte block needs 4,096 of them);
a fixed 2 MiB range aligned to the file is page- and huge-page-aligned for any block size.
"""

from __future__ import annotations

import numpy as np

PAGE = 4096


class ExtentMap:
    """Per extent: ``allocated`` (its blocks are held) and ``users`` (slots in use touching it).

    Invariants (``check_invariants``):
        * ``users[k] > 0`` implies ``allocated[k]`` (a slot is handed out only once every
          extent it touches is allocated);
        * extent 0 (the header) is always allocated;
        * ``held_bytes`` is the sum of ``charge(k)`` over allocated extents.
    """

    def __init__(self, data_offset: int, block_bytes: int, num_slots: int,
                 extent_bytes: int) -> None:
        """Raises ValueError: an extent that is not a whole number of pages, or bad sizes."""
        if extent_bytes <= 0 or extent_bytes % PAGE:
            raise ValueError(f"extent_bytes must be a positive multiple of {PAGE}, got "
                             f"{extent_bytes}")
        if block_bytes <= 0 or num_slots < 0 or data_offset < 0:
            raise ValueError(f"bad pool geometry: offset {data_offset}, block {block_bytes}, "
                             f"slots {num_slots}")
        self.data_offset = data_offset
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.extent_bytes = extent_bytes
        self.file_bytes = data_offset + block_bytes * num_slots
        self.num_extents = max(1, -(-self.file_bytes // extent_bytes))
        self.users = np.zeros(self.num_extents, dtype=np.int64)
        self.allocated = np.zeros(self.num_extents, dtype=bool)
        self.allocated[0] = True
        self.held_bytes = self.charge(0)

    # -- geometry -----------------------------------------------------------------------------

    def byte_range(self, k: int) -> tuple[int, int]:
        """``(offset, length)`` of extent ``k`` in the file."""
        start = k * self.extent_bytes
        return start, min(self.extent_bytes, self.file_bytes - start)

    def charge(self, k: int) -> int:
        """Bytes extent ``k`` takes once allocated (its length up to whole pages)."""
        return -(-self.byte_range(k)[1] // PAGE) * PAGE

    def _spans(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """First and last extent of each slot.

        Raises ValueError: a slot out of range."""
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        if s.size and (s.min() < 0 or s.max() >= self.num_slots):
            raise ValueError(f"slots must be in [0, {self.num_slots}), got {s.min()}..{s.max()}")
        start = self.data_offset + s * self.block_bytes
        return start // self.extent_bytes, (start + self.block_bytes - 1) // self.extent_bytes

    def extents_of(self, slots) -> np.ndarray:
        """The extents ``slots`` touch, ascending, each once."""
        first, last = self._spans(slots)
        if not first.size:
            return first
        if self.block_bytes <= self.extent_bytes:  # a slot touches one or two extents
            return np.unique(np.concatenate([first, last]))
        return np.unique(np.concatenate([np.arange(f, l + 1) for f, l in zip(first, last)]))

    def missing(self, slots) -> list[int]:
        """The extents ``slots`` touch that are not allocated, ascending."""
        ext = self.extents_of(slots)
        return ext[~self.allocated[ext]].tolist()

    def bytes_for(self, slots) -> int:
        """What holding every extent ``slots`` touch (and the header's) would charge."""
        ext = self.extents_of(slots)
        return sum(self.charge(k) for k in set(ext.tolist()) | {0})

    # -- state --------------------------------------------------------------------------------

    def mark_allocated(self, k: int) -> None:
        if not self.allocated[k]:
            self.allocated[k] = True
            self.held_bytes += self.charge(k)

    def require_idle(self, k: int) -> None:
        """Raises ValueError: the header's extent, or an extent with slots in use (a caller
        bug): checked before a punch, which cannot be undone."""
        if k == 0 or self.users[k]:
            raise ValueError(f"extent {k} cannot be punched: "
                             f"{'it holds the header' if k == 0 else f'{self.users[k]} slots use it'}")

    def mark_punched(self, k: int) -> None:
        """Raises ValueError: see ``require_idle``."""
        self.require_idle(k)
        if self.allocated[k]:
            self.allocated[k] = False
            self.held_bytes -= self.charge(k)

    def add_users(self, slots, delta: int = 1) -> None:
        """Count ``slots`` in use (``delta=-1``: no longer in use) in every extent they touch.

        Raises ValueError: a slot out of range."""
        first, last = self._spans(slots)
        if self.block_bytes <= self.extent_bytes:
            np.add.at(self.users, first, delta)
            two = last != first
            np.add.at(self.users, last[two], delta)
        else:
            for f, l in zip(first.tolist(), last.tolist()):
                self.users[f:l + 1] += delta

    def idle(self) -> list[int]:
        """Allocated extents (not the header's) that no slot in use touches, ascending."""
        idle = self.allocated & (self.users == 0)
        idle[0] = False
        return np.flatnonzero(idle).tolist()

    def check_invariants(self) -> None:
        assert self.allocated[0], "the header's extent is not allocated"
        assert (self.users >= 0).all(), "an extent's user count went negative"
        assert not (self.users > 0)[~self.allocated].any(), "a slot in use touches a hole"
        held = sum(self.charge(k) for k in np.flatnonzero(self.allocated).tolist())
        assert held == self.held_bytes, f"held bytes drifted: {self.held_bytes} != {held}"
