"""Which part of every prefixd block one vLLM worker holds, under tensor and pipeline parallelism
(pure Python; no vLLM import).

A prefixd block is the whole model's KV for ``block_size`` tokens: ``[num_layers, 2,
block_size, num_kv_heads, head_dim]`` with the model's total layers and KV heads. The pool is
keyed by that whole layout, so engines of one model at TP=1, 2 or 4 (and any PP) attach the
same pool and share its blocks. A worker holds a ``Shard`` of it:

- under tensor parallelism, the KV heads of its TP rank: ``[r * H/tp, (r+1) * H/tp)`` when the
  TP size divides the model's KV heads; when there are fewer heads than ranks, vLLM gives
  each head to ``tp / H`` ranks, rank ``r`` holding head ``r // (tp / H)`` (its replicas write
  the same bytes);
- under pipeline parallelism, the layers of its stage: each of its KV layers is the pool layer
  of the layer index in its name (``model.layers.17.self_attn.attn`` is layer 17).

Every worker reads and writes only its slice of a block, in place in the mapped pool; a block
is whole once every shard saved it, which the scheduler side counts (``SaveReport``).
"""

from __future__ import annotations

import dataclasses
import re

_INT = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


@dataclasses.dataclass(frozen=True)
class Shard:
    """One worker's slice of every block.

    ``index`` is the worker among ``num_shards`` (``pp_rank * tp_size + tp_rank``); ``layers``
    the pool layer of each of the worker's KV layers, in its layer order; ``heads`` the
    ``[first, end)`` range of the model's KV heads it holds.

    Invariants: ``0 <= index < num_shards``; ``layers`` distinct and non-negative;
    ``0 <= heads[0] < heads[1]``.
    """

    index: int
    num_shards: int
    layers: tuple[int, ...]
    heads: tuple[int, int]

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_shards:
            raise ValueError(f"shard {self.index} of {self.num_shards}")
        if len(set(self.layers)) != len(self.layers) or any(i < 0 for i in self.layers):
            raise ValueError(f"pool layers {self.layers} must be distinct and non-negative")
        if not 0 <= self.heads[0] < self.heads[1]:
            raise ValueError(f"KV heads {self.heads} are not a range [first, end)")

    @property
    def num_kv_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @classmethod
    def whole(cls, num_layers: int, num_kv_heads: int) -> "Shard":
        """The one shard of an engine without tensor or pipeline parallelism."""
        return cls(0, 1, tuple(range(num_layers)), (0, num_kv_heads))


def head_range(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The ``[first, end)`` KV heads of TP rank ``tp_rank`` (vLLM's split of the KV projection).

    Raises:
        ValueError: a TP size that neither divides the KV heads nor is a multiple of them
            (vLLM refuses such a model too), or a rank out of range.
    """
    if not 0 <= tp_rank < tp_size or total_kv_heads < 1:
        raise ValueError(f"TP rank {tp_rank} of {tp_size} with {total_kv_heads} KV heads")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over tensor parallel size {tp_size}")
        per = total_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % total_kv_heads:
        raise ValueError(f"tensor parallel size {tp_size} is not a multiple of {total_kv_heads} KV heads")
    head = tp_rank // (tp_size // total_kv_heads)
    return head, head + 1


def layer_index(layer_name: str) -> int | None:
    """The layer number in a vLLM attention layer name (``model.layers.3.self_attn.attn`` -> 3),
    or None when the name holds no number or more than one."""
    found = _INT.findall(layer_name)
    return int(found[0]) if len(found) == 1 else None


def pool_layers(layer_names, total_layers: int, pipeline: bool) -> tuple[tuple[int, ...], int]:
    """The pool layer of each name and the number of layers of the pool.

    Without pipeline parallelism the worker holds every layer: the pool has ``len(layer_names)``
    layers in the order of their numbers (the names' order when they hold none). Under it, a
    stage holds some: each name's number is its pool layer, of ``total_layers``.

    Raises:
        ValueError: under pipeline parallelism, a name without one layer number, two names with
            the same, or a number past ``total_layers``.
    """
    names = list(layer_names)
    numbers = [layer_index(n) for n in names]
    if not pipeline:
        if None in numbers or len(set(numbers)) != len(numbers):
            return tuple(range(len(names))), len(names)
        order = sorted(numbers)
        return tuple(order.index(i) for i in numbers), len(names)
    bad = [n for n, i in zip(names, numbers) if i is None or i >= total_layers]
    if bad or len(set(numbers)) != len(numbers):
        raise ValueError(f"pipeline parallelism: the KV layers {bad or names} do not each name one layer "
                         f"number below the model's {total_layers} layers")
    return tuple(numbers), total_layers
