"""``ClusterWriter``: the cluster tier's write-behind queue and the one thread that drains it.

The engine thread ``offer``s blocks (their KV bytes already copied out of the pool); the
writer thread takes up to ``batch_blocks`` at a time and hands them to the cluster store's
pipelined ``put``. The queue is bounded in bytes: when an offer does not fit it is dropped
whole and counted (``dropped_blocks``), so the engine thread never waits for the cluster.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0


class ClusterWriter:
    """A bounded FIFO of ``ClusterBlock``s and the thread that writes them to ``store``.

    Args:
        store: has ``put(blocks) -> int`` (blocks written; it never raises on a cluster
            failure, but a raise is caught and counted too).
        batch_blocks: blocks per ``put``.
        queue_bytes: bound on the KV bytes waiting (``len(block.kv)`` summed).

    Invariants: ``queued_bytes`` is the sum of ``len(b.kv)`` over the queue and never exceeds
    ``queue_bytes``; ``offered == queued + written_or_failed + dropped`` once idle; after
    ``close`` the thread is gone and offers are dropped.

    NOTE: dropping the newest offer rather than the oldest queued block: either loses one
    write-behind (the blocks stay cached locally, the cluster just misses them), and refusing
    at the door costs no copy of the bytes (``fits`` is asked before the caller copies them).
    """

    def __init__(self, store, *, batch_blocks: int, queue_bytes: int) -> None:
        self.store = store
        self.batch_blocks = batch_blocks
        self.queue_bytes = queue_bytes
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self.queued_bytes = 0
        self._busy = 0  # blocks taken by the thread and not yet put
        self._closed = False
        self.offered_blocks = 0
        self.dropped_blocks = 0
        self.written_blocks = 0  # put() returned for them (the store counts what it really wrote)
        self.write_errors = 0    # put() raised
        self._thread = threading.Thread(target=self._run, name="prefixd-cluster-writer", daemon=True)
        self._thread.start()

    def fits(self, num_bytes: int) -> bool:
        """Whether ``num_bytes`` more would fit now (ask before copying the bytes out)."""
        return not self._closed and self.queued_bytes + num_bytes <= self.queue_bytes

    def offer(self, blocks: list) -> bool:
        """Queue ``blocks`` (in order) for the thread; False (and counted as dropped) when they
        do not fit or the writer is closed. Never waits."""
        size = sum(len(b.kv) for b in blocks)
        with self._cond:
            self.offered_blocks += len(blocks)
            if self._closed or self.queued_bytes + size > self.queue_bytes:
                self.dropped_blocks += len(blocks)
                return False
            self._queue.extend(blocks)
            self.queued_bytes += size
            self._cond.notify()
        return True

    def refuse(self, num_blocks: int) -> None:
        """Count ``num_blocks`` offered and dropped without queueing them (``fits`` said no)."""
        with self._cond:
            self.offered_blocks += num_blocks
            self.dropped_blocks += num_blocks

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every block offered so far was handed to the store (tests, benchmarks,
        shutdown); returns whether that happened within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Stop the thread after the batch it is writing; blocks still queued are dropped
        (counted): a cache's write-behind is not worth holding a shutdown for."""
        with self._cond:
            self._closed = True
            self.dropped_blocks += len(self._queue)
            self._queue.clear()
            self.queued_bytes = 0
            self._cond.notify_all()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("cluster writer still in a put after %.0f s; left behind", JOIN_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                n = min(self.batch_blocks, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
                self.queued_bytes -= sum(len(b.kv) for b in batch)
                self._busy = n
            try:
                self.store.put(batch)
                ok = True
            except Exception:  # noqa: BLE001 - a failed write-behind is a miss later, never an error
                log.exception("cluster put failed blocks=%d (dropped)", n)
                ok = False
            with self._cond:
                if ok:
                    self.written_blocks += n
                else:
                    self.write_errors += 1
                    self.dropped_blocks += n
                self._busy = 0
                self._cond.notify_all()

    def check_invariants(self) -> None:
        with self._cond:
            assert self.queued_bytes == sum(len(b.kv) for b in self._queue), "queued_bytes drifted"
            assert self.queued_bytes <= self.queue_bytes or self._closed
            if not self._closed:
                assert self._thread.is_alive(), "the cluster writer thread died"
            if not self._queue and not self._busy:
                assert self.offered_blocks == self.written_blocks + self.dropped_blocks, \
                    (self.offered_blocks, self.written_blocks, self.dropped_blocks)
