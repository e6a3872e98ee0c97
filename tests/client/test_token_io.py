"""kernels/token_io: a token range through a block table into and out of a block-major pool."""

import random

import pytest
import torch

from prefixd.kernels.token_io import MAX_RUNS, read_tokens, slot_runs, write_tokens

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
    """More runs than MAX_RUNS go through one index_copy_ / index_select; same bytes."""
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
