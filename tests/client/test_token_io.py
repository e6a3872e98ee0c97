"""kernels/token_io: a token range through a block table into and out of a block-major pool."""

import math
import random

import numpy as np
import pytest
import torch

from prefixd.api.tensors import DTYPES
from prefixd.kernels import token_io
from prefixd.kernels.token_io import (MAX_RUNS, copy_into, new_cpu_tensor, numpy_view, read_tokens, slot_runs,
                                     write_tokens)

BS = 4
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 3


def pool(num_blocks=64) -> torch.Tensor:
    return torch.zeros((num_blocks, NUM_LAYERS, 2, BS, NUM_KV_HEADS, HEAD_DIM))


def kv(n, seed=0) -> torch.Tensor:
    return torch.randn((NUM_LAYERS, 2, n, NUM_KV_HEADS, HEAD_DIM), generator=torch.Generator().manual_seed(seed))


def test_slot_runs_finds_maximal_runs_of_consecutive_slots():
    assert slot_runs([5, 6, 7, 2, 9, 10]) == [(0, 5, 3), (3, 2, 1), (4, 9, 2)]
    assert slot_runs([]) == []


@pytest.mark.parametrize("start, n", [(0, 40), (3, 30), (5, 2), (4, 4), (0, 1), (7, 33), (10, 0)])
@pytest.mark.parametrize("scattered", [False, True])
def test_write_then_read_gives_back_the_same_kv(start, n, scattered):
    table = list(range(3, 3 + 12))
    if scattered:
        random.Random(1).shuffle(table)
    p = pool()
    x = kv(n)
    write_tokens(p, table, start, x, BS)
    assert torch.equal(read_tokens(p, table, start, n, BS), x)


def test_token_t_lands_in_row_t_mod_block_size_of_its_blocks_slot():
    p = pool()
    table = [9, 2, 40]
    x = kv(12)
    write_tokens(p, table, 0, x, BS)
    for t in range(12):
        assert torch.equal(p[table[t // BS], :, :, t % BS], x[:, :, t])


def test_a_partial_block_write_leaves_the_blocks_other_rows_alone():
    p = pool()
    table = [7, 8]
    before = torch.full_like(p[7], 3.0)
    p[7] = before
    write_tokens(p, table, 1, kv(2), BS)  # rows 1 and 2 of block 7
    assert torch.equal(p[7, :, :, 0], before[:, :, 0]) and torch.equal(p[7, :, :, 3], before[:, :, 3])
    assert not p[8].any()


def test_many_scattered_runs_take_the_indexed_copy_and_agree():
    """More runs than MAX_RUNS go through one indexed copy (numpy's on the CPU); same bytes."""
    table = list(range(0, 2 * (MAX_RUNS + 4), 2))  # no two slots consecutive
    p = pool(2 * len(table))
    n = len(table) * BS
    x = kv(n, seed=3)
    write_tokens(p, table, 0, x, BS)
    assert len(slot_runs(table)) > MAX_RUNS
    assert torch.equal(read_tokens(p, table, 0, n, BS), x)
    assert not p[1::2].any(), "an odd slot is in no table and must stay untouched"


def test_read_into_a_given_tensor_fills_it_in_place():
    p = pool()
    table = [4, 9, 1]
    x = kv(10, seed=5)
    write_tokens(p, table, 0, x, BS)
    out = torch.full_like(x[:, :, :7], -1.0)
    assert read_tokens(p, table, 2, 7, BS, out) is out
    assert torch.equal(out, x[:, :, 2:9])
    with pytest.raises(ValueError, match="out must be"):
        read_tokens(p, table, 2, 6, BS, out)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table", [list(range(3, 3 + 12)), random.Random(2).sample(range(64), 12),
                                   list(range(0, 2 * (MAX_RUNS + 4), 2))], ids=["run", "shuffled", "scattered"])
def test_round_trips_are_bit_exact_for_every_dtype_partial_blocks_and_scattered_slots(dtype, table):
    """The CPU copies go through numpy, which has no bfloat16 nor float8: each dtype moves as
    an integer of its size, so every bit pattern (NaN payloads included) must come back."""
    dt = getattr(torch, dtype)
    n_blocks = max(table) + 1
    p = torch.zeros((n_blocks, NUM_LAYERS, 2, BS, NUM_KV_HEADS, HEAD_DIM), dtype=dt)
    for start, n in ((0, len(table) * BS), (3, len(table) * BS - 5), (BS + 1, 2)):
        x = kv(n, seed=start).to(dt)
        _bits(x).view(-1)[:24] = torch.arange(232, 256, dtype=torch.uint8)  # NaNs, odd payloads
        write_tokens(p, table, start, x, BS)
        assert torch.equal(_bits(read_tokens(p, table, start, n, BS)), _bits(x))
        out = torch.empty_like(x)
        assert torch.equal(_bits(read_tokens(p, table, start, n, BS, out)), _bits(x))


def test_cpu_copies_stay_off_torchs_thread_team(monkeypatch):
    """Regression (kv.mapped_gbps, kv.rpc_gbps): CPU copies were torch ``copy_`` /
    ``index_copy_`` / ``index_select``, which torch splits over its OpenMP team; on a loaded
    host the team's barriers made a 4 MiB copy take 3.5-8 ms in bursts instead of 0.2."""
    def no_torch_copy(*args, **kwargs):
        raise AssertionError("a CPU copy went through torch's thread team")

    for name in ("copy_", "index_copy_", "index_select"):
        monkeypatch.setattr(torch.Tensor, name, no_torch_copy)
    for table in ([5, 6, 7, 1], list(range(0, 2 * (MAX_RUNS + 4), 2))):
        p = pool(2 * len(table) + 8)
        x = kv(len(table) * BS - 3, seed=9)
        write_tokens(p, table, 1, x, BS)
        got = read_tokens(p, table, 1, x.shape[2], BS)
        assert torch.equal(got, x)


def test_copy_into_falls_back_to_torch_across_dtypes_and_broadcasts():
    dst = torch.zeros(2, 3)
    copy_into(dst, torch.ones(3, dtype=torch.float16))  # another dtype: torch's copy_ casts
    assert dst.tolist() == [[1.0] * 3] * 2
    copy_into(dst, torch.full((3,), 2.0))  # numpy broadcasts like copy_
    assert dst.tolist() == [[2.0] * 3] * 2


def _at_page_offset(nbytes: int, offset: int) -> torch.Tensor:
    """``nbytes`` bytes of a fresh CPU buffer, starting ``offset`` bytes into a 4 KiB page."""
    buf = torch.zeros(nbytes + 2 * 4096, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 4096 + offset
    return buf[start:start + nbytes]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_read_into_a_buffer_16_bytes_past_the_pools_page_offset_skips_memmove(monkeypatch, dtype):
    """Regression (kv.mapped_gbps): with the destination 1-31 bytes past the source modulo
    4 KiB, glibc's memmove (``rep movsb``) stalled on the dev host's CPU: a 4 MiB mapped read
    in 4 KiB runs took 2.5-6.6 ms instead of 0.2-0.3, every time for a numpy-made ``out`` 16
    bytes into its page. Such a pair is copied by a ufunc instead; the bits must not change."""
    dt = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=dt).element_size()
    shape = (16, NUM_LAYERS, 2, BS, NUM_KV_HEADS, HEAD_DIM)
    p = _at_page_offset(math.prod(shape) * itemsize, 0).view(dt).view(shape)
    table = [0, 1, 2, 3]  # one run from the pool's first byte: the base pair is the gap
    x = kv(len(table) * BS, seed=4).to(dt)
    _bits(x).view(-1)[:24] = torch.arange(232, 256, dtype=torch.uint8)  # NaNs, odd payloads
    write_tokens(p, table, 0, x, BS)
    out = _at_page_offset(x.numel() * itemsize, 16).view(dt).view(x.shape)
    memmoves = []
    real_copyto = np.copyto
    monkeypatch.setattr(np, "copyto", lambda *a, **k: memmoves.append(a) or real_copyto(*a, **k))
    read_tokens(p, table, 0, x.shape[2], BS, out)
    assert memmoves == [], "an aliased pair went through np.copyto (memmove)"
    assert torch.equal(_bits(out), _bits(x))
    aligned = _at_page_offset(x.numel() * itemsize, 64).view(dt).view(x.shape)
    read_tokens(p, table, 0, x.shape[2], BS, aligned)  # out of the window: memmove, as before
    assert memmoves and torch.equal(_bits(aligned), _bits(x))


def test_copy_into_an_aliased_pair_still_broadcasts():
    dst = _at_page_offset(4 * 2048, 16).view(torch.float32).view(2, 1024)
    src = _at_page_offset(4 * 1024, 0).view(torch.float32)
    src.copy_(torch.arange(1024.0))
    copy_into(dst, src)
    assert torch.equal(dst, torch.arange(1024.0).expand(2, 1024))


@pytest.mark.parametrize("dtype", DTYPES)
def test_new_cpu_tensor_and_its_numpy_view_share_memory(dtype):
    dt = getattr(torch, dtype)
    t, a = new_cpu_tensor((2, 3, 5), dt)
    assert t.dtype == dt and tuple(t.shape) == (2, 3, 5) == a.shape
    assert a.dtype.kind in "iu" and a.itemsize == t.element_size()
    a[...] = 1
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.itemsize]
    assert torch.equal(t.view(as_int), torch.ones((2, 3, 5), dtype=as_int))


