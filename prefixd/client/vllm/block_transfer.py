"""Whole blocks between vLLM's paged KV tensors and prefixd's mapped pool (pure tensor code).

``views`` are the per-layer block-order views of one worker's vLLM tensors
(``PagedLayout.view``: ``[num_blocks, 2, block_size, heads, head_dim]`` with the worker's
``heads``); ``pool`` is the session's mapped device pool ``[num_slots, num_layers, 2,
block_size, num_kv_heads, head_dim]`` of the whole model; ``shard`` (``shards.Shard``) says
which pool layer each view is and which KV heads the worker holds: a copy touches only that
slice of each block, in place (no gather through one process). vLLM block ``block_ids[i]``
pairs with prefixd slot ``slots[i]``.

NOTE: one ``copy_`` per layer per run of blocks consecutive on both sides (vLLM hands out
consecutive block ids to a new prompt and the daemon consecutive slots, so a prompt is
usually one run). A strided ``copy_`` does the [heads, rows] -> [rows, heads] transpose in one
pass; indexed copies (``index_put_`` of a gathered batch) took 2-3x longer for 5 SmolLM2 blocks
(14.7 MB). Nothing here checks who may write what; the worker side checks
the lease and the daemon's epoch around each call (a mapped store cannot see a restart).

NOTE: the copies are numpy's (``np.copyto`` over the same memory), in the calling thread, not
torch's ``copy_``: torch splits a copy this size over its OpenMP team (vLLM's CPU worker runs
one thread per core), and a memory-bound copy split over threads that wait on each other at a
barrier is several times slower on a loaded host (8 SmolLM2 blocks, 47 MB: 184 ms with
torch's 2 threads, 41 ms with 1, 36 ms with numpy). A TTFT of an external hit pays the load
in full.

NOTE: a large transfer is split by layer over a few Python threads (the caller's and
``COPY_THREADS - 1`` helpers): numpy releases the GIL inside ``copyto``, and a thread that finishes
early just waits on a future, where an OpenMP team spins at a barrier. The transposing copy runs
at about half of memcpy's speed on one core; two threads halve a load beside busy processes
(8 SmolLM2 blocks: 54 ms on one thread, 28-32 ms on two, 34 ms on torch's team), and in vLLM
the load is ~20 ms of a ~400 ms time to first token.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from prefixd.client.vllm.shards import Shard
from prefixd.kernels.token_io import numpy_view

COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))  # memory-bound: a few cores saturate it
SPLIT_BYTES = 4 << 20  # below this a transfer stays on the caller's thread (handoffs cost ~50 us)


def runs(block_ids, slots) -> list[tuple[int, int, int]]:
    """``(first block id, first slot, length)`` of each run where both go up by one."""
    out: list[tuple[int, int, int]] = []
    for b, s in zip(block_ids, slots):
        if out and b == out[-1][0] + out[-1][2] and s == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((b, s, 1))
    return out


def check_pair(pool: torch.Tensor, views, block_ids, slots, shard: Shard | None = None) -> Shard:
    """The shard the copy is for (the whole block when ``shard`` is None).

    Raises:
        ValueError: the pool and the views disagree on a block's shape or dtype, the shard
            names layers or heads the pool lacks, or the id lists differ in length (a
            caller bug: the message says which).
    """
    if len(block_ids) != len(slots):
        raise ValueError(f"{len(block_ids)} vLLM blocks for {len(slots)} prefixd slots")
    if pool.dim() != 6:
        raise ValueError(f"the pool {tuple(pool.shape)} is not [slots, layers, 2, block_size, heads, head_dim]")
    shard = shard or Shard.whole(pool.shape[1], pool.shape[4])
    if len(shard.layers) != len(views) or max(shard.layers, default=-1) >= pool.shape[1] \
            or shard.heads[1] > pool.shape[4]:
        raise ValueError(f"the pool {tuple(pool.shape)} does not hold the {len(views)} layers {shard.layers} "
                         f"and KV heads {shard.heads} of this worker")
    block = (pool.shape[2], pool.shape[3], shard.num_kv_heads, pool.shape[5])
    for view in views:
        if tuple(view.shape[1:]) != block or view.dtype != pool.dtype:
            raise ValueError(f"a vLLM block {tuple(view.shape[1:])} of {view.dtype} is not this worker's slice "
                             f"{block} of a pool block layer {tuple(pool.shape[2:])} of {pool.dtype}")
    return shard


def load_blocks(pool: torch.Tensor, views, block_ids, slots, shard: Shard | None = None) -> None:
    """vLLM blocks ``block_ids`` (every layer of the worker) = its slice of prefixd slots ``slots``."""
    _transfer(pool, views, block_ids, slots, shard, into_vllm=True)


def save_blocks(pool: torch.Tensor, views, block_ids, slots, shard: Shard | None = None) -> None:
    """The worker's slice of prefixd slots ``slots`` = vLLM blocks ``block_ids`` (every layer)."""
    _transfer(pool, views, block_ids, slots, shard, into_vllm=False)


def _transfer(pool: torch.Tensor, views, block_ids, slots, shard: Shard | None, *, into_vllm: bool) -> None:
    if not block_ids or not views:
        return
    shard = check_pair(pool, views, block_ids, slots, shard)
    h0, h1 = shard.heads
    spans = runs(block_ids, slots)
    pairs = []
    for layer, view in zip(shard.layers, views):
        for b, s, k in spans:
            ours, theirs = numpy_view(pool[s:s + k, layer, :, :, h0:h1]), numpy_view(view[b:b + k])
            pairs.append((theirs, ours) if into_vllm else (ours, theirs))
    nbytes = len(block_ids) * views[0][0].numel() * len(views) * pool.element_size()
    shares = min(COPY_THREADS, len(pairs)) if nbytes >= SPLIT_BYTES else 1
    if shares <= 1:
        _copy_all(pairs)
        return
    futures = [_helpers().submit(_copy_all, pairs[i::shares]) for i in range(1, shares)]
    try:
        _copy_all(pairs[0::shares])
    finally:
        for f in futures:  # every copy is done (or failed) before the caller goes on
            f.result()


def _copy_all(pairs) -> None:
    """``dst[...] = src`` for each pair (same shape and dtype, any strides), in this thread."""
    for dst, src in pairs:
        np.copyto(dst, src, casting="no")


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _helpers() -> ThreadPoolExecutor:
    """The copy helpers, made on first use (a process that never copies starts no thread)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="prefixd-copy")
        return _pool
