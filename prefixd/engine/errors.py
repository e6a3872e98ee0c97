"""Errors of the durable engine: what a state directory or a commit cannot do, and what to do."""

from __future__ import annotations

from prefixd.cache.errors import CacheError


class EngineError(CacheError):
    """Base of every error the engine raises on purpose (a ``CacheError``, so callers that
    catch the core's errors catch these too)."""


class DurabilityError(EngineError):
    """A commit could not be made as durable as asked (a lower tier has no room left)."""


class StateFormatError(EngineError):
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


class IndexLostError(EngineError):
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
