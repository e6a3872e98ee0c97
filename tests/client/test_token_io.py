"""kernels/token_io: a token range through a block table into and out of a block-major pool."""

import random

import pytest
import torch

from prefixd.api.tensors import DTYPES
from prefixd.kernels.token_io import MAX_RUNS, copy_into, read_tokens, slot_runs, write_tokens

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
