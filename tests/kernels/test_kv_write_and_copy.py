"""The Triton KV write and block copy against their references (bit-exact: they move bits)."""

import pytest
import torch

from prefixd.kernels import gather_blocks, reference, scatter_blocks
from prefixd.kernels.block_copy import copy_blocks
from prefixd.kernels.checks import layer_kv
from prefixd.kernels.kv_write import write_kv
from tests.kernels.paged_factories import make_pool

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "dtype,block_size,num_kv_heads,head_dim",
    [(torch.float32, 16, 2, 64), (torch.float16, 32, 3, 128), (torch.bfloat16, 16, 1, 80)],
)
def test_write_kv_kernel_matches_reference(triton_ready, dtype, block_size, num_kv_heads,
                                           head_dim):
    pool = make_pool(6, block_size, num_kv_heads, head_dim, dtype, triton_ready)
    want = pool.clone()
    g = torch.Generator().manual_seed(3)
    key = torch.randn((9, num_kv_heads, head_dim), generator=g).to(dtype=dtype, device=pool.device)
    value = torch.randn((9, num_kv_heads, head_dim), generator=g).to(dtype=dtype,
                                                                     device=pool.device)
    slots = torch.tensor([0, 1, block_size - 1, block_size, -1, 5 * block_size + 3, 77, 40, -5],
                         device=pool.device)
    write_kv(key, value, *layer_kv(pool, 1), slots)
    reference.write_kv_reference(key, value, *layer_kv(want, 1), slots)
    assert torch.equal(pool, want)


def test_write_kv_kernel_takes_strided_key_and_value(triton_ready):
    """K/V straight from a fused QKV projection are strided views, not contiguous tensors."""
    pool = make_pool(2, 16, 2, 64, torch.float16, triton_ready)
    want = pool.clone()
    qkv = torch.randn(5, 3, 2, 64).to(dtype=torch.float16, device=pool.device)
    slots = torch.arange(5, device=pool.device) * 3
    write_kv(qkv[:, 1], qkv[:, 2], *layer_kv(pool, 0), slots)
    reference.write_kv_reference(qkv[:, 1], qkv[:, 2], *layer_kv(want, 0), slots)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_copy_blocks_kernel_matches_reference(triton_ready, dtype):
    src = make_pool(7, 16, 2, 64, torch.float32, triton_ready, seed=1).to(dtype)
    dst = make_pool(5, 16, 2, 64, torch.float32, triton_ready, seed=2).to(dtype)
    want = dst.clone()
    src_slots = torch.tensor([6, 0, 3], device=src.device)
    dst_slots = torch.tensor([1, 4, 0], dtype=torch.int32, device=src.device)
    copy_blocks(src, dst, src_slots, dst_slots)
    reference.copy_blocks_reference(src, want, src_slots, dst_slots)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


def test_gather_then_scatter_blocks_round_trips_through_staging(triton_ready):
    pool = make_pool(8, 16, 2, 32, torch.float16, triton_ready)
    slots = torch.tensor([7, 2, 5], device=pool.device)
    staged = gather_blocks(pool, slots, backend="triton")
    assert torch.equal(staged, pool[slots])
    other = torch.zeros_like(pool)
    scatter_blocks(staged, other, slots, backend="triton")
    assert torch.equal(other[slots], pool[slots]) and not other[[0, 1, 3, 4, 6]].any()


@pytest.mark.gpu
@needs_cuda
def test_copy_blocks_between_device_and_host_pools():
    dev = make_pool(16, 16, 8, 128, torch.bfloat16, torch.device("cuda"))
    host = torch.zeros((4, *dev.shape[1:]), dtype=dev.dtype).pin_memory()
    from prefixd.kernels import copy_blocks as entry

    entry(dev, host, torch.tensor([3, 9], device="cuda"), torch.tensor([0, 2]))
    assert torch.equal(host[0], dev[3].cpu()) and torch.equal(host[2], dev[9].cpu())
