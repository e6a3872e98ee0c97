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
        if available >= needed:  # the slots exist, the bytes for them do not: a refused grow
            message = (f"device tier full: need {needed} blocks and {available} are free or "
                       f"evictable, but the device budget had no room to place them (freed "
                       f"slots come back once their log record is durable); retry, or raise "
                       f"[engine.budget] device")
        else:
            message = (f"device pool exhausted: need {needed} blocks, {available} can be freed "
                       f"({needed - available} short); release or preempt sequences, or grow "
                       f"the pool")
        super().__init__(message)


class UnknownSequence(CacheError):
    """No live sequence has this id (never opened, released, or lost in a restart)."""

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        super().__init__(f"unknown sequence {seq_id}: open it (again) first")


class InvalidTokens(CacheError, ValueError):
    """Token ids that cannot be cached (empty, wrong type, out of range)."""
