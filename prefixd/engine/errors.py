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


class UnknownTenantError(EngineError, KeyError):
    """A pool was asked for a tenant the engine's configuration does not list."""

    def __init__(self, tenant: str, known: list[str]) -> None:
        self.tenant = tenant
        self.known = known
        super().__init__(f"unknown tenant {tenant!r}: the configured tenants are "
                         f"{', '.join(repr(k) for k in known)}; add it under [[engine.tenants]]")

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PoolDirError(EngineError):
    """A pool directory under ``<state_dir>/pools`` cannot be opened as the pool it claims to
    be (its manifest is missing, damaged, or disagrees with its place or the configuration).
    Nothing was changed; the message says what to restore or remove."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"pool directory {path}: {reason}")


class TierLostError(EngineError):
    """A pool file that the index names blocks in is gone (deleted or moved away while the
    daemon was down): those blocks cannot be served. Nothing is started, so nothing is lost
    silently; the operator chooses between putting the file back and forgetting the blocks."""

    def __init__(self, state_dir: str, path: str, num_blocks: int) -> None:
        self.state_dir = state_dir
        self.path = path
        self.num_blocks = num_blocks
        super().__init__(
            f"state directory {state_dir}: pool file {path} is missing but the index names "
            f"{num_blocks} block(s) in it; put the file back, or start with forget_missing_tier=True "
            f"(--forget-missing-tier) to drop those blocks from the index and start with an empty tier"
        )


class SharedBlockError(EngineError, ValueError):
    """A KV write reached a block the sequence does not own alone: an indexed (committed) block,
    which every prompt with this prefix may be reading, or a partial last block still shared
    with forked siblings. Nothing was written; the message says which tokens may be written."""
