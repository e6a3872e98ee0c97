"""Typed events: every change the cache core makes, in order, for the WAL to log.

The core appends events to a list; the engine drains them (``PrefixCache.drain_events``) into
the write-ahead log. Events are NamedTuples: cheap to create on the hot path, and payloads are
whole runs of blocks (one event per operation, never one per block).

Tiers are ints: 0 device, 1 host, 2 disk (``prefixd.cache.node.DEVICE`` ...).
"""

from __future__ import annotations

from typing import NamedTuple


class SeqOpened(NamedTuple):
    seq_id: int
    num_tokens: int
    num_cached_blocks: int
    deepest_hash: bytes  # hash of the last shared block, b"" when nothing was shared
    extra: bytes


class SeqExtended(NamedTuple):
    seq_id: int
    num_tokens: int


class BlockCopied(NamedTuple):
    """Copy-on-write of a shared partial last block."""

    seq_id: int
    old_slot: int
    new_slot: int


class SeqForked(NamedTuple):
    parent_id: int
    child_ids: tuple[int, ...]


class BlocksStored(NamedTuple):
    """New full blocks entered the index (device-resident in ``slots``)."""

    parent_hash: bytes
    hashes: list[bytes]
    tokens: bytes
    slots: list[int]


class SeqCommitted(NamedTuple):
    seq_id: int
    num_indexed_blocks: int
    last_hash: bytes


class SeqReleased(NamedTuple):
    seq_id: int


class BlocksMoved(NamedTuple):
    """Blocks became resident in ``tier`` at ``slots`` (bytes written, checksums known)."""

    tier: int
    hashes: list[bytes]
    slots: list[int]
    checksums: list[int]


class BlocksDropped(NamedTuple):
    """Blocks stopped being resident in ``tier`` (their slots are free)."""

    tier: int
    hashes: list[bytes]
    slots: list[int]


class BlocksForgotten(NamedTuple):
    """Blocks left the index entirely (resident nowhere)."""

    hashes: list[bytes]
