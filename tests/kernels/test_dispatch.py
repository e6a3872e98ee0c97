"""The entry points pick Triton on CUDA and the reference elsewhere, unless told otherwise."""

import subprocess
import sys

import torch

import prefixd.kernels as kernels
from prefixd.kernels import reference
from tests.kernels.paged_factories import TOLERANCES, make_decode_batch, make_extend_batch


def test_auto_backend_uses_the_reference_on_cpu(monkeypatch):
    calls = []
    real = reference.paged_decode_reference
    monkeypatch.setattr(reference, "paged_decode_reference",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v, tables, lens = make_decode_batch(
        [5, 9], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
        dtype=torch.float32, device="cpu",
    )
    kernels.paged_attention(q, k, v, tables, lens)
    assert calls == [1]


def test_triton_backend_on_cpu_runs_the_interpreter_and_agrees(triton_ready):
    q, k, v, tables, lens, starts = make_extend_batch(
        [12, 30], [3, 30], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float16, device=triton_ready,
    )
    got = kernels.paged_attention(q, k, v, tables, lens, query_start_loc=starts,
                                  backend="triton")
    want = kernels.paged_attention(q, k, v, tables, lens, query_start_loc=starts,
                                   backend="reference")
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float16])


def test_importing_prefixd_kernels_imports_neither_triton_nor_transformers():
    code = (
        "import sys, prefixd.kernels; "
        "print('triton' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
