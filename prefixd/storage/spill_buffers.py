"""Reusable staging buffers for the disk write-behind's snapshots (``SpillBuffers``).

A copy from a memory tier into DISK under write-behind snapshots the source rows on the calling
thread (the source slots may be reused as soon as the copy returns) and hands the snapshot to the
disk writer thread, which ``pwritev``s it and is then done with it. ``numpy.take`` into a fresh
array paid a page fault per 4 KiB page of every snapshot (a fresh large allocation is a new
mapping: the kernel zeroes each page on first touch), several times the cost of the gather
itself. These buffers are touched once and reused, so a spill costs the gather's memcpy only.

NOTE: more than one buffer, because the writer may still hold the last snapshot while the next
spill fills another (the writer accepts up to ``MAX_PENDING_BYTES`` queued); a buffer is handed
back by the writer job once its ``pwritev`` returned. Idle buffers are kept up to ``keep_bytes``
in all; a snapshot larger than that is allocated and dropped as before (a very large block
layout must not pin gigabytes of idle memory).
"""

from __future__ import annotations

import threading

import numpy as np

KEEP_BYTES = 192 << 20  # idle staging memory kept per disk pool (two 256-block SmolLM2 spills)


class SpillBuffers:
    """A small free list of 2-D uint8 arrays, one row a block, shared by two threads.

    Args:
        block_bytes: the row length.
        keep_bytes: the most idle buffer memory kept for reuse.

    Invariants (under ``_lock``): every idle buffer has ``block_bytes`` columns; the idle
    buffers' bytes sum to at most ``keep_bytes``; a buffer is idle or lent, never both.
    """

    def __init__(self, block_bytes: int, keep_bytes: int = KEEP_BYTES) -> None:
        self.block_bytes = block_bytes
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._idle: list[np.ndarray] = []  # guarded by _lock
        self.num_allocated = 0  # buffers created (for tests: reuse means this stops growing)

    def take(self, rows: np.ndarray, slots) -> np.ndarray:
        """A snapshot of ``rows[slots]`` (``[len(slots), block_bytes]``) in a lent buffer; give
        the returned array's ``base`` back with ``give_back`` once it is no longer read."""
        n = len(slots)
        buf = self._lend(n)
        out = buf[:n]
        np.take(rows, slots, axis=0, out=out, mode="clip")  # NOTE: mode='raise' buffers
        # ``out`` (a hidden fresh temporary, the very cost this avoids); callers checked the slots
        return out

    def give_back(self, snapshot: np.ndarray) -> None:
        """Return the buffer behind a ``take`` snapshot (called once, by the last reader)."""
        buf = snapshot.base if snapshot.base is not None else snapshot
        with self._lock:
            if buf.nbytes + sum(b.nbytes for b in self._idle) <= self.keep_bytes:
                self._idle.append(buf)

    def _lend(self, n: int) -> np.ndarray:
        with self._lock:
            # the smallest idle buffer that fits, by position (``list.remove`` compares arrays
            # with ``==``); NOTE: ``len`` and a plain loop, not ``min(key=...)`` over
            # ``shape[0]``: with small blocks a spill lends one buffer per run, dozens sit
            # idle, and a key call per buffer per lend shows in every commit
            idle = self._idle
            best, best_rows = -1, 0
            for i, b in enumerate(idle):
                rows = len(b)
                if rows >= n and (best < 0 or rows < best_rows):
                    best, best_rows = i, rows
                    if rows == n:
                        break
            if best >= 0:
                return idle.pop(best)
            if self._idle and n * self.block_bytes > self.keep_bytes // 2:
                self._idle.clear()  # too small to serve this size: make room for one that is
        self.num_allocated += 1
        return np.empty((n, self.block_bytes), dtype=np.uint8)

    def check_invariants(self) -> None:
        with self._lock:
            assert sum(b.nbytes for b in self._idle) <= self.keep_bytes
            assert all(b.ndim == 2 and b.shape[1] == self.block_bytes for b in self._idle)
            assert len({id(b) for b in self._idle}) == len(self._idle)
