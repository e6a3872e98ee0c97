"""prefixd.kernels: paged attention over block-major pools, KV write, block copy.

Imports torch only (Triton when a kernel first runs); nothing else of prefixd (DESIGN.md).
Entry points:

- :func:`paged_attention` -- decode (one query per sequence) or extend (new tokens on a cached
  prefix) over ``layer_kv(pool, layer)`` through block tables.
- :func:`write_kv` -- new K/V into the pool through a slot mapping.
- :func:`copy_blocks`, :func:`gather_blocks`, :func:`scatter_blocks` -- whole blocks, for tier moves
  and copy-on-write.

The same attention inside a transformers model lives with its client, in
:mod:`prefixd.client.hf_attention`.

Each picks Triton on CUDA and the pure-torch reference (:mod:`prefixd.kernels.reference`)
elsewhere; ``backend=`` overrides.
"""

from prefixd.kernels.checks import AttentionShape, layer_kv
from prefixd.kernels.dispatch import (
    BACKENDS,
    copy_blocks,
    gather_blocks,
    paged_attention,
    scatter_blocks,
    write_kv,
)

__all__ = [
    "AttentionShape",
    "BACKENDS",
    "copy_blocks",
    "gather_blocks",
    "layer_kv",
    "paged_attention",
    "scatter_blocks",
    "write_kv",
]
