"""The Triton decode kernel against the reference (interpreted on CPU, compiled on CUDA).

Under the interpreter each loop step costs milliseconds, so the CPU cases are a hand-picked
cover of dtypes x head dims x block sizes x GQA ratios x lengths rather than their product; the
``gpu`` tests run the product at full sizes.
"""

import itertools

import pytest
import torch

from prefixd.kernels import reference
from prefixd.kernels.decode import paged_decode
from tests.kernels.paged_factories import TOLERANCES, make_decode_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# dtype, head_dim, block_size, query group, seq_lens (1, ragged, several loop steps)
CASES = [
    (torch.float32, 64, 16, 1, [1, 17, 50]),
    (torch.float16, 128, 32, 4, [1, 33, 100]),
    (torch.bfloat16, 64, 32, 8, [5, 64, 31]),
    (torch.bfloat16, 128, 16, 4, [200]),
    (torch.float16, 64, 16, 8, [1]),
    (torch.float32, 128, 32, 1, [130, 2]),
]


def _check(dtype, head_dim, block_size, group, lens, device, **kwargs):
    q, k, v, tables, seq_lens = make_decode_batch(
        lens, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
        dtype=dtype, device=device,
    )
    got = paged_decode(q, k, v, tables, seq_lens, **kwargs)
    want = reference.paged_decode_reference(q, k, v, tables, seq_lens)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype,head_dim,block_size,group,lens", CASES,
                         ids=[f"{c[0]}-d{c[1]}-bs{c[2]}-g{c[3]}" for c in CASES])
def test_decode_kernel_matches_reference(triton_ready, dtype, head_dim, block_size, group, lens):
    _check(dtype, head_dim, block_size, group, lens, triton_ready)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_kernel_split_k_matches_reference(triton_ready, dtype):
    """Three splits of 128 keys; the 1-token sequence leaves two splits empty (weight 0)."""
    _check(dtype, 64, 16, 4, [1, 150, 300], triton_ready, num_splits=3)


def test_decode_kernel_reads_int64_block_tables_and_writes_into_out(triton_ready):
    q, k, v, tables, lens = make_decode_batch(
        [40, 7], num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
        dtype=torch.float32, device=triton_ready,
    )
    out = torch.empty_like(q)
    got = paged_decode(q, k, v, tables.long(), lens.long(), out=out, scale=0.3, max_seq_len=40)
    assert got is out
    want = reference.paged_decode_reference(q, k, v, tables, lens, scale=0.3)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


def test_decode_kernel_returns_empty_for_an_empty_batch(triton_ready):
    q, k, v, tables, lens = make_decode_batch(
        [4], num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device=triton_ready,
    )
    assert paged_decode(q[:0], k, v, tables[:0], lens[:0]).shape == (0, 2, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype,head_dim,block_size,group",
    list(itertools.product([torch.float32, torch.float16, torch.bfloat16], [64, 128], [16, 32],
                           [1, 4, 8])),
)
def test_decode_kernel_matches_reference_at_full_size(dtype, head_dim, block_size, group):
    lens = [1, 1000, 4097, 32768]
    _check(dtype, head_dim, block_size, group, lens, torch.device("cuda"))
