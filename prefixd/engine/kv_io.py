"""A sequence's KV into and out of the device pool, by token (``DurableCache.write_kv`` / ``read_kv``).

The pool is block-major, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; a
client hands and gets the KV of ``n`` consecutive tokens as ``[num_layers, 2, n, num_kv_heads,
head_dim]`` (DESIGN.md "Client library"). Token ``t`` of a sequence is row ``t % block_size`` of
block ``block_table[t // block_size]``.

The copies themselves are ``prefixd.kernels.token_io`` (pure tensor code the client's mapped
path uses too); this module checks the sequence, the range and who may write it first.
"""

from __future__ import annotations

import torch

from prefixd.engine.errors import SharedBlockError
from prefixd.kernels.token_io import MAX_RUNS, check_kv, read_tokens, write_tokens

__all__ = ["MAX_RUNS", "check_kv", "check_range", "read_kv", "write_kv"]


def write_kv(cache, pool: torch.Tensor, layout, seq, start: int, kv) -> None:
    """Check, then write ``kv`` as the KV of tokens ``start ..`` of ``seq`` (see
    ``DurableCache.write_kv``): ``cache`` is the ``PrefixCache``, ``pool`` its device pool."""
    seq = cache.sequence(seq if isinstance(seq, int) else seq.id)
    n = check_kv(layout, kv)
    check_range(seq, start, n)
    if not n:
        return
    bs = cache.block_size
    mine = cache.private_blocks(seq.id)
    first, last = start // bs, (start + n - 1) // bs
    if first < mine.start or last >= mine.stop:
        b = first if first < mine.start else last
        why = ("indexed (committed: other prompts may be reading it)" if b < seq.num_indexed
               else "a partial last block shared with forked siblings (extend the sequence first)")
        lo, hi = mine.start * bs, min(mine.stop * bs, seq.num_tokens)
        may = f"tokens {lo}..{hi} of it may be written" if hi > lo else "none of its tokens may be written"
        raise SharedBlockError(f"sequence {seq.id}: tokens {start}..{start + n} reach block {b}, "
                               f"which is {why}; its KV cannot change: {may}")
    write_tokens(pool, seq.block_table, start, kv, bs)


def read_kv(cache, pool: torch.Tensor, seq, start: int, n: int) -> torch.Tensor:
    """Check, then read the KV of tokens ``start .. start + n`` of ``seq`` (see
    ``DurableCache.read_kv``)."""
    seq = cache.sequence(seq if isinstance(seq, int) else seq.id)
    check_range(seq, start, n)
    return read_tokens(pool, seq.block_table, start, n, cache.block_size)


def check_range(seq, start: int, n: int) -> None:
    """Raises ValueError unless tokens ``start .. start + n`` lie within ``seq``."""
    if not isinstance(start, int) or not isinstance(n, int) or start < 0 or n < 0:
        raise ValueError(f"start and n must be ints >= 0, got start={start!r} n={n!r}")
    if start + n > seq.num_tokens:
        raise ValueError(f"tokens {start}..{start + n} are past the end of sequence {seq.id} "
                         f"({seq.num_tokens} tokens): extend it first")
