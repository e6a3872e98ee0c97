"""Paged attention as a transformers attention function (``AttentionInterface``).

A model whose ``config._attn_implementation`` is :data:`ATTENTION_NAME` keeps no K/V of its own:
each attention layer writes the step's new K/V into the pool through the slot mapping, then runs
:func:`paged_attention` over the pool through the block tables (decode for one new token per
sequence, extend otherwise). Where the K/V live comes in as a :class:`PagedKVContext` passed to
the model's ``forward`` as ``paged_kv=...``; transformers hands unknown keyword arguments down to
the attention function. Call it without a transformers cache (``use_cache=False``) and with
explicit ``position_ids``: the pool is the cache.

transformers is imported only by :func:`register_hf_attention`, so ``prefixd.kernels`` imports
without it.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from prefixd.kernels.checks import layer_kv
from prefixd.kernels.dispatch import BACKENDS, paged_attention, write_kv

log = logging.getLogger(__name__)

ATTENTION_NAME = "prefixd_paged"


@dataclasses.dataclass(frozen=True)
class PagedKVContext:
    """Where one forward pass reads and writes K/V: a pool, block tables and this step's slots.

    Every sequence of the batch brings ``query_len`` new tokens this step (a prefill chunk or one
    decode token); ``seq_lens`` counts them. Build it with :meth:`for_step`, once per forward
    (not per layer): it computes the slot mapping on the pool's device.

    Attributes:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 pool slots.
        seq_lens: ``[num_seqs]`` int32 tokens per sequence after this step.
        slot_mapping: ``[num_seqs * query_len]`` int64 flat pool positions of the new tokens.
        query_start_loc: ``[num_seqs + 1]`` int32 offsets of each sequence's new tokens.
        query_len: new tokens per sequence this step.
        max_seq_len: ``max(seq_lens)``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
    """

    pool: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    query_len: int
    max_seq_len: int
    backend: str = "auto"

    @classmethod
    def for_step(
        cls,
        pool: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_len: int,
        backend: str = "auto",
    ) -> "PagedKVContext":
        """The context of a step that adds ``query_len`` tokens to each sequence.

        Args:
            pool: the block-major pool.
            block_tables: ``[num_seqs, max_blocks_per_seq]`` covering ``seq_lens``.
            seq_lens: ``[num_seqs]`` lengths after this step, each >= ``query_len``.
            query_len: new tokens per sequence (>= 1).
            backend: ``"auto"``, ``"triton"`` or ``"reference"``.

        Returns:
            The context to pass as ``paged_kv=`` to the model's forward.

        Raises:
            ValueError: a pool that is not 6-D, a bad backend, ``query_len < 1``, lengths shorter
                than ``query_len`` or longer than the block tables cover.
        """
        layer_kv(pool, 0)  # checks the pool's shape
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {query_len}")
        if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
            raise ValueError(
                f"block_tables must be [num_seqs, max_blocks] and seq_lens [num_seqs], got "
                f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
            )
        block_size = pool.shape[3]
        lens = seq_lens.to(torch.int64)
        min_len, max_len = int(lens.min()), int(lens.max())
        if min_len < query_len or max_len > block_size * block_tables.shape[1]:
            raise ValueError(
                f"seq_lens must be in [{query_len}, {block_size * block_tables.shape[1]}] "
                f"(query_len, block_size x block-table columns), got [{min_len}, {max_len}]"
            )
        device = pool.device
        steps = torch.arange(query_len, device=device)
        positions = (lens.to(device)[:, None] - query_len + steps[None, :])  # [num_seqs, q]
        tables = block_tables.to(device=device, dtype=torch.int64)
        slots = tables.gather(1, positions // block_size)
        num_seqs = block_tables.shape[0]
        return cls(
            pool=pool,
            block_tables=block_tables.to(device=device, dtype=torch.int32),
            seq_lens=seq_lens.to(device=device, dtype=torch.int32),
            slot_mapping=(slots * block_size + positions % block_size).flatten(),
            query_start_loc=(
                torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * query_len
            ),
            query_len=query_len,
            max_seq_len=max_len,
            backend=backend,
        )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    paged_kv: PagedKVContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for :data:`ATTENTION_NAME`.

    Args:
        module: the attention module (its ``layer_idx`` picks the pool layer).
        query: ``[batch, num_q_heads, query_len, head_dim]``.
        key, value: ``[batch, num_kv_heads, query_len, head_dim]``: this step's new K/V only.
        attention_mask: ignored; causality comes from positions in the pool.
        dropout: must be 0 (inference only).
        scaling: softmax scale.
        paged_kv: the step's :class:`PagedKVContext`, passed to the model's forward.
        **kwargs: other transformers keyword arguments, ignored.

    Returns:
        ``(attn_output [batch, query_len, num_q_heads, head_dim], None)``.

    Raises:
        ValueError: no ``paged_kv``, dropout, a transformers cache in use, or a batch or
            query length that does not match the context.
    """
    if paged_kv is None:
        raise ValueError(
            f"attention {ATTENTION_NAME!r} needs paged_kv=PagedKVContext.for_step(...) "
            "passed to the model's forward"
        )
    if dropout:
        raise ValueError(f"attention {ATTENTION_NAME!r} is inference only, got dropout={dropout}")
    batch, num_q_heads, query_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[2] != query_len:
        raise ValueError(
            f"key has {key.shape[2]} positions for {query_len} queries: run the model with "
            "use_cache=False (the pool is the cache)"
        )
    if (batch, query_len) != (paged_kv.block_tables.shape[0], paged_kv.query_len):
        raise ValueError(
            f"batch {batch} x query_len {query_len} does not match paged_kv "
            f"({paged_kv.block_tables.shape[0]} x {paged_kv.query_len})"
        )
    k_cache, v_cache = layer_kv(paged_kv.pool, module.layer_idx)
    rows = batch * query_len
    write_kv(
        key.transpose(1, 2).reshape(rows, num_kv_heads, head_dim).to(k_cache.dtype),
        value.transpose(1, 2).reshape(rows, num_kv_heads, head_dim).to(v_cache.dtype),
        k_cache, v_cache, paged_kv.slot_mapping,
        backend=paged_kv.backend,
    )
    q = query.transpose(1, 2).reshape(rows, num_q_heads, head_dim).to(k_cache.dtype)
    if query_len == 1:
        out = paged_attention(
            q, k_cache, v_cache, paged_kv.block_tables, paged_kv.seq_lens,
            scale=scaling, max_seq_len=paged_kv.max_seq_len, backend=paged_kv.backend,
        )
    else:
        out = paged_attention(
            q, k_cache, v_cache, paged_kv.block_tables, paged_kv.seq_lens,
            query_start_loc=paged_kv.query_start_loc, scale=scaling,
            max_query_len=query_len, backend=paged_kv.backend,
        )
    return out.view(batch, query_len, num_q_heads, head_dim).to(query.dtype), None


def register_hf_attention(name: str = ATTENTION_NAME) -> str:
    """Register :func:`paged_attention_forward` with transformers' ``AttentionInterface``.

    Args:
        name: the ``attn_implementation`` name to register.

    Returns:
        ``name``, for ``model.set_attn_implementation(name)``.

    Raises:
        ImportError: transformers is not installed (``pip install prefixd[hf]``).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(name, paged_attention_forward)
    log.debug("registered transformers attention name=%s", name)
    return name
