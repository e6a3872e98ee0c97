"""Where K and V of each token live in a KV tensor vLLM registers with a connector, found from
its shape and strides; and a view of it in prefixd's block order, with no copy.

vLLM hands a connector one tensor per attention layer (``register_kv_caches``). Two forms:

- **4-D fused** (vLLM 0.32's per-layer view): logical axes ``[num_blocks, num_kv_heads,
  block_size, 2 * head_dim]`` (``[B, H, N, C]``), the physical order in the strides. K and V
  share the content axis C, and how they share it is not in the shape: the GPU backends
  (flash_attn, triton, flex) split C per token (K = ``C[:D]``, V = ``C[D:]``: ``"columns"``),
  while the CPU backend (``CPU_ATTN``) views the same memory as ``[B, H, 2N, D]`` and takes the
  first N rows of a head's block as K and the next N as V (``"rows"``). vLLM reports both as
  the same layout (``LBHNC``); that is the misreport LMCache PR #4268 ran into, and why the
  split is a parameter chosen by the backend's name (``split_for_backend``) while everything
  else is read from the tensor.
- **5-D split** (older backends): a K/V axis of size 2 first or second: ``[2, B, N, H, D]``,
  ``[2, B, H, N, D]`` or ``[B, 2, N, H, D]``.

``find_layout`` returns a ``PagedLayout``: the strides of one view ``[num_blocks, 2,
block_size, num_kv_heads, head_dim]`` over the same storage, which is exactly a layer of one
prefixd pool block (``[num_layers, 2, block_size, num_kv_heads, head_dim]``), so a block moves
between the two with one indexed copy per layer (``block_transfer.py``).

NOTE: where two axes have the same size (``num_kv_heads == block_size``, or ``num_blocks ==
2``) the shape cannot tell them apart; the logical order vLLM documents for the form is
taken (``[B, H, N, C]`` for 4-D, K/V first and then ``[N, H, D]`` for 5-D). The round-trip
test through vLLM's own cache write and attention (tests/vllm/test_connector_vllm.py) is what
proves the choice for the backend that runs here.
"""

from __future__ import annotations

import dataclasses

import torch

ROWS = "rows"        # CPU_ATTN: a head's block holds N rows of K, then N rows of V
COLUMNS = "columns"  # GPU backends: a token's content holds D of K, then D of V
_SPLITS = (ROWS, COLUMNS)
_ROWS_BACKENDS = ("CPU_ATTN",)


class LayoutError(ValueError):
    """A registered KV tensor whose shape or strides fit no known form; the connector then
    serves misses for the whole model (the message says what was expected)."""


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """One layer's KV tensor as prefixd's block order: ``view(t)`` is ``[num_blocks, 2,
    block_size, num_kv_heads, head_dim]`` over ``t``'s storage.

    Invariants: ``strides`` has 5 entries in elements of the tensor's dtype; ``form`` says
    which form it was found in (``"fused-rows"``, ``"fused-columns"``, ``"split"``) for the log.
    """

    form: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    strides: tuple[int, int, int, int, int]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The block-order view of ``tensor`` (the one this layout was found from, or one of
        the same shape and strides); writes through it land in ``tensor``."""
        return tensor.as_strided(self.shape, self.strides, tensor.storage_offset())


def split_for_backend(backend_name: str) -> str:
    """How a fused content axis holds K and V for the attention backend ``backend_name``
    (vLLM's ``AttentionBackend.get_name()``)."""
    return ROWS if backend_name.upper() in _ROWS_BACKENDS else COLUMNS


def find_layout(shape, strides, *, num_kv_heads: int, head_dim: int, block_size: int,
                fused_split: str = ROWS) -> PagedLayout:
    """The ``PagedLayout`` of a tensor of ``shape`` and ``strides`` (elements).

    Args:
        num_kv_heads, head_dim, block_size: what vLLM's KV cache spec says the layer holds.
        fused_split: ``"rows"`` or ``"columns"``, for a 4-D fused tensor (``split_for_backend``).
    Raises:
        LayoutError: no form fits (the message gives the shape and what was expected).
    """
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
    if fused_split not in _SPLITS:
        raise LayoutError(f"fused_split must be one of {_SPLITS}, got {fused_split!r}")
    if len(shape) != len(strides):
        raise LayoutError(f"shape {shape} and strides {strides} differ in length")
    want = f"num_kv_heads={num_kv_heads} block_size={block_size} head_dim={head_dim}"
    if len(shape) == 4:
        return _fused(shape, strides, num_kv_heads, head_dim, block_size, fused_split, want)
    if len(shape) == 5:
        return _split(shape, strides, num_kv_heads, head_dim, block_size, want)
    raise LayoutError(f"a KV tensor of shape {shape} is neither 4-D [blocks, heads, block_size, "
                      f"2*head_dim] nor 5-D with a K/V axis of 2 ({want})")


def _heads_and_rows(pair, pair_strides, num_kv_heads, block_size, heads_first: bool, shape, want):
    """(stride of the heads axis, stride of the token-row axis) of two middle axes."""
    a, b = pair
    first = (num_kv_heads, block_size) if heads_first else (block_size, num_kv_heads)
    if (a, b) == first:
        sa, sb = pair_strides
        return (sa, sb) if heads_first else (sb, sa)
    if (b, a) == first:
        sa, sb = pair_strides
        return (sb, sa) if heads_first else (sa, sb)
    raise LayoutError(f"KV tensor of shape {shape}: its middle axes {pair} are not heads and "
                      f"token rows ({want})")


def _fused(shape, strides, num_kv_heads, head_dim, block_size, split, want) -> PagedLayout:
    num_blocks, _, _, content = shape
    if content != 2 * head_dim:
        raise LayoutError(f"4-D KV tensor of shape {shape}: the last axis must be 2 * head_dim = "
                          f"{2 * head_dim} (K and V fused), got {content} ({want})")
    s_block, s_content = strides[0], strides[3]
    s_head, s_row = _heads_and_rows(shape[1:3], strides[1:3], num_kv_heads, block_size, True, shape, want)
    if split == COLUMNS:
        kv = (s_block, head_dim * s_content, s_row, s_head, s_content)
    else:
        # CPU_ATTN views [B, H, N, 2D] as [B, H, 2N, D]: that merge needs the rows of a head's
        # block to follow each other, which its kernels' .view() would refuse otherwise.
        if s_row != content * s_content:
            raise LayoutError(f"4-D KV tensor of shape {shape} strides {strides}: a K/V split by rows "
                              f"needs token rows {content * s_content} elements apart, got {s_row}")
        kv = (s_block, block_size * head_dim * s_content, head_dim * s_content, s_head, s_content)
    return PagedLayout(f"fused-{split}", num_blocks, block_size, num_kv_heads, head_dim, kv)


def _split(shape, strides, num_kv_heads, head_dim, block_size, want) -> PagedLayout:
    if shape[0] == 2:
        kv_axis, block_axis = 0, 1
    elif shape[1] == 2:
        kv_axis, block_axis = 1, 0
    else:
        raise LayoutError(f"5-D KV tensor of shape {shape} has no K/V axis of size 2 first or second ({want})")
    if shape[4] != head_dim:
        raise LayoutError(f"5-D KV tensor of shape {shape}: the last axis must be head_dim={head_dim} ({want})")
    s_head, s_row = _heads_and_rows(shape[2:4], strides[2:4], num_kv_heads, block_size, False, shape, want)
    kv = (strides[block_axis], strides[kv_axis], s_row, s_head, strides[4])
    return PagedLayout("split", shape[block_axis], block_size, num_kv_heads, head_dim, kv)