def test_numpy_view_aliases_a_tensor_that_requires_grad():
    t = torch.zeros(4, requires_grad=True)
    a = numpy_view(t)
    a[1] = np.float32(2.5).view(np.int32)
    assert t.detach()[1].item() == 2.5


def test_a_write_across_dtypes_casts_to_the_pools():
    for table in ([5, 6, 7, 1], list(range(0, 2 * (MAX_RUNS + 4), 2))):
        p = pool(2 * len(table) + 8).half()
        x = kv(len(table) * BS - 3, seed=8)
        write_tokens(p, table, 1, x, BS)
        assert torch.equal(read_tokens(p, table, 1, x.shape[2], BS), x.half())


@pytest.mark.parametrize("start, n", [(0, 48), (3, 30), (5, 2)])
@pytest.mark.parametrize("table", [[5, 6, 7, 1, 2, 3, 9, 10, 11, 12, 20, 21],
                                   list(range(0, 2 * (MAX_RUNS + 4), 2))], ids=["runs", "scattered"])
def test_torchs_copies_a_cuda_pool_takes_agree_with_the_numpy_path(monkeypatch, start, n, table):
    """CI has no CUDA: the torch branch (``copy_``, ``index_copy_``, ``index_select``) runs on
    CPU tensors here, with the numpy path switched off, against the numpy path's bytes."""
    x = kv(n, seed=start)
    want = pool(2 * max(table) + 2)
    write_tokens(want, table, start, x, BS)
    monkeypatch.setattr(token_io, "_numpy_copies", lambda a, b: False)
    got = pool(2 * max(table) + 2)
    write_tokens(got, table, start, x, BS)
    assert torch.equal(got, want)
    assert torch.equal(read_tokens(got, table, start, n, BS), x)
    out = torch.full_like(x, -1.0)
    assert read_tokens(got, table, start, n, BS, out) is out and torch.equal(out, x)
