"""The kernels' public entry points: each picks Triton or the pure-torch reference.

``backend="auto"`` (the default) runs Triton on CUDA tensors and the reference elsewhere (a host
without a GPU serves from the reference, which is written to be fast on CPU). ``"triton"`` forces
the kernels: compiled on CUDA, or under Triton's interpreter on CPU when the process imported
triton with ``TRITON_INTERPRET=1`` (tests). ``"reference"`` forces the reference, which also
checks values (lengths, slot ranges) the kernels trust.

Triton is imported only when a kernel is about to run, so ``import prefixd.kernels`` stays cheap
for clients that never attend.
"""

from __future__ import annotations

import torch

from prefixd.kernels import reference

BACKENDS = ("auto", "triton", "reference")


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return device.type == "cuda"
    return backend == "triton"


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Paged attention over one layer of a block-major pool: decode or extend.

    Decode (``query_start_loc is None``): one query token per sequence, the last of its
    ``seq_lens[b]`` tokens. Extend: ``query`` packs each sequence's new tokens, located by
    ``query_start_loc``; their K/V are already in the pool at ``[seq_len - n, seq_len)`` and
    they attend to the cached prefix and causally to each other.

    Args:
        query: ``[num_seqs, num_q_heads, head_dim]`` (decode) or
            ``[num_tokens, num_q_heads, head_dim]`` (extend).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` strided views of
            the pool, from ``layer_kv(pool, layer)``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32/int64 pool slots.
        seq_lens: ``[num_seqs]`` int32/int64 tokens per sequence, new ones included.
        query_start_loc: ``[num_seqs + 1]`` offsets into ``query`` (extend); None for decode.
        scale: softmax scale; ``head_dim ** -0.5`` when None.
        out: optional output like ``query``.
        max_seq_len: upper bound of ``seq_lens`` (decode; spares the Triton path a sync).
        max_query_len: upper bound of new tokens per sequence (extend; spares a sync).
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see the module docstring).

    Returns:
        The attention output, shaped like ``query``, in its dtype.

    Raises:
        ValueError: bad shapes, dtypes, strides, devices or backend; with the reference also
            out-of-range lengths or slots.
    """
    if _use_triton(backend, query.device):
        if query_start_loc is None:
            from prefixd.kernels.decode import paged_decode

            return paged_decode(
                query, k_cache, v_cache, block_tables, seq_lens,
                scale=scale, out=out, max_seq_len=max_seq_len,
            )
        from prefixd.kernels.extend import paged_extend

        return paged_extend(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
            scale=scale, out=out, max_query_len=max_query_len,
        )
    if query_start_loc is None:
        return reference.paged_decode_reference(
            query, k_cache, v_cache, block_tables, seq_lens, scale=scale, out=out
        )
    return reference.paged_extend_reference(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, out=out
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Write tokens' K/V into one layer of a pool at flat positions ``slot * block_size + off``.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` strided views.
        slot_mapping: ``[num_tokens]`` int32/int64 flat positions; negative skips a token.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Raises:
        ValueError: bad shapes, dtypes, strides, devices or backend; with the reference also
            positions past the pool.
    """
    if _use_triton(backend, key.device):
        from prefixd.kernels.kv_write import write_kv as launch

        return launch(key, value, k_cache, v_cache, slot_mapping)
    return reference.write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Copy whole blocks ``src[src_slots[i]] -> dst[dst_slots[i]]``.

    ``"auto"`` uses Triton only when both pools are on the same CUDA device; across devices
    (a tier move) it is one ``index_select`` and one ``index_copy_``.

    Args:
        src, dst: pools ``[num_blocks, ...]`` with equal block shapes and dtypes; each block one
            contiguous chunk.
        src_slots, dst_slots: ``[n]`` int32/int64, on the devices of ``src`` and ``dst``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Raises:
        ValueError: mismatched pools or slot lists, bad backend; with the reference also slots
            out of range or a destination slot listed twice.
    """
    if _use_triton(backend, src.device) and (backend == "triton" or dst.device == src.device):
        from prefixd.kernels.block_copy import copy_blocks as launch

        return launch(src, dst, src_slots, dst_slots)
    return reference.copy_blocks_reference(src, dst, src_slots, dst_slots)


def gather_blocks(
    pool: torch.Tensor, slots: torch.Tensor, *, out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Gather blocks ``pool[slots]`` into a contiguous ``[len(slots), ...]`` staging tensor.

    Args:
        pool: ``[num_blocks, ...]`` with contiguous blocks.
        slots: ``[n]`` int32/int64 slot ids on the pool's device.
        out: optional ``[n, ...]`` destination (e.g. pinned host memory for a tier move).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        ``out``, block i holding ``pool[slots[i]]``.

    Raises:
        ValueError: as :func:`copy_blocks`.
    """
    if out is None:
        out = torch.empty((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    order = torch.arange(slots.shape[0], device=out.device)
    copy_blocks(pool, out, slots, order, backend=backend)
    return out


def scatter_blocks(
    blocks: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, *, backend: str = "auto"
) -> None:
    """Scatter staged blocks back: ``pool[slots[i]] = blocks[i]``.

    Args:
        blocks: ``[n, ...]`` staged blocks.
        pool: ``[num_blocks, ...]`` with contiguous blocks.
        slots: ``[n]`` int32/int64 destination slot ids on the pool's device.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Raises:
        ValueError: as :func:`copy_blocks`.
    """
    order = torch.arange(blocks.shape[0], device=blocks.device)
    copy_blocks(blocks, pool, order, slots, backend=backend)
