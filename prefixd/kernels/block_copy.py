"""Block copy (Triton): move whole blocks between or within pools on one device.

A block is one contiguous chunk (block-major pools), so copying block ``src_slots[i]`` of one
pool to block ``dst_slots[i]`` of another is a flat copy of ``block_numel`` elements at
``slot * stride_block``. Gathering a block list into a contiguous staging buffer and scattering
it back are the same copy with ``arange`` on one side: a tier move is gather on the device, one
bulk transfer, scatter on the host (or the reverse). The kernel moves bits, so any dtype works
(fp8 included): tensors are reinterpreted as integers of the same width.

Grid ``(num_pairs, cdiv(block_numel, BLOCK))``; offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixd.kernels.checks import check_copy_args
from prefixd.kernels.launch import as_bits, cdiv, kernel_for

# Elements per program: 16 KiB of fp16 per program keeps a GPU's loads wide and programs few.
_BLOCK = 8192


@triton.jit
def _copy_blocks_kernel(
    # pointers
    src_ptr,  # [num_src_blocks, ...] contiguous blocks
    dst_ptr,  # [num_dst_blocks, ...] contiguous blocks
    src_slots_ptr,  # [num_pairs] int32/int64
    dst_slots_ptr,  # [num_pairs] int32/int64
    # strides
    stride_src_block,
    stride_dst_block,
    # sizes
    block_numel,
    # meta-parameters
    BLOCK: tl.constexpr,  # elements per program
):
    pair = tl.program_id(0)
    src_slot = tl.load(src_slots_ptr + pair).to(tl.int64)
    dst_slot = tl.load(dst_slots_ptr + pair).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    x = tl.load(src_ptr + src_slot * stride_src_block + offs, mask=mask)
    tl.store(dst_ptr + dst_slot * stride_dst_block + offs, x, mask=mask)


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Launch the block copy ``src[src_slots[i]] -> dst[dst_slots[i]]`` (one device).

    Slots are not range-checked (that needs a device sync); the reference checks.

    Args:
        src, dst: pools ``[num_blocks, ...]`` with equal block shapes and dtypes, each block one
            contiguous chunk, on the same device.
        src_slots, dst_slots: ``[n]`` int32/int64 on that device.

    Raises:
        ValueError: mismatched pools or slot lists, pools on different devices, or an element
            size with no integer twin.
    """
    check_copy_args(src, dst, src_slots, dst_slots)
    if src.device != dst.device:
        raise ValueError(
            f"the Triton block copy needs both pools on one device, got {src.device} and "
            f"{dst.device}; use the reference (index_select + copy) across devices"
        )
    num_pairs = src_slots.shape[0]
    block_numel = src[0].numel()
    if num_pairs == 0 or block_numel == 0:
        return
    kernel = kernel_for(_copy_blocks_kernel, src.device)
    kernel[(num_pairs, cdiv(block_numel, _BLOCK))](
        as_bits(src), as_bits(dst), src_slots, dst_slots,
        src.stride(0), dst.stride(0),
        block_numel,
        BLOCK=_BLOCK,
        num_warps=8,
    )
