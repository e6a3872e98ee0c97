"""How far a recovery has got, readable from another thread (the daemon's Status and
sd_notify ``STATUS=`` lines) while the engine opens on a worker thread."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class RecoveryProgress:
    """Log records replayed so far and to replay, summed over every pool an engine opens.

    Written by the recovering thread only; another thread reads the two ints (each read is
    atomic under the GIL; a reader may see ``replayed`` of one pool with ``total`` of the
    next, which only makes the fraction briefly conservative).

    Invariants: ``0 <= replayed``; ``replayed <= total`` once every pool has begun.
    """

    def __init__(self) -> None:
        self.replayed = 0
        self.total = 0
        self.pools = 0

    def begin(self, records: int) -> None:
        """A pool's replay starts: ``records`` more to replay (its log tail)."""
        self.total += max(records, 0)
        self.pools += 1

    def counting(self, batches: Iterable[tuple[int, list]]) -> Iterator[tuple[int, list]]:
        """``batches`` unchanged, counting their records once each is handed over."""
        for batch in batches:
            yield batch
            self.replayed += len(batch[1])

    def as_tuple(self) -> tuple[int, int]:
        return self.replayed, self.total
