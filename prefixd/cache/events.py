"""Typed events: every change the cache core makes, in order, for the WAL to log.

The core appends events to a list; the engine drains them (``PrefixCache.drain_events``) into
the write-ahead log. Events are NamedTuples, and payloads are whole runs of blocks (one event
per operation, never one per block).

NOTE: the hot path builds them with ``new_event(Cls, (fields...))`` (``tuple.__new__``): a
NamedTuple's generated ``__new__`` costs ~3x more, and a request makes four or five events.

Tiers are ints: 0 device, 1 host, 2 disk (``prefixd.cache.node.DEVICE`` ...).

Invariant: an event never changes once it is made, payload lists included (a run's ``hashes``,
``slots`` and ``checksums`` are the node's own lists, which the core replaces and never edits in
place): the durable engine encodes events when their records are appended, which can be
milliseconds later and on another thread (``prefixd.engine.ordered_log``).
"""

from __future__ import annotations

from typing import NamedTuple

new_event = tuple.__new__


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
    """Blocks became resident in ``tier`` at ``slots`` (bytes written). ``checksums``: the
    run's checksums when this copy established or changed them, else empty (they are known
    from an earlier event, which is what keeps them out of most move records)."""

    tier: int
    hashes: list[bytes]
    slots: list[int]
    checksums: list[int]


class BlocksDropped(NamedTuple):
    """Blocks stopped being resident in ``tier`` (their slots are free); ``forgotten`` when
    they are now resident nowhere and left the index."""

    tier: int
    hashes: list[bytes]
    slots: list[int]
    forgotten: bool
