"""Pure-torch references for every kernel: the ground truth in tests and the CPU path.

Each function takes exactly the arguments of its Triton launcher and computes in fp32. Unlike
the launchers these read tensor values, so they also check them (lengths within the block
table, slots within the pool) and raise ``ValueError`` instead of reading out of bounds.

NOTE: the decode reference is also what a host without a GPU serves with, so it is written to
be fast on CPU rather than obvious. It gathers whole pages with one ``index_select`` per chunk of
sequences (pages are contiguous ``[block_size, num_kv_heads, head_dim]`` rows of a layer), sized so
a chunk stays in the last-level cache, then runs ``K @ q^T``, a last-dim softmax and ``P @ V`` per
sequence on exactly its length (no mask). Gathering the whole batch at once is ~2x slower: the
gathered copy goes to DRAM and is streamed back. The gather lands in a per-thread workspace that
is reused across calls (a fresh 8 MiB buffer costs more in page faults than the matmuls that
read it).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from prefixd.kernels.checks import (
    check_attention_args,
    check_copy_args,
    check_kv_write_args,
)
from prefixd.kernels.launch import as_bits

# Bytes of gathered K+V per chunk of sequences in the decode reference (fits a server LLC).
_CHUNK_BYTES = 16 << 20

_local = threading.local()


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable flat buffer of at least ``numel`` elements (one per thread, dtype, device)."""
    cache = _local.__dict__.setdefault("buffers", {})
    buf = cache.get((dtype, device))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        cache[(dtype, device)] = buf
    return buf[:numel]


def _check_lens(lens: list[int], block_size: int, max_blocks: int) -> None:
    for i, n in enumerate(lens):
        if not 1 <= n <= block_size * max_blocks:
            raise ValueError(
                f"seq_lens[{i}] = {n} must be in [1, {block_size * max_blocks}] "
                f"(block_size {block_size} x {max_blocks} block-table columns)"
            )


def _pages(
    block_tables: torch.Tensor, rows: slice, num_pages: list[int], num_blocks: int
) -> torch.Tensor:
    """Block-table rows cut to the pages in use; unused columns point at slot 0 (masked later)."""
    width = max(num_pages)
    ids = block_tables[rows, :width].to(torch.int64)
    used = torch.arange(width) < torch.tensor(num_pages)[:, None]
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bool(bad.any()):
        raise ValueError(f"block_tables holds slots outside the pool of {num_blocks} blocks")
    return torch.where(used, ids, torch.zeros_like(ids))


