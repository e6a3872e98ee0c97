"""Errors of the cache core; the daemon maps each to one gRPC status."""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error the cache core raises on purpose."""


class OutOfBlocks(CacheError):
    """Every device block is referenced: the request needs more than can be freed.

    The daemon answers RESOURCE_EXHAUSTED; the engine queues or preempts. Nothing already
    granted was taken away.
    """

    def __init__(self, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(
            f"device pool exhausted: need {needed} blocks, {available} can be freed "
            f"({needed - available} short); release or preempt sequences, or grow the pool"
        )


class UnknownSequence(CacheError):
    """No live sequence has this id (never opened, released, or lost in a restart)."""

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        super().__init__(f"unknown sequence {seq_id}: open it (again) first")


class InvalidTokens(CacheError, ValueError):
    """Token ids that cannot be cached (empty, wrong type, out of range)."""


class StateFormatError(CacheError):
    """The state directory was written with record or checkpoint layouts this build does not
    read. Nothing was changed; run the prefixd that wrote it, or move the directory aside."""

    def __init__(self, state_dir: str, saved: object, expected: int) -> None:
        self.state_dir = state_dir
        self.saved = saved
        self.expected = expected
        super().__init__(
            f"state directory {state_dir} holds cache records of format {saved}, this build "
            f"reads format {expected}: start the prefixd version that wrote it, or move the "
            f"directory aside to start a new cache"
        )


class IndexLostError(CacheError):
    """The state directory holds a disk pool but its log and checkpoint are gone (``data.mdb``
    deleted or truncated): the blocks in the pool can no longer be named. Starting a new cache
    would leave the pool on disk unseen, so nothing is started."""

    def __init__(self, state_dir: str, pools: list[str]) -> None:
        self.state_dir = state_dir
        self.pools = pools
        super().__init__(
            f"state directory {state_dir} has disk pool(s) {', '.join(pools)} but no index for them "
            f"(the write-ahead log is empty: data.mdb was deleted or truncated); their blocks "
            f"cannot be recovered. Delete or move the pool file(s) to start a new cache there"
        )
