"""The Triton extend kernel against the reference (interpreted on CPU, compiled on CUDA)."""

import itertools

import pytest
import torch

from prefixd.kernels import reference
from prefixd.kernels.extend import paged_extend
from tests.kernels.paged_factories import TOLERANCES, make_extend_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# dtype, head_dim, block_size, query group, seq_lens, new tokens per sequence
# (no cached prefix, a prefix, a chunk longer than a tile, a sequence with nothing new)
CASES = [
    (torch.float32, 64, 16, 1, [5, 37, 70], [5, 3, 40]),
    (torch.float16, 128, 32, 4, [1, 45], [1, 20]),
    (torch.bfloat16, 64, 16, 8, [30, 19], [9, 0]),
    (torch.bfloat16, 128, 32, 1, [90], [70]),
]


def _check(dtype, head_dim, block_size, group, lens, new, device):
    q, k, v, tables, seq_lens, starts = make_extend_batch(
        lens, new, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device,
    )
    got = paged_extend(q, k, v, tables, seq_lens, starts)
    want = reference.paged_extend_reference(q, k, v, tables, seq_lens, starts)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype,head_dim,block_size,group,lens,new", CASES,
                         ids=[f"{c[0]}-d{c[1]}-bs{c[2]}-g{c[3]}" for c in CASES])
def test_extend_kernel_matches_reference(triton_ready, dtype, head_dim, block_size, group, lens,
                                         new):
    _check(dtype, head_dim, block_size, group, lens, new, triton_ready)


def test_extend_kernel_writes_into_out_with_a_custom_scale(triton_ready):
    q, k, v, tables, lens, starts = make_extend_batch(
        [20, 9], [4, 9], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=triton_ready,
    )
    out = torch.empty_like(q)
    got = paged_extend(q, k, v, tables, lens, starts, out=out, scale=0.2, max_query_len=9)
    assert got is out
    want = reference.paged_extend_reference(q, k, v, tables, lens, starts, scale=0.2)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype,head_dim,block_size,group",
    list(itertools.product([torch.float32, torch.float16, torch.bfloat16], [64, 128], [16, 32],
                           [1, 4, 8])),
)
def test_extend_kernel_matches_reference_at_full_size(dtype, head_dim, block_size, group):
    _check(dtype, head_dim, block_size, group, [1, 700, 4100, 8192], [1, 300, 4, 2048],
           torch.device("cuda"))
