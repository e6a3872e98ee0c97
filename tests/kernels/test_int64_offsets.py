"""Offsets into a pool past 2**31 elements (a normal pool on a large GPU) are computed in int64.

The pool here is 4 GiB of fp16 (2**31 + 2**18 elements) allocated with ``torch.empty``, so only
the few blocks the test writes are ever backed by memory. Slots at the top of the pool have
``slot * stride_block > 2**31``: a kernel that multiplied in int32 would wrap to a negative
offset and read or write outside the pool. Under the interpreter that is a segfault, so the CPU
check runs in a subprocess and reports a crash as a failure instead of killing pytest.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import torch
    from prefixd.kernels import copy_blocks, layer_kv, paged_attention, write_kv
    device = torch.device({device!r})
    block_size, heads, head_dim, layers = 16, 2, 64, 1
    block_numel = layers * 2 * block_size * heads * head_dim
    num_blocks = 2**31 // block_numel + 64
    pool = torch.empty((num_blocks, layers, 2, block_size, heads, head_dim),
                       dtype=torch.float16, device=device)
    assert pool.numel() > 2**31
    top = [num_blocks - 1, num_blocks - 5]
    assert top[1] * pool.stride(0) > 2**31
    k_cache, v_cache = layer_kv(pool, 0)
    g = torch.Generator().manual_seed(0)
    n = 20
    key = torch.randn((n, heads, head_dim), generator=g).half().to(device)
    value = torch.randn((n, heads, head_dim), generator=g).half().to(device)
    tables = torch.tensor([top], dtype=torch.int32, device=device)
    pos = torch.arange(n, device=device)
    slots = tables[0].long()[pos // block_size] * block_size + pos % block_size
    write_kv(key, value, k_cache, v_cache, slots, backend="triton")
    assert torch.equal(k_cache[top[0], :16], key[:16]) and torch.equal(v_cache[top[1], :4], value[16:])
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    q = torch.randn((1, 8, head_dim), generator=g).half().to(device)
    got = paged_attention(q, k_cache, v_cache, tables, lens, backend="triton")
    want = paged_attention(q, k_cache, v_cache, tables, lens, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    qx = torch.randn((5, 8, head_dim), generator=g).half().to(device)
    starts = torch.tensor([0, 5], dtype=torch.int32, device=device)
    got = paged_attention(qx, k_cache, v_cache, tables, lens, query_start_loc=starts,
                          backend="triton")
    want = paged_attention(qx, k_cache, v_cache, tables, lens, query_start_loc=starts,
                           backend="reference")
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    copy_blocks(pool, pool, torch.tensor([top[0]], device=device),
                torch.tensor([num_blocks - 2], device=device), backend="triton")
    assert torch.equal(pool[num_blocks - 2], pool[top[0]])
    print("int64 offsets ok")
    """
)


def test_kernels_address_a_pool_past_2_31_elements_on_cpu():
    """Regression guard: slot ids and strides must be cast to int64 before they multiply."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(device="cpu")], env=env, cwd=REPO, capture_output=True,
        text=True, timeout=300,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "int64 offsets ok" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_address_a_pool_past_2_31_elements_on_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(device="cuda")], env=env, cwd=REPO, capture_output=True,
        text=True, timeout=300,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
