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


class StoreTokens:
    """The ``TokenPool`` protocol over a real ``TierStore``: each token's value fills its
    offset of the block (all layers, K and V), as float32 (values kept below 2**20, exact)."""

    def __init__(self, store, block_size: int) -> None:
        self.store = store
        self.block_size = block_size

    @staticmethod
    def values(tokens: list[int]) -> list[int]:
        return [v % (1 << 20) for v in TokenPool.values(tokens)]

    def write(self, table: list[int], tokens: list[int], start: int) -> None:
        bs = self.block_size
        vals = self.values(tokens)
        for b in range(start // bs, -(-len(tokens) // bs)):
            block = self.store.read(0, [table[b]])
            for p in range(max(start, b * bs), min(len(tokens), (b + 1) * bs)):
                block[0, :, :, p % bs] = vals[p]
            self.store.write(0, [table[b]], block)

    def check(self, table: list[int], tokens: list[int]) -> None:
        bs = self.block_size
        vals = self.values(tokens)
        if not tokens:
            return
        blocks = self.store.read(0, table[: -(-len(tokens) // bs)])
        for p, v in enumerate(vals):
            got = blocks[p // bs, :, :, p % bs]
            assert bool((got == v).all()), f"position {p} (slot {table[p // bs]}) holds {got.flatten()[:2]}, expected {v}"


def tiny_layout(block_size: int = 2):
    from prefixd.api.layout import KVLayout

    return KVLayout("tiny", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", block_size=block_size)


def tree_state(cache) -> tuple:
    """Everything a refused request must leave as it was: every run (named by its last block's
    hash and length, so node boundaries too; per-tier slots, locks, clock, hits), each tier's block count and free slots, the
    pending events and the sequences."""
    tree = cache.tree
    runs = sorted((n.hashes[-1], n.num_blocks, [None if s is None else list(s) for s in n.slots],
                   n.lock_ref, n.last_access, n.hit_count, list(n.kids_in)) for n in tree.nodes())
    free = [None if a is None else a.num_free for a in cache.allocators]
    seqs = sorted((s.id, bytes(s.tokens), list(s.block_table)) for s in cache.sequences())
    return runs, list(tree.num_blocks_in), free, list(cache.events), seqs, tree.clock
