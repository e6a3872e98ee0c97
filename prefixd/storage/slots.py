"""Slot allocators: which fixed-size slots of one tier are free.

A slot is the index of one block-sized chunk of a tier's pool. The allocator only counts; it
never touches bytes.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class SlotAllocator:
    """The free slots of one tier, as a stack.

    ``allocate(n)`` hands out the ``n`` slots on top of the stack, in ascending order on a fresh
    allocator (slot 0 first); ``free(slots)`` pushes them back so that the next ``allocate`` of
    the same size returns the same slots in the same order (recently freed slots are reused first:
    their lines are still warm).

    A slot freed while a durable record may still name it goes to ``defer_free`` instead: it sits
    in quarantine (free before reuse). Quarantined slots are kept in batches: ``seal_deferred(mark)``
    closes the open batch with a mark that ascends (the engine's position of the last record that
    freed them), and ``release_deferred(upto)`` makes every sealed batch with ``mark <= upto``
    allocatable, oldest first; ``release_all_deferred()`` releases everything (the log was forced).

    Invariants (``check_invariants``):
        * every slot in ``[0, num_slots)`` is in exactly one of: free, deferred, used;
        * ``num_free + num_deferred + num_used == num_slots``;
        * slots ``>= _fresh`` were never handed out; they are free and sit at the bottom of the
          stack (below ``_free``), lowest first;
        * sealed batches' marks ascend; ``num_deferred`` counts the sealed and the open batch.

    NOTE: the never-used slots are a bound, not a list: a million-slot disk tier would
    otherwise build a million ints at start, a tenth of a large recovery, to throw most of
    them away when the saved index takes its slots.

    NOTE: double frees are not detected on the hot path (that would cost a set lookup per slot);
    ``check_invariants`` finds them, and the cache core's own invariants find the owner.
    """

    __slots__ = ("num_slots", "_free", "_fresh", "_deferred", "_sealed", "_num_sealed")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = []  # freed slots, top of the stack last
        self._fresh = 0  # slots [_fresh, num_slots) were never handed out
        self._deferred: list[int] = []  # the open batch: not yet sealed
        self._sealed: deque[tuple[int, list[int]]] = deque()  # (mark, slots), marks ascending
        self._num_sealed = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_slots - self._fresh

    @property
    def num_deferred(self) -> int:
        return len(self._deferred) + self._num_sealed

    @property
    def num_used(self) -> int:
        return self._fresh - len(self._free) - self.num_deferred

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) + self.num_slots - self._fresh

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free slots; ``None`` (and nothing taken) when fewer are free."""
        free = self._free
        if n > len(free):
            return self._allocate_fresh(n)
        if n == 0:
            return []
        out = free[-n:]
        del free[-n:]
        out.reverse()
        return out

    def _allocate_fresh(self, n: int) -> list[int] | None:
        """``allocate`` once the freed slots run out: all of them, then never-used ones."""
        free = self._free
        extra = n - len(free)
        if extra > self.num_slots - self._fresh:
            return None
        out = free[::-1]
        free.clear()
        out += range(self._fresh, self._fresh + extra)
        self._fresh += extra
        return out

    def free(self, slots: list[int]) -> None:
        """Return slots no durable record names; they are allocatable at once."""
        self._free.extend(reversed(slots))

    def defer_free(self, slots: list[int]) -> None:
        """Return slots that a durable record may still name; see ``release_all_deferred``."""
        self._deferred.extend(slots)

    def seal_deferred(self, mark: int) -> None:
        """Close the open quarantine batch: its slots wait until ``release_deferred(upto >= mark)``.

        Raises:
            ValueError: ``mark`` is below the last sealed batch's (marks must ascend).
        """
        if not self._deferred:
            return
        sealed = self._sealed
        if sealed and mark < sealed[-1][0]:
            raise ValueError(f"quarantine marks must ascend: {mark} after {sealed[-1][0]}")
        sealed.append((mark, self._deferred))
        self._num_sealed += len(self._deferred)
        self._deferred = []

    def next_deferred_mark(self) -> int | None:
        """The mark of the oldest sealed batch (``None`` if none): the cheap watermark check."""
        return self._sealed[0][0] if self._sealed else None

    def release_deferred(self, upto: int) -> int:
        """Make every sealed batch with ``mark <= upto`` allocatable; returns how many slots."""
        sealed, free, n = self._sealed, self._free, 0
        while sealed and sealed[0][0] <= upto:
            slots = sealed.popleft()[1]
            free.extend(reversed(slots))
            n += len(slots)
        self._num_sealed -= n
        return n

    def release_all_deferred(self) -> int:
        """Make every quarantined slot allocatable, sealed or not; returns how many."""
        n = self.num_deferred
        for _, slots in self._sealed:
            self._free.extend(reversed(slots))
        self._sealed.clear()
        self._num_sealed = 0
        if self._deferred:
            self._free.extend(reversed(self._deferred))
            self._deferred = []
        return n

    def take(self, slots) -> None:
        """Mark specific slots used (recovery rebuilds the free list from block tables).

        Whole-array operations: recovery takes a million slots at once.

        Raises:
            ValueError: if a slot is out of range, not free, or given twice.
        """
        wanted = np.asarray(slots, dtype=np.int64)
        if not wanted.size:
            return
        if wanted.min() < 0 or wanted.max() >= self.num_slots:
            bad = wanted[(wanted < 0) | (wanted >= self.num_slots)]
            raise ValueError(f"slots out of range [0, {self.num_slots}): {sorted(bad.tolist())[:8]}")
        if np.bincount(wanted, minlength=self.num_slots).max() > 1:
            raise ValueError("a slot to take is given twice")
        # the stack, bottom to top: never-used slots (highest first), then the freed ones
        stack = np.concatenate([np.arange(self.num_slots - 1, self._fresh - 1, -1, dtype=np.int64),
                                np.asarray(self._free, dtype=np.int64)])
        is_free = np.zeros(self.num_slots, dtype=bool)
        is_free[stack] = True
        if not is_free[wanted].all():
            raise ValueError("some slots to take are not free")
        is_free[wanted] = False
        self._free = stack[is_free[stack]].tolist()  # the rest keep their order
        self._fresh = self.num_slots

    def used_slots(self) -> set[int]:
        return set(range(self._fresh)) - set(self._free) - set(self._all_deferred())

    def _all_deferred(self) -> list[int]:
        return [s for _, slots in self._sealed for s in slots] + self._deferred

    def check_invariants(self) -> None:
        free, deferred = self._free, self._all_deferred()
        marks = [m for m, _ in self._sealed]
        assert marks == sorted(marks), "quarantine marks out of order"
        assert self._num_sealed == sum(len(s) for _, s in self._sealed), "sealed count drifted"
        both = free + deferred
        assert len(set(both)) == len(both), "a slot is free or deferred twice"
        assert all(0 <= s < self._fresh for s in both), "a free slot is out of range or never used"
        assert 0 <= self._fresh <= self.num_slots, "the never-used bound is out of range"
        assert self.num_free + self.num_deferred + self.num_used == self.num_slots
