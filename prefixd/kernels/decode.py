"""Paged decode attention (Triton): one query token per sequence over its paged K/V.

Grid ``(num_seqs, num_kv_heads, num_splits)``. One program owns one KV head of one sequence and
every query head that shares it (GQA), so each K/V byte is read from memory once per step. It
walks its share of the sequence ``BLOCK_N`` keys at a time: the block table turns a key's logical
position into ``slot * stride_block + offset * stride_tok``, computed in int64 (a pool past 2**31
elements is normal on a 141 GB device), then an online softmax in fp32 (exp2, scale folded in).

Split-K: decode has only ``num_seqs * num_kv_heads`` units of work, too few to fill a GPU at small
batch, so a long context is cut into ``num_splits`` ranges of ``tokens_per_split`` keys. Each
writes its normalised partial output and log-sum-exp; a second kernel weighs them together. With
one split the first kernel writes the output directly and the second is not launched.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from prefixd.kernels.attend_step import attend_step
from prefixd.kernels.checks import check_attention_args
from prefixd.kernels.launch import cdiv, is_interpreted, kernel_for, next_power_of_2, num_sms

log = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634
# Keys per inner-loop step. 64 keys x 128 dims x 2 bytes = 16 KiB of K (and of V) per step.
_BLOCK_N = 64
# A split shorter than this costs more in the combine step than it wins in parallelism.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64
# Programs per SM to aim for before splitting stops paying (latency hiding for the loads).
_PROGRAMS_PER_SM = 4


@triton.jit
def _paged_decode_kernel(
    # pointers
    out_ptr,  # [num_seqs, num_q_heads, head_dim]; written when SPLIT is False
    part_out_ptr,  # [num_seqs, num_q_heads, num_splits, HEAD_DIM_PAD] fp32; when SPLIT
    part_lse_ptr,  # [num_seqs, num_q_heads, num_splits] fp32 log2-sum-exp2; when SPLIT
    q_ptr,  # [num_seqs, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], strided
    v_cache_ptr,  # same shape as k_cache, own strides
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32/int64
    seq_lens_ptr,  # [num_seqs] int32/int64
    # strides (in elements; the last dim of q, out and the caches is contiguous)
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_bt_seq,
    # sizes
    num_q_heads,
    num_splits,
    tokens_per_split,  # keys per split, a multiple of BLOCK_N
    qk_scale,  # softmax scale * log2(e)
    # meta-parameters
    QUERY_GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # QUERY_GROUP rounded up to a power of two >= 16 (tl.dot's M)
    HEAD_DIM: tl.constexpr,  # head_dim
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per pool block
    BLOCK_N: tl.constexpr,  # keys per loop step
    SPLIT: tl.constexpr,  # write partials for the combine kernel instead of the output
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter multiplies bf16 bit patterns)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (and upcast) inputs: no silent tf32
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_g = offs_g < QUERY_GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * QUERY_GROUP + offs_g
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt_seq
    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        acc, m_i, l_i = attend_step(q, acc, m_i, l_i, k_base, v_base, table, offs_n, mask_n, mask_n[None, :],
                                    offs_d, mask_d, stride_k_block, stride_k_tok, stride_v_block, stride_v_tok,
                                    qk_scale, BLOCK_SIZE, UPCAST, DOT_PRECISION)

    # A split past the end of a short sequence ran no step: l_i = 0, lse = -inf, weight 0.
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        row = (seq * num_q_heads + heads) * num_splits + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_g)
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc,
            mask=mask_g[:, None],
        )
    else:
        tl.store(
            out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask_g[:, None] & mask_d[None, :],
        )


@triton.jit
def _combine_splits_kernel(
    # pointers
    out_ptr,  # [num_seqs, num_q_heads, head_dim]
    part_out_ptr,  # [num_seqs, num_q_heads, num_splits, HEAD_DIM_PAD] fp32
    part_lse_ptr,  # [num_seqs, num_q_heads, num_splits] fp32
    seq_lens_ptr,  # [num_seqs]
    # strides
    stride_o_seq,
    stride_o_head,
    # sizes
    num_q_heads,
    num_splits,
    tokens_per_split,
    # meta-parameters
    HEAD_DIM: tl.constexpr,  # head_dim
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of two >= 16
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    used = tl.cdiv(seq_len, tokens_per_split)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_s = offs_s < used
    row = (seq * num_q_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=mask_s, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = tl.where(mask_s, weight, 0.0)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=mask_s[:, None],
        other=0.0,
    )
    o = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def _pick_num_splits(query: torch.Tensor, work_units: int, max_seq_len: int) -> int:
    if is_interpreted(query.device):
        return 1
    programs = _PROGRAMS_PER_SM * num_sms(query.device.index or 0)
    want = cdiv(programs, max(1, work_units))
    return max(1, min(want, cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT), _MAX_SPLITS))


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Launch paged decode attention (see :func:`reference.paged_decode_reference`).

    Runs compiled on CUDA tensors and under the Triton interpreter on CPU tensors. Only metadata
    is checked: lengths past the block table or slots past the pool are not (that would cost a
    device sync per step).

    Args:
        query: ``[num_seqs, num_q_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, strided views
            (see ``layer_kv``).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32/int64.
        seq_lens: ``[num_seqs]`` int32/int64, each >= 1.
        scale: softmax scale; ``head_dim ** -0.5`` when None.
        out: optional output like ``query``.
        max_seq_len: an upper bound of ``seq_lens`` (saves a device sync when given).
        num_splits: force the split-K factor (tests); picked from the SM count when None.

    Returns:
        ``out``, ``[num_seqs, num_q_heads, head_dim]``.

    Raises:
        ValueError: bad shapes, dtypes, strides or devices; head_dim > 256; num_splits < 1.
    """
    s = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, out=out)
    if s.head_dim > 256:
        raise ValueError(f"head_dim {s.head_dim} > 256 is not supported by the Triton kernel")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(query) if out is None else out
    if s.num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_seq_len = max(1, max_seq_len)
    if num_splits is None:
        num_splits = _pick_num_splits(query, s.num_seqs * s.num_kv_heads, max_seq_len)
    tokens_per_split = cdiv(cdiv(max_seq_len, num_splits), _BLOCK_N) * _BLOCK_N
    num_splits = cdiv(max_seq_len, tokens_per_split)
    head_dim_pad = max(16, next_power_of_2(s.head_dim))
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            (s.num_seqs, s.num_q_heads, num_splits, head_dim_pad),
            dtype=torch.float32,
            device=query.device,
        )
        part_lse = torch.empty(
            (s.num_seqs, s.num_q_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused by the kernel when SPLIT is False
    scale = s.head_dim**-0.5 if scale is None else scale
    interpret = is_interpreted(query.device)
    kernel = kernel_for(_paged_decode_kernel, query.device)
    kernel[(s.num_seqs, s.num_kv_heads, num_splits)](
        out, part_out, part_lse, query, k_cache, v_cache, block_tables, seq_lens,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        s.num_q_heads, num_splits, tokens_per_split, scale * _LOG2E,
        QUERY_GROUP=s.query_group,
        GROUP_PAD=max(16, next_power_of_2(s.query_group)),
        HEAD_DIM=s.head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=s.block_size,
        BLOCK_N=_BLOCK_N,
        SPLIT=split,
        UPCAST=interpret,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or interpret else "tf32",
        num_warps=4,
        num_stages=2,
    )
    if split:
        combine = kernel_for(_combine_splits_kernel, query.device)
        combine[(s.num_seqs, s.num_q_heads)](
            out, part_out, part_lse, seq_lens,
            out.stride(0), out.stride(1),
            s.num_q_heads, num_splits, tokens_per_split,
            HEAD_DIM=s.head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
