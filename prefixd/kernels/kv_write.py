"""KV write (Triton): scatter new tokens' K/V into the pool through a slot mapping.

``slot_mapping[t]`` is token t's flat pool position, ``slot * block_size + offset``; a negative
entry skips the token (padding). Grid ``(num_tokens, cdiv(num_kv_heads, HEADS_PER_PROGRAM))``;
each program copies a few heads of one token's K and V rows. Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixd.kernels.checks import check_kv_write_args
from prefixd.kernels.launch import cdiv, kernel_for, next_power_of_2

# Elements of K (and of V) one program moves: enough per program, few enough for registers.
_ELEMENTS_PER_PROGRAM = 2048


@triton.jit
def _write_kv_kernel(
    # pointers
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], strided
    v_cache_ptr,  # same shape as k_cache, own strides
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32/int64 flat positions, negative = skip
    # strides (in elements; the last dims are contiguous)
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    # sizes
    num_kv_heads,
    # meta-parameters
    HEAD_DIM: tl.constexpr,  # head_dim
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per pool block
    HEADS_PER_PROGRAM: tl.constexpr,  # KV heads per program, a power of two
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    block = pos // BLOCK_SIZE
    within = pos % BLOCK_SIZE
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    heads = heads.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    mask = mask & (heads[:, None] * 0 + pos >= 0)
    src = tok * stride_key_tok + heads[:, None] * stride_key_head + offs_d[None, :]
    dst = block * stride_k_block + within * stride_k_tok + heads[:, None] * stride_k_head
    tl.store(k_cache_ptr + dst + offs_d[None, :], tl.load(key_ptr + src, mask=mask), mask=mask)
    src = tok * stride_value_tok + heads[:, None] * stride_value_head + offs_d[None, :]
    dst = block * stride_v_block + within * stride_v_tok + heads[:, None] * stride_v_head
    tl.store(v_cache_ptr + dst + offs_d[None, :], tl.load(value_ptr + src, mask=mask), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch the KV write (see :func:`reference.write_kv_reference`).

    Positions past the pool are not checked (that needs a device sync); the reference checks.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, strided views.
        slot_mapping: ``[num_tokens]`` int32/int64 flat positions; negative skips the token.

    Raises:
        ValueError: bad shapes, dtypes, strides or devices.
    """
    check_kv_write_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    head_dim_pad = next_power_of_2(head_dim)
    heads_per_program = min(
        next_power_of_2(num_kv_heads), max(1, _ELEMENTS_PER_PROGRAM // head_dim_pad)
    )
    kernel = kernel_for(_write_kv_kernel, key.device)
    kernel[(num_tokens, cdiv(num_kv_heads, heads_per_program))](
        k_cache, v_cache, key, value, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PER_PROGRAM=heads_per_program,
        num_warps=4,
    )
