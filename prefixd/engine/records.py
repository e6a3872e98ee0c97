"""What the cache's events become in the write-ahead log (``replay`` reads them back).

The WAL stores ``kind | fixed fields | blob``; this module defines the blob of each kind the
cache writes. Hashes are 16 bytes, slots u32 little-endian, checksums u64 little-endian.

=============  ================================================================
kind           blob
=============  ================================================================
OPEN           deepest shared block hash (16 bytes, or empty) || extra
COMMIT         hash of the sequence's last indexed block (16 bytes)
BLOCK_PUT      parent hash (16) || hashes (16 n) || tokens (n block_bytes) || device slots (4 n)
BLOCK_MOVE     first hash (16) || last hash (16) || slots (4 n; none into the device tier)
               || checksums (8 n, only when this copy established or changed them)
BLOCK_DROP     first hash (16) || last hash (16)
=============  ================================================================

A run is named by its first and last hash and its length (the ``num_blocks`` field): hashes
chain on the parent, so the last one names the whole path and the first one where the run
starts. Moves and drops are most of a log (every eviction writes one or two), and naming
every block of their run made them 3-20x larger than they are now, for nothing replay used.

``RECORDS_VERSION`` numbers these layouts; the checkpoint saves it and a state directory
written with another one is refused (``prefixd.engine.errors.StateFormatError``).
"""

from __future__ import annotations

import numpy as np

from prefixd.cache import events as ev
from prefixd.cache.node import DEVICE
from prefixd.wal.kinds import Kind

H = 16
RECORDS_VERSION = 3  # 1: moves and drops named every block; 2: device moves carried slots


def _u32(values) -> bytes:
    return np.asarray(values, dtype="<u4").tobytes()


def _u64(values) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


def event_records(event, session_id: int = 0) -> tuple:
    """``(kind, fields, blob)`` for one event."""
    t = type(event)
    if t is ev.SeqOpened:
        return Kind.OPEN, (event.seq_id, session_id, event.num_tokens, event.num_cached_blocks), \
            event.deepest_hash + event.extra if event.deepest_hash else (b"\x00" * H) + event.extra
    if t is ev.SeqExtended:
        return Kind.EXTEND, (event.seq_id, event.num_tokens), b""
    if t is ev.BlockCopied:
        return Kind.COW, (event.seq_id, event.old_slot, event.new_slot), b""
    if t is ev.SeqForked:
        ids = event.child_ids
        assert list(ids) == list(range(ids[0], ids[0] + len(ids))), "fork children must be consecutive"
        return Kind.FORK, (event.parent_id, ids[0], len(ids)), b""
    if t is ev.SeqCommitted:
        return Kind.COMMIT, (event.seq_id, event.num_indexed_blocks), event.last_hash
    if t is ev.SeqReleased:
        return Kind.RELEASE, (event.seq_id,), b""
    if t is ev.BlocksStored:
        n = len(event.hashes)
        return Kind.BLOCK_PUT, (0, n), event.parent_hash + b"".join(event.hashes) + event.tokens + _u32(event.slots)
    if t is ev.BlocksMoved:
        n = len(event.hashes)
        sums = _u64(event.checksums) if event.checksums else b""
        hashes = event.hashes
        if event.tier == DEVICE:  # device residency never survives a restart: only the fact is logged
            return Kind.BLOCK_MOVE, (event.tier, n), hashes[0] + hashes[-1] + sums
        return Kind.BLOCK_MOVE, (event.tier, n), hashes[0] + hashes[-1] + _u32(event.slots) + sums
    if t is ev.BlocksDropped:
        hashes = event.hashes
        return Kind.BLOCK_DROP, (event.tier, len(hashes)), hashes[0] + hashes[-1]
    raise TypeError(f"no record for event {event!r}")
