"""Factories for cache-core tests."""

from __future__ import annotations

import numpy as np

from prefixd.cache import PrefixCache

BS = 4  # small blocks keep token lists readable


def toks(*ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def run(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def make_cache(num_blocks: int = 32, block_size: int = BS, **kw) -> PrefixCache:
    return PrefixCache(num_blocks, block_size, **kw)


class TokenPool:
    """A tiny data pool: one int64 per token slot, standing in for K/V bytes.

    ``value(prefix)`` is a deterministic function of every token up to and including the
    position, as real KV is; so a block shared under the wrong prefix holds wrong values.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.data = np.full((num_blocks, block_size), -1, dtype=np.int64)

    def copy_within(self, tier, src_slots, dst_slots) -> None:
        assert tier == 0
        self.data[dst_slots] = self.data[src_slots]

    @staticmethod
    def values(tokens: list[int]) -> list[int]:
        out, h = [], 1469598103934665603
        for t in tokens:
            h = ((h ^ (t + 1)) * 1099511628211) % (1 << 61)
            out.append(h)
        return out

    def write(self, table: list[int], tokens: list[int], start: int) -> None:
        bs = self.block_size
        vals = self.values(tokens)
        for p in range(start, len(tokens)):
            self.data[table[p // bs], p % bs] = vals[p]

    def check(self, table: list[int], tokens: list[int]) -> None:
        bs = self.block_size
        vals = self.values(tokens)
        for p, v in enumerate(vals):
            got = self.data[table[p // bs], p % bs]
            assert got == v, f"position {p} (slot {table[p // bs]}) holds {got}, expected {v}"
