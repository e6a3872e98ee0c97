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
    """Per extent: whether it is allocated (its blocks are held) and how many slots in use
    touch it.

    Data structure: ``_users[k]`` (a list: slots in use touching extent ``k``),
    ``_allocated`` (a bytearray of 0/1), ``_idle`` (the set of allocated extents, not the
    header's, with no user: what ``shrink`` may punch), ``held_bytes``.

    Invariants (``check_invariants``):
        * ``_users[k] > 0`` implies ``_allocated[k]`` (a slot is handed out only once every
          extent it touches is allocated);
        * extent 0 (the header) is always allocated;
        * ``_idle`` is exactly the allocated extents but 0 with no user;
        * ``held_bytes`` is the sum of ``charge(k)`` over allocated extents.

    NOTE: plain lists, not numpy arrays: a request takes and frees a few slots at a time, and
    per-element numpy calls (``np.add.at``, ``np.unique``) cost ~100 us for 16 slots where the
    loop costs a few; whole-array numpy is used only for large inputs (recovery's slots).
    """

    _BULK = 4096  # slots at or above which a list goes through numpy (an array always does)

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
        self._users = [0] * self.num_extents
        self._allocated = bytearray(self.num_extents)
        self._allocated[0] = 1
        self._idle: set[int] = set()
        self.held_bytes = self.charge(0)

    # -- geometry -----------------------------------------------------------------------------

    def byte_range(self, k: int) -> tuple[int, int]:
        """``(offset, length)`` of extent ``k`` in the file."""
        start = k * self.extent_bytes
        return start, min(self.extent_bytes, self.file_bytes - start)

    def charge(self, k: int) -> int:
        """Bytes extent ``k`` takes once allocated (its length up to whole pages)."""
        return -(-self.byte_range(k)[1] // PAGE) * PAGE

    def extent_of(self, slot: int) -> int:
        """The extent slot ``slot``'s first byte is in. Raises ValueError: out of range."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        return (self.data_offset + slot * self.block_bytes) // self.extent_bytes

    def slots_of(self, k: int) -> range:
        """The slots that touch extent ``k``. Raises ValueError: out of range."""
        if not 0 <= k < self.num_extents:
            raise ValueError(f"extent must be in [0, {self.num_extents}), got {k}")
        start, length = self.byte_range(k)
        first = max(0, start - self.data_offset) // self.block_bytes
        last = -(-(start + length - self.data_offset) // self.block_bytes)
        return range(min(first, self.num_slots), max(0, min(last, self.num_slots)))

    def count_run(self, first: int, end: int, counts: dict[int, int]) -> None:
        """Add to ``counts`` (a ``touched``) the slots ``[first, end)`` by arithmetic, not by
        slot: a run of thousands costs what one extent does."""
        off, bb, ext = self.data_offset, self.block_bytes, self.extent_bytes
        for k in range((off + first * bb) // ext, (off + end * bb - 1) // ext + 1):
            lo = max(first, (k * ext - off) // bb) if k * ext > off else first
            hi = min(end, -(-((k + 1) * ext - off) // bb))
            if hi > lo:
                counts[k] = counts.get(k, 0) + hi - lo

    def straddler(self, k: int) -> int:
        """The slot that starts in extent ``k`` and ends in ``k + 1`` (-1: none)."""
        off, bb, ext = self.data_offset, self.block_bytes, self.extent_bytes
        end = (k + 1) * ext
        if end <= off:
            return -1
        s = (end - off - 1) // bb  # the slot holding the extent's last byte
        if s >= self.num_slots or off + (s + 1) * bb <= end or off + s * bb < k * ext:
            return -1
        return s

    def _check_range(self, slots: list[int]) -> None:
        if slots and (min(slots) < 0 or max(slots) >= self.num_slots):
            raise ValueError(f"slots must be in [0, {self.num_slots}), got "
                             f"{min(slots)}..{max(slots)}")

    def touched(self, slots) -> dict[int, int]:
        """extent -> how many of ``slots`` touch it (what ``add_users`` and ``missing`` take).

        Raises ValueError: a slot out of range."""
        if isinstance(slots, np.ndarray) or (isinstance(slots, list) and len(slots) >= self._BULK):
            arr = np.asarray(slots, dtype=np.int64).reshape(-1)
            if arr.size and (arr.min() < 0 or arr.max() >= self.num_slots):
                raise ValueError(f"slots must be in [0, {self.num_slots}), got "
                                 f"{arr.min()}..{arr.max()}")
            return self._touched_bulk(arr)
        slots = slots if isinstance(slots, list) else [int(s) for s in slots]
        self._check_range(slots)
        off, bb, ext = self.data_offset, self.block_bytes, self.extent_bytes
        counts: dict[int, int] = {}
        get = counts.get
        if bb > ext:
            for s in slots:
                start = off + s * bb
                for k in range(start // ext, (start + bb - 1) // ext + 1):
                    counts[k] = get(k, 0) + 1
            return counts
        for s in slots:  # one or two extents per slot
            start = off + s * bb
            first, last = start // ext, (start + bb - 1) // ext
            counts[first] = get(first, 0) + 1
            if last != first:
                counts[last] = get(last, 0) + 1
        return counts

    def _touched_bulk(self, s: np.ndarray) -> dict[int, int]:
        start = self.data_offset + s * self.block_bytes
        first = start // self.extent_bytes
        last = (start + self.block_bytes - 1) // self.extent_bytes
        if self.block_bytes <= self.extent_bytes:  # one or two extents per slot
            counts = np.bincount(first, minlength=self.num_extents)
            counts += np.bincount(last[last != first], minlength=self.num_extents)
        else:
            counts = np.zeros(self.num_extents + 1, dtype=np.int64)
            np.add.at(counts, first, 1)
            np.add.at(counts, last + 1, -1)
            counts = np.cumsum(counts)[:-1]
        nz = np.flatnonzero(counts)
        return dict(zip(nz.tolist(), counts[nz].tolist()))

    def extents_of(self, slots) -> list[int]:
        """The extents ``slots`` touch, ascending, each once."""
        return sorted(self.touched(slots))

    def missing(self, slots=None, touched: dict[int, int] | None = None) -> list[int]:
        """The extents ``slots`` (or a ``touched`` of them) touch that are not allocated,
        ascending."""
        allocated = self._allocated
        return sorted(k for k in (touched if touched is not None else self.touched(slots))
                      if not allocated[k])

    def bytes_for(self, slots) -> int:
        """What holding every extent ``slots`` touch (and the header's) would charge."""
        return sum(self.charge(k) for k in set(self.touched(slots)) | {0})

    # -- state --------------------------------------------------------------------------------

    def is_allocated(self, k: int) -> bool:
        return bool(self._allocated[k])

    def first_hole(self, k: int) -> int:
        """The lowest extent ``>= k`` that is not allocated (``num_extents`` if none)."""
        found = self._allocated.find(0, k)
        return self.num_extents if found < 0 else found

    def users_of(self, k: int) -> int:
        return self._users[k]

    def allocated_extents(self) -> list[int]:
        """Every allocated extent, ascending (the header's included)."""
        return [k for k, a in enumerate(self._allocated) if a]

    @property
    def num_users(self) -> int:
        """Slot-extent pairs in use (0: no slot in use)."""
        return sum(self._users)

    def mark_allocated(self, k: int) -> None:
        if not self._allocated[k]:
            self._allocated[k] = 1
            self.held_bytes += self.charge(k)
            if not self._users[k]:
                self._idle.add(k)

    def require_idle(self, k: int) -> None:
        """Raises ValueError: the header's extent, or an extent with slots in use (a caller
        bug): checked before a punch, which cannot be undone."""
        if k == 0 or self._users[k]:
            raise ValueError(f"extent {k} cannot be punched: "
                             f"{'it holds the header' if k == 0 else f'{self._users[k]} slots use it'}")

    def mark_punched(self, k: int) -> None:
        """Raises ValueError: see ``require_idle``."""
        self.require_idle(k)
        if self._allocated[k]:
            self._allocated[k] = 0
            self.held_bytes -= self.charge(k)
            self._idle.discard(k)

    def add_users(self, slots=None, delta: int = 1, touched: dict[int, int] | None = None) -> None:
        """Count ``slots`` in use (``delta=-1``: no longer in use) in every extent they touch;
        ``touched`` (from ``touched(slots)``) instead of ``slots`` spares a second pass.

        Raises ValueError: a slot out of range (nothing counted)."""
        users, idle = self._users, self._idle
        for k, n in (touched if touched is not None else self.touched(slots)).items():
            before = users[k]
            users[k] = after = before + delta * n
            if after and not before:
                idle.discard(k)
            elif before and not after and k and self._allocated[k]:
                idle.add(k)

    def add_users_of(self, k: int, n: int) -> None:
        """``add_users`` for ``n`` slots (``n < 0``: no longer in use) that touch extent ``k``
        alone: the common batch, without building a ``touched``."""
        users = self._users
        before = users[k]
        users[k] = after = before + n
        if after and not before:
            self._idle.discard(k)
        elif before and not after and k and self._allocated[k]:
            self._idle.add(k)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def idle(self) -> list[int]:
        """Allocated extents (not the header's) that no slot in use touches, ascending."""
        return sorted(self._idle)

    def check_invariants(self) -> None:
        users, allocated = self._users, self._allocated
        assert allocated[0], "the header's extent is not allocated"
        assert min(users) >= 0, "an extent's user count went negative"
        assert not any(u and not a for u, a in zip(users, allocated)), \
            "a slot in use touches a hole"
        idle = {k for k in range(1, self.num_extents) if allocated[k] and not users[k]}
        assert idle == self._idle, f"idle set drifted: {sorted(idle ^ self._idle)[:8]}"
        held = sum(self.charge(k) for k in self.allocated_extents())
        assert held == self.held_bytes, f"held bytes drifted: {self.held_bytes} != {held}"
