"""A pool's KV by token: which tokens a sequence may write, and reading and writing them.

The device pool is block-major, ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]``; a client hands and gets the KV of ``n`` consecutive tokens as ``[num_layers, 2, n,
num_kv_heads, head_dim]`` (DESIGN.md "Client library"). Token ``t`` of a sequence is row
``t % block_size`` of block ``block_table[t // block_size]``.

``PoolKV`` is the engine's KV API: the daemon's KV rpcs (``prefixd.daemon.kv_rpc``) and
``DurableCache.write_kv`` / ``read_kv`` go through it and nothing else. The rules it owns: a
range must lie within the sequence (``check_range``), and only blocks private to the sequence
may be written (``check_writable``: never an indexed block, which other prompts may be
reading, never the partial last block it still shares with forked siblings). The copies
themselves are ``prefixd.kernels.token_io`` (pure tensor code the client's mapped path uses
too).
"""

from __future__ import annotations

import torch

from prefixd.api.tiers import Tier
from prefixd.engine.errors import SharedBlockError
from prefixd.kernels.token_io import MAX_RUNS, check_kv, read_tokens, write_tokens

__all__ = ["MAX_RUNS", "PoolKV", "check_kv", "check_range"]


class PoolKV:
    """The KV of one pool's live sequences, by token.

    Args:
        cache: the pool's ``PrefixCache`` (sequences, their block tables, which blocks are
            private to one).
        store: its ``TierStore`` (the device pool's tensor).
        layout: the pool's ``KVLayout``.

    Holds no state of its own: every check reads the sequence as it is at the call, so a
    caller that checks then writes on the same thread, with no engine call in between, writes
    what it checked.
    """

    def __init__(self, cache, store, layout) -> None:
        self._cache = cache
        self._store = store
        self.layout = layout

    @property
    def device_tensor(self) -> torch.Tensor:
        """The device pool, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        return self._store.pool(Tier.DEVICE).tensor

    def writable_blocks(self, seq) -> range:
        """The blocks of ``seq``'s block table it may write: those private to it."""
        return self._cache.private_blocks(seq.id)

    def check_writable(self, seq, start: int, n: int) -> None:
        """Raises SharedBlockError unless every block tokens ``start .. start + n`` touch is
        private to ``seq`` (not indexed, not a tail shared with forked siblings); the message
        says which block and which tokens may be written."""
        if not n:
            return
        bs = self.layout.block_size
        mine = self.writable_blocks(seq)
        first, last = start // bs, (start + n - 1) // bs
        if mine.start <= first and last < mine.stop:
            return
        b = first if first < mine.start else last
        why = ("indexed (committed: other prompts may be reading it)" if b < seq.num_indexed
               else "a partial last block shared with forked siblings (Extend the sequence "
                    "first: that copies it)")
        lo, hi = mine.start * bs, min(mine.stop * bs, seq.num_tokens)
        may = f"only tokens {lo}..{hi} of it may be written" if hi > lo else "none of its tokens may be written"
        raise SharedBlockError(f"sequence {seq.id}: tokens {start}..{start + n} reach block {b}, "
                               f"which is {why}; its KV cannot change: {may}")

    def token_slots(self, seq, start: int, n: int) -> list[int]:
        """The device pool row (``block * block_size + offset``) of each token ``start ..
        start + n`` of ``seq`` (unchecked: check the range first)."""
        bs, table = self.layout.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def write(self, seq, start: int, kv) -> None:
        """Check, then write ``kv`` as the KV of tokens ``start ..`` of ``seq`` (a live
        sequence or its id; see ``DurableCache.write_kv``).

        Raises:
            UnknownSequence; ValueError: a bad ``kv`` or a range past the sequence's end;
            SharedBlockError: a block the range touches is not the sequence's alone.
        """
        seq = self._cache.sequence(seq if isinstance(seq, int) else seq.id)
        n = check_kv(self.layout, kv)
        check_range(seq, start, n)
        if not n:
            return
        self.check_writable(seq, start, n)
        write_tokens(self.device_tensor, seq.block_table, start, kv, self.layout.block_size)

    def read(self, seq, start: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Check, then read the KV of tokens ``start .. start + n`` of ``seq`` (a live sequence
        or its id) into ``out`` (a new tensor on the device pool's device when None).

        Raises:
            UnknownSequence; ValueError: tokens past the sequence's end.
        """
        seq = self._cache.sequence(seq if isinstance(seq, int) else seq.id)
        check_range(seq, start, n)
        return read_tokens(self.device_tensor, seq.block_table, start, n, self.layout.block_size, out)


def check_range(seq, start: int, n: int) -> None:
    """Raises ValueError unless tokens ``start .. start + n`` lie within ``seq``."""
    if not isinstance(start, int) or not isinstance(n, int) or start < 0 or n < 0:
        raise ValueError(f"start and n must be ints >= 0, got start={start!r} n={n!r}")
    if start + n > seq.num_tokens:
        raise ValueError(f"tokens {start}..{start + n} are past the end of sequence {seq.id} "
                         f"({seq.num_tokens} tokens): Extend it first, or ask for less")
