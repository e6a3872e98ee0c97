"""Sequences and their block tables."""

from __future__ import annotations


class Sequence:
    """One prompt/generation stream's view of the cache.

    Fields:
        id: unique within the cache (and, with the daemon epoch, across restarts).
        tokens: packed int32 token ids: the prompt's ``bytes`` as given to ``open`` (no copy
            for a request that never extends), a ``bytearray`` that grows from the first
            ``extend`` on.
        block_table: device slot of each logical block, ``ceil(num_tokens / block_size)`` long.
        node: the deepest indexed node this sequence references; it holds one lock on it.
        num_indexed: how many leading blocks are in the index (shared, immutable).
        dup_slots: device slots this sequence filled with blocks someone else indexed first;
            the table switched to the index's slots at commit, but these stay owned (a kernel
            may still be reading them) and are freed at release.
        cached_tokens: tokens served from the cache at open.

    Invariants: ``block_table[:num_indexed]`` equals the device slots along the path from the
    root to ``node``; ``block_table[num_indexed:]`` is private to this sequence, except a partial
    last block shared with forked siblings (the cache counts those references).
    """

    __slots__ = ("id", "extra", "tokens", "block_table", "node", "num_indexed", "dup_slots",
                 "cached_tokens")

    def __init__(self, seq_id, extra, tokens, block_table, node, num_indexed, cached_tokens):
        self.id = seq_id
        self.extra = extra
        self.tokens = tokens
        self.block_table = block_table
        self.node = node
        self.num_indexed = num_indexed
        self.dup_slots: list[int] = []
        self.cached_tokens = cached_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) >> 2

    def __len__(self) -> int:
        return len(self.tokens) >> 2

    def __repr__(self) -> str:
        return (f"Sequence(id={self.id}, tokens={self.num_tokens}, blocks={len(self.block_table)}, "
                f"indexed={self.num_indexed}, cached_tokens={self.cached_tokens})")
