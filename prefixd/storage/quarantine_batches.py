"""``QuarantineBatches``: slots freed while a durable record may still name them, in batches
that become allocatable by mark (free before reuse; see ``SlotAllocator``'s docstring, whose
quarantine this is, for an allocator that holds it as a part)."""

from __future__ import annotations

from collections import deque


class QuarantineBatches:
    """The open batch (``_open``) and the sealed ones (``_sealed``: (mark, slots), marks
    ascending).

    Invariants (``check_invariants``): marks ascend; ``num_sealed`` counts the sealed slots.
    """

    def __init__(self) -> None:
        self._open: list[int] = []
        self._sealed: deque[tuple[int, list[int]]] = deque()
        self.num_sealed = 0

    def __len__(self) -> int:
        return len(self._open) + self.num_sealed

    def add(self, slots: list[int]) -> None:
        self._open.extend(slots)

    def seal(self, mark: int) -> None:
        """Close the open batch under ``mark``.

        Raises ValueError: ``mark`` below the last sealed batch's (marks must ascend)."""
        if not self._open:
            return
        if self._sealed and mark < self._sealed[-1][0]:
            raise ValueError(f"quarantine marks must ascend: {mark} after {self._sealed[-1][0]}")
        self._sealed.append((mark, self._open))
        self.num_sealed += len(self._open)
        self._open = []

    def next_mark(self) -> int | None:
        """The mark of the oldest sealed batch (``None`` if none)."""
        return self._sealed[0][0] if self._sealed else None

    def release(self, upto: int) -> list[int]:
        """Take out every sealed batch with ``mark <= upto``; returns their slots, oldest first."""
        released: list[int] = []
        while self._sealed and self._sealed[0][0] <= upto:
            released += self._sealed.popleft()[1]
        self.num_sealed -= len(released)
        return released

    def release_all(self) -> list[int]:
        """Take out every slot, sealed or not."""
        released = self.slots()
        self._sealed.clear()
        self.num_sealed = 0
        self._open = []
        return released

    def slots(self) -> list[int]:
        return [s for _, batch in self._sealed for s in batch] + self._open

    def check_invariants(self) -> None:
        marks = [m for m, _ in self._sealed]
        assert marks == sorted(marks), "quarantine marks out of order"
        assert self.num_sealed == sum(len(b) for _, b in self._sealed), "sealed count drifted"
