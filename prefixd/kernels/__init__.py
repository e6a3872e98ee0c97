"""prefixd.kernels: paged attention over block-major pools, KV write, block copy.

Imports torch only (Triton when a kernel first runs, transformers when the Hugging Face
attention is registered); nothing else of prefixd (DESIGN.md). Entry points:

- :func:`paged_attention` -- decode (one query per sequence) or extend (new tokens on a cached
  prefix) over ``layer_kv(pool, layer)`` through block tables.
- :func:`write_kv` -- new K/V into the pool through a slot mapping.
- :func:`copy_blocks`, :func:`gather_blocks`, :func:`scatter_blocks` -- whole blocks, for tier moves
  and copy-on-write.
- :func:`register_hf_attention` and :class:`PagedKVContext` -- the same attention inside a
  transformers model.

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
from prefixd.kernels.hf_attention import (
    ATTENTION_NAME,
    PagedKVContext,
    paged_attention_forward,
    register_hf_attention,
)

__all__ = [
    "ATTENTION_NAME",
    "AttentionShape",
    "BACKENDS",
    "PagedKVContext",
    "copy_blocks",
    "gather_blocks",
    "layer_kv",
    "paged_attention",
    "paged_attention_forward",
    "register_hf_attention",
    "scatter_blocks",
    "write_kv",
]