def paged_decode_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    Args:
        query: ``[num_seqs, num_q_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided views).
        block_tables: ``[num_seqs, max_blocks_per_seq]``; logical block i -> pool slot.
        seq_lens: ``[num_seqs]`` tokens in each sequence (the query is the last one).
        scale: softmax scale; ``head_dim ** -0.5`` when None.
        out: optional output tensor like ``query``.

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: bad shapes/dtypes/strides, lengths outside the block table, slots outside
            the pool.
    """
    s = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, out=out)
    lens = seq_lens.tolist()
    _check_lens(lens, s.block_size, s.max_blocks_per_seq)
    scale = s.head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(query) if out is None else out
    page_bytes = 2 * s.block_size * s.num_kv_heads * s.head_dim * query.element_size()
    k_rows = k_cache.flatten(1)  # [num_blocks, block_size * kv_heads * head_dim] view
    v_rows = v_cache.flatten(1)
    num_pages = [-(-n // s.block_size) for n in lens]
    ids_all = _pages(block_tables.cpu(), slice(0, s.num_seqs), num_pages, s.num_blocks)
    ids_all = ids_all.to(query.device)
    # Scale folded into q once; [num_seqs, kv_heads, head_dim, group] for K @ q^T below.
    q_all = (query.float() * scale).view(s.num_seqs, s.num_kv_heads, s.query_group, s.head_dim)
    q_all = q_all.transpose(2, 3)
    result = torch.empty(
        (s.num_seqs, s.num_kv_heads, s.query_group, s.head_dim), device=query.device
    )
    start = 0
    while start < s.num_seqs:
        stop, budget = start + 1, _CHUNK_BYTES - num_pages[start] * page_bytes
        while stop < s.num_seqs and budget >= num_pages[stop] * page_bytes:
            budget -= num_pages[stop] * page_bytes
            stop += 1
        width = max(num_pages[start:stop])
        ids = ids_all[start:stop, :width].flatten()
        kv = _workspace(2 * ids.numel() * k_rows.shape[1], query.dtype, query.device)
        kv = kv.view(2, ids.numel(), -1)
        torch.index_select(k_rows, 0, ids, out=kv[0])
        torch.index_select(v_rows, 0, ids, out=kv[1])
        kv = kv.view(2, stop - start, -1, s.num_kv_heads, s.head_dim)  # [2, n, tokens, kv, d]
        for i, b in enumerate(range(start, stop)):
            # NOTE: K @ q^T ([tokens, d] x [d, group] per head) and P @ V are the GEMM shapes
            # BLAS streams fastest; q @ K^T (M = group) is ~1.6x slower on x86 MKL.
            k = kv[0, i, : lens[b]].transpose(0, 1).float()  # [kv, len, d]
            v = kv[1, i, : lens[b]].transpose(0, 1).float()
            scores = torch.matmul(k, q_all[b]).transpose(1, 2)  # [kv, group, len] view
            # NOTE: softmax over the last dim: over a middle dim torch's CPU kernel is ~10x
            # slower (and on a VM often waits ~8 ms for an idle OpenMP worker to wake).
            result[b] = torch.matmul(torch.softmax(scores, dim=-1), v)  # [kv, group, d]
        start = stop
    out.copy_(result.view(s.num_seqs, s.num_q_heads, s.head_dim))
    return out


def paged_extend_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a chunk of new tokens per sequence over a cached prefix and each other.

    Sequence b's new tokens are ``query[query_start_loc[b]:query_start_loc[b + 1]]``; with
    ``n`` of them and ``cached = seq_lens[b] - n``, new token i sits at position ``cached + i``
    and attends to positions ``[0, cached + i]``. Their K/V must already be in the pool.

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]``, sequences packed back to back.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided views).
        block_tables: ``[num_seqs, max_blocks_per_seq]``.
        seq_lens: ``[num_seqs]`` total tokens per sequence, cached prefix plus new tokens.
        query_start_loc: ``[num_seqs + 1]`` offsets of each sequence's tokens in ``query``.
        scale: softmax scale; ``head_dim ** -0.5`` when None.
        out: optional output tensor like ``query``.

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: bad shapes/dtypes/strides, offsets that are not increasing or do not end at
            ``num_tokens``, more new tokens than ``seq_lens``, slots outside the pool.
    """
    s = check_attention_args(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out=out
    )
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    _check_lens(lens, s.block_size, s.max_blocks_per_seq)
    if starts[0] != 0 or starts[-1] != s.num_tokens:
        raise ValueError(f"query_start_loc must run from 0 to {s.num_tokens}, got {starts}")
    scale = s.head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(query) if out is None else out
    tables = block_tables.cpu()
    for b in range(s.num_seqs):
        n, total = starts[b + 1] - starts[b], lens[b]
        if not 0 <= n <= total:
            raise ValueError(f"sequence {b} has {n} new tokens but seq_lens {total}")
        if n == 0:
            continue
        ids = _pages(tables, slice(b, b + 1), [-(-total // s.block_size)], s.num_blocks)
        ids = ids.to(query.device).flatten()
        k = k_cache.index_select(0, ids).flatten(0, 1)[:total].float()  # [total, kv, dim]
        v = v_cache.index_select(0, ids).flatten(0, 1)[:total].float()
        q = query[starts[b] : starts[b + 1]].float().transpose(0, 1)  # [q_heads, n, dim]
        q_pos = torch.arange(total - n, total, device=query.device)
        visible = torch.arange(total, device=query.device)[None, :] <= q_pos[:, None]
        # NOTE: torch's fused SDPA (float32, grouped heads: q head h reads kv head h // group,
        # the layout's order) is several times faster on CPU than scores/softmax/matmul
        # written out, and agrees with it to 1e-7.
        o = F.scaled_dot_product_attention(q[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=visible,
                                           scale=scale, enable_gqa=s.query_group > 1)
        out[starts[b] : starts[b + 1]] = o[0].transpose(0, 1).to(out.dtype)
    return out


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V to flat pool position ``slot_mapping[t]`` (negative = skip).

    The flat position is ``slot * block_size + offset``.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided views).
        slot_mapping: ``[num_tokens]`` int32/int64.

    Raises:
        ValueError: bad shapes/dtypes/strides, or a position past the end of the pool.
    """
    check_kv_write_args(key, value, k_cache, v_cache, slot_mapping)
    num_blocks, block_size = k_cache.shape[:2]
    pos = slot_mapping.to(torch.int64)
    keep = pos >= 0
    pos = pos[keep]
    if pos.numel() and int(pos.max()) >= num_blocks * block_size:
        raise ValueError(
            f"slot_mapping position {int(pos.max())} past the pool's {num_blocks * block_size}"
        )
    blocks, offsets = pos // block_size, pos % block_size
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]


def copy_blocks_reference(
    src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Copy whole blocks ``src[src_slots[i]] -> dst[dst_slots[i]]`` (any devices).

    Args:
        src, dst: pools ``[num_blocks, ...]`` with the same block shape and dtype; each block
            one contiguous chunk.
        src_slots, dst_slots: ``[n]`` int32/int64 on the devices of ``src`` and ``dst``.

    Raises:
        ValueError: mismatched pools, slots out of range, or a destination slot listed twice.
    """
    check_copy_args(src, dst, src_slots, dst_slots)
    for name, slots, pool in (("src_slots", src_slots, src), ("dst_slots", dst_slots, dst)):
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= pool.shape[0]):
            raise ValueError(f"{name} out of range for a pool of {pool.shape[0]} blocks")
    if torch.unique(dst_slots).numel() != dst_slots.numel():
        raise ValueError("dst_slots lists a slot twice: the result would depend on order")
    if src_slots.numel():
        blocks = as_bits(src).index_select(0, src_slots.to(torch.int64))
        as_bits(dst).index_copy_(0, dst_slots.to(torch.int64), blocks.to(dst.device))
