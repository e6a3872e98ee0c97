"""Per-block checksums: computed when a block goes down a tier, checked when it comes up from disk.

NOTE: xxh3-64 (python-xxhash) over crc32c (google-crc32c). xxh3-64 hashes at memory
bandwidth, takes any buffer without a copy and drops the GIL, so a helper thread can hash one
chunk while the next is being copied. google-crc32c's ``value()`` accepts only read-only bytes,
which costs a copy per block (about half the throughput end to end). Both catch bit flips,
zeroed pages and truncation; neither is a MAC.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import xxhash

ALGORITHM = "xxh3_64"

_xxh3 = xxhash.xxh3_64_intdigest


def checksum(buf) -> int:
    """The checksum of one block's bytes (any contiguous buffer: bytes, memoryview, numpy row)."""
    return _xxh3(buf)


def checksum_rows(rows, positions: Iterable[int]) -> list[int]:
    """Checksums of ``rows[p]`` for each position; ``rows`` is a 2-D uint8 array, one block a row."""
    return [_xxh3(rows[p]) for p in positions]


def compare(found: Sequence[int], expected: Sequence[int]) -> list[bool]:
    """Per-block ok flags.

    Raises:
        ValueError: if the two lists differ in length (a caller bug).
    """
    if len(found) != len(expected):
        raise ValueError(f"got {len(expected)} expected checksums for {len(found)} blocks")
    return [f == e for f, e in zip(found, expected)]
