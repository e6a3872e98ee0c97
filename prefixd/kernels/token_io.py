"""A token range's KV into and out of a block-major pool, through a block table.

The pool is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; a caller hands and
gets the KV of ``n`` consecutive tokens as ``[num_layers, 2, n, num_kv_heads, head_dim]``
(DESIGN.md "Client library"). Token ``t`` of a sequence is row ``t % block_size`` of block
``block_table[t // block_size]``. Pure tensor code, no checks of who may write what: the engine
(``prefixd.engine.kv_io``) and the client's mapped path (``prefixd.client.mapped``) each check
ownership first, then call these.

NOTE: the whole blocks of a range move as a strided view of the caller's tensor
(``[k, num_layers, 2, block_size, ...]``, no staging copy): one ``copy_`` per run of consecutive
slots, or a single indexed copy when the slots are scattered into many runs (one kernel on a
GPU instead of one per run). A partial block at either end of the range is written in place,
row by row: only its token rows change, the rest of the block is left as it was (the
read-modify-write happens in the pool, without reading the block out).

NOTE (CPU copies stay in the calling thread): between CPU tensors every copy is numpy's
(``copy_into``: ``np.copyto`` over the same memory, bit for bit; dtypes numpy lacks move as
integers of their size), not torch's ``copy_``, which splits a copy this size over its OpenMP
team: a memory-bound copy over threads that wait on each other at a barrier is several times
slower on a loaded host, in bursts, where numpy's single-thread copy stays steady. Scattered
blocks are written by one numpy indexed assignment (``pool[slots] = src``: no temporary) and
read run by run (an indexed read would make a temporary). A CUDA pool keeps torch's copies (one kernel per run, or one indexed copy).
The vLLM connector's block copies made the same choice (``prefixd.client.vllm.block_transfer``).

NOTE (the numpy path takes numpy arrays): ``write_tokens_np`` / ``read_tokens_np`` do the CPU
copies on ``numpy_view``s, so a caller that keeps its pool's view (the client's ``MappedPool``)
makes a torch call or two per tensor of a write or read, where this path made ~15 (slices,
``unflatten``, ``permute`` and a numpy view per side of each run's copy). A torch call on
caches that other work has just used costs tens of microseconds (the dispatcher's code and
data, cold), and the copies of a client are made between its own model's work.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_RUNS = 16  # above this many runs of consecutive slots, one indexed copy moves the blocks
ALIAS_GAP = 32  # dst - src (mod 4 KiB) in 1 .. ALIAS_GAP - 1 stalls memmove: copy_into's NOTE
# numpy has no bfloat16 (nor the float8 kinds): those move as integers of the same size
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_NUMPY_HAS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
              torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
              torch.uint8: np.uint8, torch.bool: np.bool_}


def check_kv(layout, kv) -> int:
    """The token count of ``kv``, after checking it is ``[num_layers, 2, n, num_kv_heads,
    head_dim]`` of ``layout``'s dtype (``layout`` is a ``prefixd.api.KVLayout``).

    Raises:
        ValueError: another type, shape or dtype (the message gives the expected one).
    """
    want = (layout.num_layers, 2, "n", layout.num_kv_heads, layout.head_dim)
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv must be a torch.Tensor {want} of {layout.dtype}, got {type(kv).__name__}")
    shape = tuple(kv.shape)
    if len(shape) != 5 or shape[:2] != want[:2] or shape[3:] != want[3:]:
        raise ValueError(f"kv must have shape {want} (num_layers, K/V, tokens, num_kv_heads, "
                         f"head_dim), got {shape}")
    if kv.dtype != layout.torch_dtype():
        raise ValueError(f"kv must be of the layout's dtype {layout.dtype}, got {kv.dtype}")
    return shape[2]


def write_tokens(pool: torch.Tensor, block_table, start: int, kv: torch.Tensor, block_size: int) -> None:
    """``pool`` rows of tokens ``start .. start + n`` (through ``block_table``, a list of int
    slots) = ``kv`` (cast to the pool's dtype if it differs)."""
    kv = kv.to(device=pool.device, dtype=pool.dtype)
    if _numpy_copies(pool, kv):
        write_tokens_np(numpy_view(pool), block_table, start, numpy_view(kv), block_size)
        return
    n = kv.shape[2]
    for off, slot, row, k in _partial_blocks(block_table, start, n, block_size):
        pool[slot, :, :, row:row + k].copy_(kv[:, :, off:off + k])
    off, slots, spans = _whole_runs(block_table, start, n, block_size)
    if slots:
        src = _torch_by_block(kv, off, len(slots), block_size)
        if len(spans) > MAX_RUNS:
            pool.index_copy_(0, torch.tensor(slots, dtype=torch.long, device=pool.device), src)
            return
        for i, slot, k in spans:
            pool[slot:slot + k].copy_(src[i:i + k])


def write_tokens_np(pool: np.ndarray, block_table, start: int, kv: np.ndarray, block_size: int) -> None:
    """``write_tokens`` between numpy arrays over CPU memory (``numpy_view``), in this thread."""
    n = kv.shape[2]
    for off, slot, row, k in _partial_blocks(block_table, start, n, block_size):
        copy_np(pool[slot, :, :, row:row + k], kv[:, :, off:off + k])
    off, slots, spans = _whole_runs(block_table, start, n, block_size)
    if slots:
        src = _by_block(kv, off, len(slots), block_size)
        if len(spans) > MAX_RUNS:
            pool[slots] = src
            return
        for i, slot, k in spans:
            copy_np(pool[slot:slot + k], src[i:i + k])


def read_tokens(pool: torch.Tensor, block_table, start: int, n: int, block_size: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """A ``[num_layers, 2, n, num_kv_heads, head_dim]`` tensor holding the KV of tokens
    ``start .. start + n``: ``out`` (any device, the pool's dtype; reusing one spares a fresh
    allocation's page faults on every read) or a new tensor on the pool's device."""
    _, num_layers, _, _, num_kv_heads, head_dim = pool.shape
    shape = (num_layers, 2, n, num_kv_heads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    elif tuple(out.shape) != shape or out.dtype != pool.dtype:
        raise ValueError(f"out must be {shape} of {pool.dtype}, got {tuple(out.shape)} of {out.dtype}")
    if _numpy_copies(pool, out):
        read_tokens_np(numpy_view(pool), block_table, start, n, block_size, numpy_view(out))
        return out
    for off, slot, row, k in _partial_blocks(block_table, start, n, block_size):
        out[:, :, off:off + k].copy_(pool[slot, :, :, row:row + k])
    off, slots, spans = _whole_runs(block_table, start, n, block_size)
    if slots:
        dst = _torch_by_block(out, off, len(slots), block_size)
        if len(spans) > MAX_RUNS:
            dst.copy_(pool.index_select(0, torch.tensor(slots, dtype=torch.long, device=pool.device)))
        else:
            for i, slot, k in spans:
                dst[i:i + k].copy_(pool[slot:slot + k])
    return out


def read_tokens_np(pool: np.ndarray, block_table, start: int, n: int, block_size: int,
                   out: np.ndarray) -> None:
    """``read_tokens`` into ``out`` between numpy arrays over CPU memory (``numpy_view``),
    run by run (an indexed read of scattered blocks would make a temporary)."""
    for off, slot, row, k in _partial_blocks(block_table, start, n, block_size):
        copy_np(out[:, :, off:off + k], pool[slot, :, :, row:row + k])
    off, slots, spans = _whole_runs(block_table, start, n, block_size)
    if slots:
        dst = _by_block(out, off, len(slots), block_size)
        for i, slot, k in spans:
            copy_np(dst[i:i + k], pool[slot:slot + k])


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` (same dtype; ``src`` broadcast to ``dst``'s shape; any strides):
    numpy's copy in this thread between CPU tensors (see the NOTE), torch's ``copy_`` else.

    NOTE (4 KiB aliasing): ``np.copyto`` moves each contiguous run with glibc's ``memmove``,
    which copies a run of 2 KiB or more with ``rep movsb``; on an AMD EPYC (Zen 3, glibc
    2.36) that stalls when the destination sits 1-31 bytes past the source
    modulo 4 KiB: 4 MiB in 4 KiB runs took 2.5-6.6 ms instead of 0.2-0.3 (runs up to 256 KiB
    alike; flat copies of 1 MiB and more take another path and never stall). Pool blocks are
    page-aligned and malloc's buffers 16-byte aligned, so one buffer in 256 lands there: a
    mapped read into an ``out`` that numpy made 16 bytes into a fresh mapping hit it every
    time, and so would a daemon's ReadKV gathers for as long as its heap reused a reply
    buffer at such an address. Such a pair is copied by a ufunc instead (``np.positive`` of
    the integer views: the same bits, vector stores, no ``memmove``): 0.5-1 ms for the same
    4 MiB, slower than an unstalled ``memmove`` in 4 KiB runs, so only in that window.
    """
    if _numpy_copies(dst, src):
        copy_np(numpy_view(dst), numpy_view(src))
    else:
        dst.copy_(src)


def copy_np(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` between numpy arrays of one dtype (``copy_into``'s NOTE: a pair
    ``memmove`` would stall on is copied by a ufunc, which needs integer arrays)."""
    gap = dst.__array_interface__["data"][0] - src.__array_interface__["data"][0]
    if 0 < gap % 4096 < ALIAS_GAP:
        np.positive(src, out=dst)
    else:
        np.copyto(dst, src, casting="no")


def _numpy_copies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a copy between ``a`` and ``b`` goes through numpy (both on the CPU, one dtype)."""
    return a.device.type == "cpu" and b.device.type == "cpu" and a.dtype == b.dtype


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of the CPU tensor ``t``'s memory (same strides; an autograd graph is
    left behind), as integers of its element size: bit for bit, for dtypes numpy lacks too."""
    if t.dtype in _NUMPY_HAS:
        a = t.detach().numpy() if t.requires_grad else t.numpy()
    else:
        a = t.detach().view(_AS_INT[t.element_size()]).numpy()
    return a.view(_NP_INT[a.itemsize])


def new_cpu_tensor(shape, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A new CPU tensor of ``shape`` and ``dtype`` and its ``numpy_view``, allocated by numpy
    (one torch call where ``torch.empty`` then ``numpy_view`` make two: the NOTE above)."""
    native = _NUMPY_HAS.get(dtype)
    if native is not None:
        a = np.empty(shape, native)
        return torch.from_numpy(a), a.view(_NP_INT[a.itemsize])
    a = np.empty(shape, _NP_INT[dtype.itemsize])
    return torch.from_numpy(a).view(dtype), a


def _by_block(kv: np.ndarray, off: int, nb: int, block_size: int) -> np.ndarray:
    """Tokens ``off .. off + nb * block_size`` of ``kv`` (``[L, 2, n, H, D]``) as blocks
    ``[nb, L, 2, block_size, H, D]``: a view (splitting one axis never copies)."""
    num_layers, two, _, num_kv_heads, head_dim = kv.shape
    rows = kv[:, :, off:off + nb * block_size]
    return rows.reshape(num_layers, two, nb, block_size, num_kv_heads, head_dim).transpose(2, 0, 1, 3, 4, 5)


def slot_runs(slots) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots as ``(position, first_slot, length)``."""
    out: list[tuple[int, int, int]] = []
    i, stop = 0, len(slots)
    while i < stop:
        j = i + 1
        while j < stop and slots[j] == slots[j - 1] + 1:
            j += 1
        out.append((i, slots[i], j - i))
        i = j
    return out


def _whole_runs(block_table, start: int, n: int, block_size: int) -> tuple[int, list, list]:
    """``(offset in the range, slots, their runs)`` of the blocks the range covers whole
    (``slot_runs`` of the slots; no slots: none)."""
    first, off, nb = _whole_blocks(start, n, block_size)
    slots = block_table[first:first + nb] if nb else []
    return off, slots, slot_runs(slots)


def _torch_by_block(kv: torch.Tensor, off: int, nb: int, block_size: int) -> torch.Tensor:
    """``_by_block`` of a tensor: tokens ``off .. off + nb * block_size`` as blocks (a view)."""
    return kv[:, :, off:off + nb * block_size].unflatten(2, (nb, block_size)).permute(2, 0, 1, 3, 4, 5)


def _whole_blocks(start: int, n: int, block_size: int) -> tuple[int, int, int]:
    """``(first block, its offset in the range, how many)`` of the blocks the range covers whole."""
    first = -(-start // block_size)
    end = (start + n) // block_size
    if end <= first:
        return first, 0, 0
    return first, first * block_size - start, end - first


def _partial_blocks(block_table, start: int, n: int, block_size: int) -> list[tuple[int, int, int, int]]:
    """``(offset in the range, slot, first row, rows)`` of each block the range covers only in
    part: at most two, the one it starts in and the one it ends in."""
    if not n:
        return []
    end = start + n
    out = []
    for b in sorted({start // block_size, (end - 1) // block_size}):
        lo, hi = max(start, b * block_size), min(end, (b + 1) * block_size)
        if hi - lo < block_size:
            out.append((lo - start, block_table[b], lo - b * block_size, hi - lo))
    return out
