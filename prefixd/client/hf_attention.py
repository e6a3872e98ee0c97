"""Paged attention as a transformers attention function (``AttentionInterface``).

A model whose ``config._attn_implementation`` is :data:`ATTENTION_NAME` keeps no K/V of its own:
each attention layer writes the step's new K/V into the pool through the slot mapping, then runs
:func:`prefixd.kernels.paged_attention` over the pool through the block tables (decode for one
new token per sequence, extend otherwise). Where the K/V live comes in as a
:class:`PagedKVContext`, by one of two routes:

- passed to the model's ``forward`` as ``paged_kv=...`` (transformers hands unknown keyword
  arguments down to the attention function); call it with ``use_cache=False`` and explicit
  ``position_ids``: the pool is the cache;
- offered by a cache (``prefixd.client.hf_cache.PrefixdCache``) from its ``update`` with
  :func:`offer`, which the attention call of the same layer that follows takes
  (``generate`` passes no per-step keyword argument a cache could set).

A context may carry rows of different lengths (``for_rows``): row ``r`` of the batch brings only
its last ``new_counts[r]`` columns as queries (left padding and tokens already cached are not
attended for), and only tokens at or past ``write_from[r]`` are written (a committed block is
never stored into).

Belongs with the client: it is the transformers side of the client's mapped pool.
transformers is imported only by :func:`register_hf_attention`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from prefixd.kernels import BACKENDS, layer_kv, paged_attention, write_kv

log = logging.getLogger(__name__)

ATTENTION_NAME = "prefixd_paged"

_offered = threading.local()  # .pending: (context, layer_idx) offered by a cache's update


def offer(context: "PagedKVContext", layer_idx: int) -> None:
    """Hand ``context`` to the attention call of layer ``layer_idx`` that follows on this thread.

    NOTE: transformers calls ``past_key_values.update(k, v, layer_idx)`` and then the attention
    function, in the same layer, on the same thread, with no way for the cache to add a keyword
    argument; so the cache offers its step's context here and the attention function takes it
    (once: a context is never reused by a later call, and one offered for another layer is
    refused).
    """
    _offered.pending = (context, layer_idx)


def _take(layer_idx: int) -> "PagedKVContext | None":
    pending = getattr(_offered, "pending", None)
    _offered.pending = None
    if pending is None:
        return None
    context, offered_for = pending
    if offered_for != layer_idx:
        raise ValueError(f"a paged KV context offered for layer {offered_for} reached layer {layer_idx}")
    return context


@dataclasses.dataclass(frozen=True)
class PagedKVContext:
    """Where one forward pass reads and writes K/V: a pool, block tables and this step's slots.

    The forward's input is ``[num_seqs, query_len]`` (one batch row per sequence). Row ``r``
    brings its last ``n_r`` columns as new tokens (``query_start_loc`` packs them); the other
    columns (left padding, tokens already in the pool) are computed by the model but not attended
    for, and their output is zero. Build it with :meth:`for_step` (every row brings all
    ``query_len`` columns) or :meth:`for_rows`, once per forward (not per layer).

    Invariants: ``len(slot_mapping) == query_start_loc[-1]`` (one slot per packed new token, -1
    where its K/V must not be written); ``query_index`` is None exactly when every row brings all
    ``query_len`` columns; ``seq_lens[r] >= n_r``.

    Attributes:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 pool slots.
        seq_lens: ``[num_seqs]`` int32 tokens per sequence after this step.
        slot_mapping: ``[num_new_tokens]`` int64 flat pool positions of the new tokens (-1: skip).
        query_start_loc: ``[num_seqs + 1]`` int32 offsets of each sequence's new tokens.
        query_len: columns of the forward's input.
        max_seq_len: ``max(seq_lens)``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        query_index: ``[num_new_tokens]`` int64 positions of the new tokens in the flattened
            ``[num_seqs * query_len]`` input, or None when all of them are new.
        max_query_len: ``max(n_r)``.
    """

    pool: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    query_len: int
    max_seq_len: int
    backend: str = "auto"
    query_index: torch.Tensor | None = None
    max_query_len: int = 0

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
        if query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {query_len}")
        num_seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
        return cls.for_rows(pool, block_tables, seq_lens, [query_len] * max(num_seqs, 0), query_len,
                            backend=backend)

    @classmethod
    def for_rows(
        cls,
        pool: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        new_counts: list[int],
        query_len: int,
        write_from: list[int] | None = None,
        backend: str = "auto",
    ) -> "PagedKVContext":
        """The context of a step where row ``r`` brings its last ``new_counts[r]`` columns.

        Args:
            pool, block_tables, seq_lens, backend: as :meth:`for_step`.
            new_counts: new tokens of each row, each in ``1 .. query_len`` and ``<= seq_lens[r]``;
                they are tokens ``seq_lens[r] - new_counts[r] .. seq_lens[r]`` of sequence ``r``.
            query_len: columns of the forward's input.
            write_from: per row, the first token whose K/V is written (earlier new tokens are
                attended for but their K/V, already in the pool, is left as it is); None: all.

        Raises:
            ValueError: as :meth:`for_step`, or counts out of range.
        """
        layer_kv(pool, 0)  # checks the pool's shape
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
            raise ValueError(
                f"block_tables must be [num_seqs, max_blocks] and seq_lens [num_seqs], got "
                f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
            )
        num_seqs = block_tables.shape[0]
        if len(new_counts) != num_seqs or not all(1 <= n <= query_len for n in new_counts):
            raise ValueError(f"new_counts must be {num_seqs} counts in [1, {query_len}], got {new_counts}")
        block_size = pool.shape[3]
        lens = seq_lens.to(torch.int64).cpu()
        counts = torch.tensor(new_counts, dtype=torch.int64)
        min_len, max_len = int((lens - counts).min()), int(lens.max())
        if min_len < 0 or max_len > block_size * block_tables.shape[1]:
            raise ValueError(
                f"seq_lens must be in [{query_len}, {block_size * block_tables.shape[1]}] "
                f"(query_len, block_size x block-table columns), got [{int(lens.min())}, {max_len}]"
            )
        device = pool.device
        row = torch.repeat_interleave(torch.arange(num_seqs), counts)           # [T]
        starts = torch.cumsum(counts, 0) - counts                               # [S]
        step = torch.arange(len(row)) - starts[row]                             # 0 .. n_r - 1
        positions = lens[row] - counts[row] + step                              # token index
        tables = block_tables.to(torch.int64).cpu()
        slots = tables[row, positions // block_size] * block_size + positions % block_size
        if write_from is not None:
            slots = torch.where(positions >= torch.tensor(write_from, dtype=torch.int64)[row], slots, -1)
        uniform = all(n == query_len for n in new_counts)
        query_index = None if uniform else row * query_len + (query_len - counts[row]) + step
        loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
        loc[1:] = torch.cumsum(counts, 0)
        return cls(
            pool=pool,
            block_tables=block_tables.to(device=device, dtype=torch.int32),
            seq_lens=seq_lens.to(device=device, dtype=torch.int32),
            slot_mapping=slots.to(device),
            query_start_loc=loc.to(device),
            query_len=query_len,
            max_seq_len=max_len,
            backend=backend,
            query_index=None if query_index is None else query_index.to(device),
            max_query_len=max(new_counts),
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
        paged_kv: the step's :class:`PagedKVContext`, passed to the model's forward; when None,
            the context a cache offered for this layer (:func:`offer`).
        **kwargs: other transformers keyword arguments, ignored.

    Returns:
        ``(attn_output [batch, query_len, num_q_heads, head_dim], None)``.

    Raises:
        ValueError: no context, dropout, a transformers cache in use, or a batch or
            query length that does not match the context.
    """
    if paged_kv is None:
        paged_kv = _take(module.layer_idx)
    if paged_kv is None:
        raise ValueError(
            f"attention {ATTENTION_NAME!r} needs paged_kv=PagedKVContext.for_step(...) "
            "passed to the model's forward, or past_key_values=PrefixdCache(...)"
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
    q = query.transpose(1, 2).reshape(rows, num_q_heads, head_dim)
    k = key.transpose(1, 2).reshape(rows, num_kv_heads, head_dim)
    v = value.transpose(1, 2).reshape(rows, num_kv_heads, head_dim)
    index = paged_kv.query_index
    if index is not None:
        q, k, v = q.index_select(0, index), k.index_select(0, index), v.index_select(0, index)
    write_kv(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, paged_kv.slot_mapping,
             backend=paged_kv.backend)
    q = q.to(k_cache.dtype)
    if paged_kv.max_query_len == 1:
        out = paged_attention(
            q, k_cache, v_cache, paged_kv.block_tables, paged_kv.seq_lens,
            scale=scaling, max_seq_len=paged_kv.max_seq_len, backend=paged_kv.backend,
        )
    else:
        out = paged_attention(
            q, k_cache, v_cache, paged_kv.block_tables, paged_kv.seq_lens,
            query_start_loc=paged_kv.query_start_loc, scale=scaling,
            max_query_len=paged_kv.max_query_len, backend=paged_kv.backend,
        )
    out = out.to(query.dtype)
    if index is not None:
        out = torch.zeros((rows, num_q_heads, head_dim), dtype=out.dtype, device=out.device).index_copy_(0, index, out)
    return out.view(batch, query_len, num_q_heads, head_dim), None


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
