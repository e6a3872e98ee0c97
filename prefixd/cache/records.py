"""What the cache's events become in the write-ahead log, and back.

The WAL stores ``kind | fixed fields | blob``; this module defines the blob of each kind the
cache writes. Hashes are 16 bytes, slots u32 little-endian, checksums u64 little-endian.

=============  ================================================================
kind           blob
=============  ================================================================
OPEN           deepest shared block hash (16 bytes, or empty) || extra
COMMIT         hash of the sequence's last indexed block (16 bytes)
BLOCK_PUT      parent hash (16) || hashes (16 n) || tokens (n block_bytes) || device slots (4 n)
BLOCK_MOVE     hashes (16 n) || slots (4 n) || checksums (8 n, or empty)
BLOCK_DROP     hashes (16 n)
=============  ================================================================
"""

from __future__ import annotations

import numpy as np

from prefixd.cache import events as ev
from prefixd.wal.records import Kind

H = 16


def _u32(values) -> bytes:
    return np.asarray(values, dtype="<u4").tobytes()


def _u64(values) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


def split_hashes(blob: bytes, n: int) -> list[bytes]:
    return [blob[i:i + H] for i in range(0, n * H, H)]


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
        return Kind.BLOCK_MOVE, (event.tier, n), b"".join(event.hashes) + _u32(event.slots) + sums
    if t is ev.BlocksDropped:
        return Kind.BLOCK_DROP, (event.tier, len(event.hashes)), b"".join(event.hashes)
    raise TypeError(f"no record for event {event!r}")


def decode_put(blob: bytes, n: int, block_bytes: int):
    """``(parent_hash, hashes, tokens, device_slots)`` of a BLOCK_PUT blob."""
    parent = blob[:H]
    hashes = split_hashes(blob[H:], n)
    t0 = H + n * H
    tokens = blob[t0:t0 + n * block_bytes]
    slots = np.frombuffer(blob, dtype="<u4", count=n, offset=t0 + n * block_bytes).tolist()
    return parent, hashes, tokens, slots


def decode_move(blob: bytes, n: int):
    """``(hashes, slots, checksums or None)`` of a BLOCK_MOVE blob."""
    hashes = split_hashes(blob, n)
    slots = np.frombuffer(blob, dtype="<u4", count=n, offset=n * H).tolist()
    sums = None
    if len(blob) > n * (H + 4):
        sums = np.frombuffer(blob, dtype="<u8", count=n, offset=n * (H + 4)).tolist()
    return hashes, slots, sums
