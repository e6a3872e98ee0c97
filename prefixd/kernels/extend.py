"""Paged extend attention (Triton): prefill of new tokens on top of a cached prefix.

Each sequence brings ``n`` new query tokens (packed back to back in ``query``, located by
``query_start_loc``) whose K/V have already been written to the pool at positions
``[cached, cached + n)``, ``cached = seq_len - n``. New token i attends to every cached position
and causally to new tokens ``0..i``.

Grid ``(num_tiles, num_seqs, num_kv_heads)``. A program takes a tile of query rows: its rows are
``TOKENS_PER_TILE`` tokens times the ``QUERY_GROUP`` query heads that share one KV head, so the
GQA heads share each K/V load and a tl.dot has a useful M even when a chunk has few tokens. It
walks keys from position 0 up to its last token's position, ``BLOCK_N`` at a time, through the
block table (int64 offsets), with an online softmax in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixd.kernels.attend_step import attend_step
from prefixd.kernels.checks import check_attention_args
from prefixd.kernels.launch import cdiv, is_interpreted, kernel_for, next_power_of_2

_LOG2E = 1.4426950408889634
_BLOCK_M = 64  # query rows (tokens x grouped heads) per program
_BLOCK_N = 64  # keys per loop step


@triton.jit
def _paged_extend_kernel(
    # pointers
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], strided
    v_cache_ptr,  # same shape as k_cache, own strides
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32/int64
    seq_lens_ptr,  # [num_seqs] total tokens (cached + new)
    query_start_loc_ptr,  # [num_seqs + 1] offsets of each sequence's rows in q
    # strides (in elements; the last dim of q, out and the caches is contiguous)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_bt_seq,
    # sizes
    qk_scale,  # softmax scale * log2(e)
    # meta-parameters
    QUERY_GROUP: tl.constexpr,  # query heads per KV head
    TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // QUERY_GROUP query tokens per program
    HEAD_DIM: tl.constexpr,  # head_dim
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per pool block
    BLOCK_M: tl.constexpr,  # query rows per program, a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per loop step
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter multiplies bf16 bit patterns)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (and upcast) inputs: no silent tf32
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    num_new = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    cached = seq_len - num_new
    first_tok = tile * TOKENS_PER_TILE

    rows = tl.arange(0, BLOCK_M)
    row_tok = first_tok + rows // QUERY_GROUP
    row_head = kv_head * QUERY_GROUP + rows % QUERY_GROUP
    mask_m = (rows < TOKENS_PER_TILE * QUERY_GROUP) & (row_tok < num_new)
    q_pos = cached + row_tok  # position of each row's token in its sequence
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + row_tok) * stride_q_tok + row_head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this tile can see: up to its last token's position (none if the tile is past the end).
    last_tok = tl.minimum(first_tok + TOKENS_PER_TILE, num_new)
    kv_end = tl.where(first_tok < num_new, cached + last_tok, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt_seq
    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head
    for n in range(0, kv_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        # Key 0 is visible to every row, so each row's first step has a finite maximum.
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        acc, m_i, l_i = attend_step(q, acc, m_i, l_i, k_base, v_base, table, offs_n, mask_n, visible,
                                    offs_d, mask_d, stride_k_block, stride_k_tok, stride_v_block, stride_v_tok,
                                    qk_scale, BLOCK_SIZE, UPCAST, DOT_PRECISION)

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + row_tok) * stride_o_tok + row_head * stride_o_head
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


def paged_extend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Launch paged extend attention (see :func:`reference.paged_extend_reference`).

    Runs compiled on CUDA tensors and under the Triton interpreter on CPU tensors. Only metadata
    is checked (value checks would cost a device sync per step).

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]``, sequences packed back to back.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, strided views.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32/int64.
        seq_lens: ``[num_seqs]`` total tokens per sequence (cached prefix + new tokens).
        query_start_loc: ``[num_seqs + 1]`` offsets of each sequence's tokens in ``query``.
        scale: softmax scale; ``head_dim ** -0.5`` when None.
        out: optional output like ``query``.
        max_query_len: an upper bound of the new tokens per sequence (saves a device sync).

    Returns:
        ``out``, ``[num_tokens, num_q_heads, head_dim]``.

    Raises:
        ValueError: bad shapes, dtypes, strides or devices; head_dim > 256.
    """
    s = check_attention_args(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out=out
    )
    if s.head_dim > 256:
        raise ValueError(f"head_dim {s.head_dim} > 256 is not supported by the Triton kernel")
    out = torch.empty_like(query) if out is None else out
    if s.num_seqs == 0 or s.num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = max(_BLOCK_M, next_power_of_2(s.query_group))
    tokens_per_tile = block_m // s.query_group
    num_tiles = cdiv(max(1, max_query_len), tokens_per_tile)
    scale = s.head_dim**-0.5 if scale is None else scale
    interpret = is_interpreted(query.device)
    kernel = kernel_for(_paged_extend_kernel, query.device)
    kernel[(num_tiles, s.num_seqs, s.num_kv_heads)](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        scale * _LOG2E,
        QUERY_GROUP=s.query_group,
        TOKENS_PER_TILE=tokens_per_tile,
        HEAD_DIM=s.head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(s.head_dim)),
        BLOCK_SIZE=s.block_size,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        UPCAST=interpret,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or interpret else "tf32",
        num_warps=4,
        num_stages=2,
    )
    return out
