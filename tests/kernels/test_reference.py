"""The pure-torch references against a float64 token-by-token oracle (wide, cheap sweeps)."""

import itertools

import pytest
import torch
from tests.kernels.paged_factories import (
    TOLERANCES,
    decode_oracle,
    extend_oracle,
    make_decode_batch,
    make_extend_batch,
)

from prefixd.kernels import reference
from prefixd.kernels.checks import layer_kv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = list(itertools.product([64, 128], [16, 32], [1, 4, 8]))  # head_dim, block_size, group


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,block_size,group", SHAPES)
def test_decode_reference_matches_oracle(dtype, head_dim, block_size, group):
    lens = [1, block_size + 3, 5 * block_size, 700]  # one token, ragged, exact pages, long
    q, k, v, tables, seq_lens = make_decode_batch(
        lens, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
        dtype=dtype, device="cpu",
    )
    got = reference.paged_decode_reference(q, k, v, tables, seq_lens)
    want = decode_oracle(q, k, v, tables, seq_lens)
    torch.testing.assert_close(got.double(), want, **TOLERANCES[dtype])


def test_decode_reference_chunks_a_large_batch_like_one_sequence_at_a_time(monkeypatch):
    """Chunking by cache budget must not change results (chunks of 1 vs of many sequences)."""
    lens = [3, 40, 17, 64, 1, 90, 33]
    q, k, v, tables, seq_lens = make_decode_batch(
        lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device="cpu",
    )
    many = reference.paged_decode_reference(q, k, v, tables, seq_lens)
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 1)
    one = reference.paged_decode_reference(q, k, v, tables, seq_lens)
    torch.testing.assert_close(one, many, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,block_size,group", SHAPES)
def test_extend_reference_matches_oracle(dtype, head_dim, block_size, group):
    lens, new = [7, block_size + 9, 3 * block_size, 300], [7, 4, block_size, 41]
    q, k, v, tables, seq_lens, starts = make_extend_batch(
        lens, new, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device="cpu",
    )
    got = reference.paged_extend_reference(q, k, v, tables, seq_lens, starts)
    want = extend_oracle(q, k, v, tables, seq_lens, starts)
    torch.testing.assert_close(got.double(), want, **TOLERANCES[dtype])


def test_extend_reference_with_one_new_token_equals_decode():
    lens = [9, 33, 64]
    q, k, v, tables, seq_lens = make_decode_batch(
        lens, num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32,
        device="cpu",
    )
    starts = torch.arange(4, dtype=torch.int32)
    ext = reference.paged_extend_reference(q, k, v, tables, seq_lens, starts)
    dec = reference.paged_decode_reference(q, k, v, tables, seq_lens)
    torch.testing.assert_close(ext, dec, atol=1e-6, rtol=1e-6)


def test_write_kv_reference_puts_each_token_at_its_slot_and_skips_negative():
    pool = torch.zeros(4, 2, 2, 16, 2, 8)
    k_cache, v_cache = layer_kv(pool, 1)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reference.write_kv_reference(key, value, k_cache, v_cache, torch.tensor([35, -1, 0]))
    assert torch.equal(pool[2, 1, 0, 3], key[0]) and torch.equal(pool[2, 1, 1, 3], value[0])
    assert torch.equal(pool[0, 1, 0, 0], key[2]) and torch.equal(pool[0, 1, 1, 0], value[2])
    assert int((pool != 0).sum()) == 2 * 2 * 2 * 8  # two tokens, K and V, nothing else
    assert not pool[:, 0].any()  # the other layer untouched


def test_copy_blocks_reference_moves_whole_blocks():
    src = torch.randn(5, 2, 2, 4, 2, 8)
    dst = torch.zeros(3, 2, 2, 4, 2, 8)
    reference.copy_blocks_reference(src, dst, torch.tensor([4, 0]), torch.tensor([0, 2]))
    assert torch.equal(dst[0], src[4]) and torch.equal(dst[2], src[0]) and not dst[1].any()


@pytest.mark.parametrize(
    "lens,error",
    [([0], "seq_lens\\[0\\] = 0"), ([16 * 9], "must be in \\[1, 128\\]")],
)
def test_decode_reference_rejects_lengths_outside_the_block_table(lens, error):
    q, k, v, tables, _ = make_decode_batch(
        [16], num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device="cpu",
    )
    tables = torch.zeros((1, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match=error):
        reference.paged_decode_reference(q, k, v, tables, torch.tensor(lens, dtype=torch.int32))


def test_decode_reference_rejects_slots_outside_the_pool():
    q, k, v, tables, lens = make_decode_batch(
        [20], num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device="cpu",
    )
    tables[0, 1] = k.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        reference.paged_decode_reference(q, k, v, tables, lens)


def test_extend_reference_rejects_bad_query_start_loc():
    q, k, v, tables, lens, starts = make_extend_batch(
        [10, 20], [2, 3], num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device="cpu",
    )
    with pytest.raises(ValueError, match="run from 0 to 5"):
        reference.paged_extend_reference(q, k, v, tables, lens, starts + 1)


def test_extend_reference_rejects_more_new_tokens_than_the_sequence_has():
    q, k, v, tables, lens, starts = make_extend_batch(
        [10, 2], [2, 3], num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device="cpu",
    )
    with pytest.raises(ValueError, match="sequence 1 has 3 new tokens but seq_lens 2"):
        reference.paged_extend_reference(q, k, v, tables, lens, starts)


def test_write_kv_reference_rejects_a_position_past_the_pool():
    k_cache, v_cache = layer_kv(torch.zeros(2, 1, 2, 16, 1, 8), 0)
    key = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="past the pool's 32"):
        reference.write_kv_reference(key, key, k_cache, v_cache, torch.tensor([32]))


@pytest.mark.parametrize(
    "src_slots,dst_slots,error",
    [([5], [0], "src_slots out of range"), ([0], [-1], "dst_slots out of range"),
     ([0, 1], [2, 2], "lists a slot twice")],
)
def test_copy_blocks_reference_rejects_bad_slots(src_slots, dst_slots, error):
    src, dst = torch.zeros(5, 8), torch.zeros(3, 8)
    with pytest.raises(ValueError, match=error):
        reference.copy_blocks_reference(src, dst, torch.tensor(src_slots), torch.tensor(dst_slots))
