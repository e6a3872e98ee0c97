"""Paged decode attention over the block-major pool vs SDPA over the same K/V made contiguous.

Prints one JSON object. The pool holds one layer, ``[num_blocks, 1, 2, block_size, kv_heads,
head_dim]``; each sequence's blocks are scattered over it in random order, as a cache that has
run for a while leaves them. SDPA gets the very same K/V already gathered into contiguous
``[batch, kv_heads, context, head_dim]`` tensors (``enable_gqa``), i.e. what attention costs
when no paging is involved; ``decode.ratio_vs_sdpa`` is paged / contiguous (lower is better).

The two are timed in alternating rounds so that noise from other processes on the machine
lands on both. The paged path is ``prefixd.kernels.paged_attention`` with its default backend:
Triton on CUDA, the pure-torch reference on CPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from prefixd.kernels import layer_kv, paged_attention  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
        dtype: str, device: str, rounds: int, seed: int = 0) -> dict:
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    pages = -(-context // block_size)
    num_blocks = batch * pages + 8
    pool = torch.randn((num_blocks, 1, 2, block_size, kv_heads, head_dim), generator=g)
    pool = pool.to(dtype=dt, device=dev)
    k_cache, v_cache = layer_kv(pool, 0)
    tables = torch.randperm(num_blocks, generator=g)[: batch * pages].view(batch, pages)
    tables = tables.to(dtype=torch.int32, device=dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    query = torch.randn((batch, q_heads, head_dim), generator=g).to(dtype=dt, device=dev)
    flat = tables.long().flatten()
    k_dense = k_cache[flat].view(batch, pages * block_size, kv_heads, head_dim)[:, :context]
    v_dense = v_cache[flat].view(batch, pages * block_size, kv_heads, head_dim)[:, :context]
    k_dense = k_dense.transpose(1, 2).contiguous()
    v_dense = v_dense.transpose(1, 2).contiguous()
    q4 = query[:, :, None, :]

    def paged():
        return paged_attention(query, k_cache, v_cache, tables, lens, max_seq_len=context)

    def sdpa():
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, enable_gqa=True)

    err = (paged().float() - sdpa()[:, :, 0].float()).abs().max().item()
    times = {"paged": [], "sdpa": []}
    for _ in range(2):  # warm-up (allocator, workspace, kernel compile)
        paged(), sdpa()
    for _ in range(rounds):
        for name, fn in (("paged", paged), ("sdpa", sdpa)):
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times[name].append((time.perf_counter() - t0) * 1e6)
    paged_us, sdpa_us = statistics.median(times["paged"]), statistics.median(times["sdpa"])
    kv_bytes = 2 * batch * context * kv_heads * head_dim * pool.element_size()
    return {
        "bench": "attention",
        "params": {
            "batch": batch, "context": context, "num_q_heads": q_heads,
            "num_kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size,
            "dtype": dtype, "device": device, "layers": 1, "rounds": rounds,
            "block_order": "random permutation of pool slots",
        },
        "env": {
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
        },
        "decode": {
            "paged_median_us": round(paged_us, 1),
            "paged_p99_us": round(_p99(times["paged"]), 1),
            "sdpa_contiguous_median_us": round(sdpa_us, 1),
            "sdpa_contiguous_p99_us": round(_p99(times["sdpa"]), 1),
            "ratio_vs_sdpa": round(paged_us / sdpa_us, 3),
            "kv_bytes": kv_bytes,
            "paged_gbps": round(kv_bytes / paged_us / 1e3, 2),
            "max_abs_err_vs_sdpa": err,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    result = run(args.batch, args.context, args.q_heads, args.kv_heads, args.head_dim,
                 args.block_size, args.dtype, args.device, args.rounds)
    if args.json:
        print(json.dumps(result))
    else:
        d = result["decode"]
        print(f"paged {d['paged_median_us']:.0f} us  sdpa(contiguous) "
              f"{d['sdpa_contiguous_median_us']:.0f} us  ratio {d['ratio_vs_sdpa']:.2f}")
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
