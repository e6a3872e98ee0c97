"""Argument checks shared by every launcher and reference (shapes, strides, dtypes, devices).

A kernel that is handed a wrong shape reads someone else's memory instead of failing, so every
entry point runs these checks before it launches. They look only at tensor metadata: nothing here
reads tensor values (that would synchronise a CUDA stream on every decode step). Value checks
(lengths within the block table, slot ids within the pool) live in the reference, which reads
the values anyway.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from prefixd.kernels.launch import ATTENTION_DTYPES

INDEX_DTYPES = (torch.int32, torch.int64)


class AttentionShape(NamedTuple):
    """Sizes of one paged-attention call, as read from its arguments."""

    num_seqs: int
    num_tokens: int  # query rows: num_seqs for decode, sum of new tokens for extend
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    max_blocks_per_seq: int

    @property
    def query_group(self) -> int:
        """Query heads per KV head (1 for MHA, >1 for GQA)."""
        return self.num_q_heads // self.num_kv_heads


def layer_kv(pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided K and V views of one layer of a block-major pool (no copy).

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        layer: which layer, ``0 <= layer < num_layers``.

    Returns:
        ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Raises:
        ValueError: for a pool that is not 6-D with a K/V dim of 2, or a layer out of range.
    """
    if pool.dim() != 6 or pool.shape[2] != 2:
        raise ValueError(
            "pool must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(pool.shape)}"
        )
    if not 0 <= layer < pool.shape[1]:
        raise ValueError(f"layer {layer} out of range for a pool of {pool.shape[1]} layers")
    return pool[:, layer, 0], pool[:, layer, 1]


def _check_index(name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the query is on {device}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _check_cache(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim] "
            f"(use layer_kv(pool, layer)), got {shape}"
        )
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but the query has {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the query is on {device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")


def check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> AttentionShape:
    """Check a paged decode (``query_start_loc is None``) or extend call.

    Args:
        query: ``[num_seqs, num_q_heads, head_dim]`` for decode, or
            ``[num_tokens, num_q_heads, head_dim]`` (sequences packed) for extend.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, strided.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32/int64 pool slots.
        seq_lens: ``[num_seqs]`` int32/int64, tokens per sequence including the new ones.
        query_start_loc: ``[num_seqs + 1]`` int32/int64 offsets into ``query`` (extend only).
        out: optional output, the shape and dtype of ``query``.

    Returns:
        The call's :class:`AttentionShape`.

    Raises:
        ValueError: naming the first argument whose shape, dtype, stride or device is wrong.
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be [tokens, num_q_heads, head_dim], got {shape}")
    if query.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"query dtype must be one of {ATTENTION_DTYPES}, got {query.dtype}")
    if query.stride(-1) != 1:
        raise ValueError(f"query must be contiguous in head_dim, got strides {query.stride()}")
    device = query.device
    _check_cache("k_cache", k_cache, query.dtype, device)
    _check_cache("v_cache", v_cache, query.dtype, device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens, num_q_heads, q_head_dim = query.shape
    if q_head_dim != head_dim:
        raise ValueError(f"query head_dim {q_head_dim} != cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads} (GQA)"
        )
    _check_index("block_tables", block_tables, 2, device)
    _check_index("seq_lens", seq_lens, 1, device)
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, block_tables {num_seqs} rows")
    if query_start_loc is None:
        if num_tokens != num_seqs:
            raise ValueError(f"decode takes one query per sequence: {num_tokens} != {num_seqs}")
    else:
        _check_index("query_start_loc", query_start_loc, 1, device)
        if query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(
                f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
                f"got {query_start_loc.shape[0]}"
            )
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype or out.device != device:
            raise ValueError(
                f"out must match query ({tuple(query.shape)}, {query.dtype}, {device}), "
                f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
            )
        if out.stride(-1) != 1:
            raise ValueError(f"out must be contiguous in head_dim, got strides {out.stride()}")
    return AttentionShape(
        num_seqs, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks,
        block_tables.shape[1],
    )


def check_kv_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Check a KV write: ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into caches.

    Raises:
        ValueError: naming the first argument whose shape, dtype, stride or device is wrong.
    """
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_dim], got {shape}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if key.dtype not in ATTENTION_DTYPES or value.dtype != key.dtype:
        raise ValueError(f"key/value dtypes must match, one of {ATTENTION_DTYPES}: "
                         f"got {key.dtype}, {value.dtype}")
    device = key.device
    if value.device != device:
        raise ValueError(f"value is on {value.device} but key is on {device}")
    _check_cache("k_cache", k_cache, key.dtype, device)
    _check_cache("v_cache", v_cache, key.dtype, device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"key heads/head_dim {tuple(key.shape[1:])} != cache {tuple(k_cache.shape[2:])}"
        )
    _check_index("slot_mapping", slot_mapping, 1, device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )


def check_copy_args(
    src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Check a block copy between two pools whose blocks have the same shape.

    Raises:
        ValueError: for pools with different block shapes or dtypes, a block that is not one
            contiguous chunk, or slot lists of the wrong shape, dtype or length.
    """
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise ValueError(f"{name} must be a pool [num_blocks, ...block dims]")
        inner = t[0]
        if not inner.is_contiguous():
            raise ValueError(
                f"{name} blocks must each be one contiguous chunk (block-major), "
                f"got strides {t.stride()}"
            )
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"block shapes differ: src {tuple(src.shape[1:])}, dst {tuple(dst.shape[1:])}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    for name, t, pool in (("src_slots", src_slots, src), ("dst_slots", dst_slots, dst)):
        _check_index(name, t, 1, pool.device)
    if src_slots.shape[0] != dst_slots.shape[0]:
        raise ValueError(
            f"src_slots has {src_slots.shape[0]} entries, dst_slots {dst_slots.shape[0]}"
        )
