"""Whole blocks between vLLM's paged KV tensors and prefixd's mapped pool (pure tensor code).

``views`` are the per-layer block-order views of vLLM's tensors (``PagedLayout.view``:
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, in prefixd's layer order); ``pool`` is
the session's mapped device pool ``[num_slots, num_layers, 2, block_size, num_kv_heads,
head_dim]``. vLLM block ``block_ids[i]`` pairs with prefixd slot ``slots[i]``.

NOTE: one gather and one scatter per layer, whatever the number of blocks (an indexed copy),
rather than one copy per block: a 2k-token prompt of a 30-layer model is then 60 ops, not
thousands. Nothing here checks who may write what; the worker side checks the lease and the
daemon's epoch around each call (a mapped store cannot see a restart by itself).
"""

from __future__ import annotations

import torch


def _index(ids, device) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.long, device=device)


def check_pair(pool: torch.Tensor, views, block_ids, slots) -> None:
    """Raises ValueError when the pool and the views disagree on a block's shape or dtype, or
    the id lists differ in length (a caller bug: the message says which)."""
    if len(block_ids) != len(slots):
        raise ValueError(f"{len(block_ids)} vLLM blocks for {len(slots)} prefixd slots")
    if pool.dim() != 6 or pool.shape[1] != len(views):
        raise ValueError(f"the pool {tuple(pool.shape)} does not hold {len(views)} layers")
    for view in views:
        if tuple(view.shape[1:]) != tuple(pool.shape[2:]) or view.dtype != pool.dtype:
            raise ValueError(f"a vLLM block {tuple(view.shape[1:])} of {view.dtype} is not a pool block "
                             f"layer {tuple(pool.shape[2:])} of {pool.dtype}")


def load_blocks(pool: torch.Tensor, views, block_ids, slots) -> None:
    """vLLM blocks ``block_ids`` (every layer) = prefixd slots ``slots``."""
    if not block_ids:
        return
    check_pair(pool, views, block_ids, slots)
    src = _index(slots, pool.device)
    for layer, view in enumerate(views):
        view[_index(block_ids, view.device)] = pool[src, layer].to(view.device)


def save_blocks(pool: torch.Tensor, views, block_ids, slots) -> None:
    """prefixd slots ``slots`` (every layer) = vLLM blocks ``block_ids``."""
    if not block_ids:
        return
    check_pair(pool, views, block_ids, slots)
    dst = _index(slots, pool.device)
    for layer, view in enumerate(views):
        pool[dst, layer] = view[_index(block_ids, view.device)].to(pool.device)
