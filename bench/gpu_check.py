"""GPU check: kernel tests at full size, then decode/extend timings against SDPA and the floor.

Run from the repository root on a CUDA machine: ``python bench/gpu_check.py [--out PATH]``.
Needs only torch and triton (and this tree). Steps, each bounded so the whole run fits in
8 minutes on an H200:

1. ``pytest -m gpu tests/kernels`` in a subprocess (full-size decode/extend/KV-write/copy tests,
   the pool past 2**31 elements); skipped with ``--skip-tests`` or when pytest is missing.
2. Device copy bandwidth, measured here: a large ``copy_`` (bytes read + written / time).
3. Decode: batch 1..128 x context 1k..32k, bf16, 32 query / 8 KV heads, head_dim 128, block 16,
   scattered block tables. Each point reports the paged kernel, SDPA over the same K/V made
   contiguous (``enable_gqa``), and the floor = K/V bytes read / copy bandwidth.
4. Extend: a chunk of new tokens on a cached prefix vs SDPA over contiguous K/V with the
   equivalent mask.
5. CUDA IPC: a durable cache with its device pool on the GPU; its Attach descriptor
   (``prefixd.daemon.pool_descriptors``) carries torch's IPC handle, and a second process
   maps the pool through it (``prefixd.api.tensors.tensor_from_cuda_ipc``), checks shape,
   strides, dtype and every block's bytes, and writes a block the first process then sees.
   ``--ipc-only`` runs just this case and prints its JSON.

Prints a table and writes one JSON object to ``--out`` (default docs/bench/gpu_check.json).
Without CUDA it says so and exits 0 without writing anything.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from prefixd.kernels import layer_kv, paged_attention  # noqa: E402

DECODE_BATCHES = [1, 8, 32, 64, 128]
DECODE_CONTEXTS = [1024, 4096, 16384, 32768]
EXTEND_CASES = [(1, 4096, 512), (8, 2048, 256), (4, 8192, 1024)]  # batch, cached, new
MODEL = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
# K/V bytes per point are capped so a point allocates at most ~2 x this (pool + contiguous copy).
MAX_KV_BYTES = 24 << 30


def run_tests(timeout_s: int) -> dict:
    """Run the full-size kernel tests in a subprocess; return a summary."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/kernels", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"cmd": " ".join(cmd), "ok": False, "error": f"timed out after {timeout_s}s"}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"cmd": " ".join(cmd), "ok": proc.returncode == 0, "returncode": proc.returncode,
            "seconds": round(time.perf_counter() - t0, 1), "tail": tail}


def time_us(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median of CUDA-event timings of ``fn`` in microseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Device copy bandwidth in bytes/s: (bytes read + bytes written) / time of a 2 GiB copy."""
    src = torch.empty(1 << 30, dtype=torch.int16, device=device).fill_(1)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), iters=10)
    del src, dst
    return 2 * (1 << 31) / (us * 1e-6)


def _batch(batch: int, context: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A one-layer pool with each sequence's blocks scattered, plus the same K/V contiguous."""
    h, kvh, d, bs = (MODEL[k] for k in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"))
    g = torch.Generator(device=device).manual_seed(seed)
    pages = -(-context // bs)
    num_blocks = batch * pages + 16
    pool = torch.randn((num_blocks, 1, 2, bs, kvh, d), generator=g, device=device, dtype=dtype)
    k_cache, v_cache = layer_kv(pool, 0)
    perm = torch.randperm(num_blocks, generator=g, device=device)[: batch * pages]
    tables = perm.view(batch, pages).to(torch.int32)
    flat = tables.long().flatten()
    k = k_cache[flat].view(batch, pages * bs, kvh, d)[:, :context].transpose(1, 2).contiguous()
    v = v_cache[flat].view(batch, pages * bs, kvh, d)[:, :context].transpose(1, 2).contiguous()
    return pool, k_cache, v_cache, tables, k, v


def bench_decode(bandwidth: float, dtype: torch.dtype, device: torch.device) -> list[dict]:
    rows = []
    h, kvh, d = MODEL["num_q_heads"], MODEL["num_kv_heads"], MODEL["head_dim"]
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            kv_bytes = 2 * batch * context * kvh * d * torch.finfo(dtype).bits // 8
            if kv_bytes > MAX_KV_BYTES:
                continue
            pool, k_cache, v_cache, tables, k, v = _batch(batch, context, dtype, device)
            lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q = torch.randn((batch, h, d), dtype=dtype, device=device)
            paged = lambda: paged_attention(q, k_cache, v_cache, tables, lens,  # noqa: E731
                                            max_seq_len=context)
            sdpa = lambda: F.scaled_dot_product_attention(  # noqa: E731
                q[:, :, None], k, v, enable_gqa=True)
            err = (paged().float() - sdpa()[:, :, 0].float()).abs().max().item()
            paged_us, sdpa_us = time_us(paged), time_us(sdpa)
            floor_us = kv_bytes / bandwidth * 1e6
            rows.append({
                "batch": batch, "context": context, "paged_us": round(paged_us, 1),
                "sdpa_us": round(sdpa_us, 1), "floor_us": round(floor_us, 1),
                "ratio_vs_sdpa": round(paged_us / sdpa_us, 3),
                "fraction_of_floor": round(floor_us / paged_us, 3),
                "max_abs_err": err,
            })
            del pool, k_cache, v_cache, k, v
            torch.cuda.empty_cache()
    return rows


def bench_extend(bandwidth: float, dtype: torch.dtype, device: torch.device) -> list[dict]:
    rows = []
    h, kvh, d = MODEL["num_q_heads"], MODEL["num_kv_heads"], MODEL["head_dim"]
    for batch, cached, new in EXTEND_CASES:
        total = cached + new
        pool, k_cache, v_cache, tables, k, v = _batch(batch, total, dtype, device)
        lens = torch.full((batch,), total, dtype=torch.int32, device=device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * new
        q = torch.randn((batch * new, h, d), dtype=dtype, device=device)
        q4 = q.view(batch, new, h, d).transpose(1, 2)
        mask = torch.ones((new, total), dtype=torch.bool, device=device).tril(diagonal=cached)
        paged = lambda: paged_attention(q, k_cache, v_cache, tables, lens,  # noqa: E731
                                        query_start_loc=starts, max_query_len=new)
        sdpa = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q4, k, v, attn_mask=mask, enable_gqa=True)
        want = sdpa().transpose(1, 2).reshape(batch * new, h, d)
        err = (paged().float() - want.float()).abs().max().item()
        paged_us, sdpa_us = time_us(paged, iters=10), time_us(sdpa, iters=10)
        kv_bytes = 2 * batch * total * kvh * d * torch.finfo(dtype).bits // 8
        rows.append({
            "batch": batch, "cached": cached, "new": new, "paged_us": round(paged_us, 1),
            "sdpa_us": round(sdpa_us, 1), "ratio_vs_sdpa": round(paged_us / sdpa_us, 3),
            "floor_us": round(kv_bytes / bandwidth * 1e6, 1), "max_abs_err": err,
        })
        del pool, k_cache, v_cache, k, v
        torch.cuda.empty_cache()
    return rows


IPC_LAYOUT = dict(model_id="gpu-check-ipc", num_layers=2, num_kv_heads=2, head_dim=64,
                  dtype="float16", block_size=16)
IPC_MARK = -7.0  # what the second process writes into block 1


def check_cuda_ipc(timeout_s: int = 120) -> dict:
    """Map a CUDA device pool from a second process through its descriptor's IPC handle.

    Block ``b`` of the pool holds the value ``b`` everywhere; the child checks that, writes
    ``IPC_MARK`` into block 1, and this process checks it sees the write. Returns
    ``{"ok": ..., ...}`` (``{"skipped": ...}`` without CUDA); never raises.
    """
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device visible"}
    from prefixd.api.layout import KVLayout
    from prefixd.api.tiers import Tier
    from prefixd.daemon.pool_descriptors import pool_descriptors
    from prefixd.engine import DurableCache

    t0 = time.perf_counter()
    result: dict = {"ok": False}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "shm"))
            dc = DurableCache(os.path.join(tmp, "state"), KVLayout(**IPC_LAYOUT), (64, 64, 0),
                              shm_dir=os.path.join(tmp, "shm"), use_cuda=True)
            try:
                pool = dc.store.pool(Tier.DEVICE).tensor
                n = pool.shape[0]
                marks = torch.arange(n, dtype=pool.dtype, device=pool.device)
                pool.copy_(marks.view(n, 1, 1, 1, 1, 1).expand_as(pool))
                torch.cuda.synchronize()
                (desc,) = [d for d in pool_descriptors(dc) if d.tier == "device"]
                result["handle_bytes"] = len(desc.cuda_ipc)
                proc = subprocess.run([sys.executable, __file__, "--ipc-child"], cwd=REPO,
                                      input=desc.SerializeToString(), capture_output=True,
                                      timeout=timeout_s)
                torch.cuda.synchronize()
                seen = bool((pool[1] == IPC_MARK).all().item())
                kept = bool((pool[2] == 2).all().item())
                result.update(child=proc.stdout.decode().strip()[-400:], child_rc=proc.returncode,
                              parent_sees_child_write=seen, other_blocks_kept=kept,
                              ok=proc.returncode == 0 and seen and kept)
                if proc.returncode:
                    result["child_stderr"] = proc.stderr.decode().strip().splitlines()[-10:]
            finally:
                dc.close()
    except Exception as exc:  # noqa: BLE001 - a check script reports, it does not crash
        result["error"] = repr(exc)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def _ipc_child() -> int:
    """The second process of ``check_cuda_ipc``: a ``PoolDescriptor`` on stdin."""
    from prefixd.api import prefixd_pb2 as pb
    from prefixd.api.tensors import dtype_of, tensor_from_cuda_ipc

    desc = pb.PoolDescriptor.FromString(sys.stdin.buffer.read())
    pool = tensor_from_cuda_ipc(desc.cuda_ipc)
    n = pool.shape[0]
    checks = {
        "shape": list(pool.shape) == list(desc.shape),
        "strides": list(pool.stride()) == list(desc.strides),
        "dtype": pool.dtype == dtype_of(desc.dtype),
        "device": pool.device.index == desc.cuda_device,
        "reads": torch.equal(pool.view(n, -1).float().amin(dim=1).cpu(),
                             torch.arange(n, dtype=torch.float32))
                 and torch.equal(pool.view(n, -1).float().amax(dim=1).cpu(),
                                 torch.arange(n, dtype=torch.float32)),
    }
    pool[1].fill_(IPC_MARK)
    torch.cuda.synchronize()
    print(json.dumps(checks))
    return 0 if all(checks.values()) else 1


def print_table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    print(f"\n{title}")
    print("  ".join(f"{k:>16}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]!s:>16}" for k in keys))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="prefixd kernels: GPU tests and timings")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench" / "gpu_check.json"))
    parser.add_argument("--skip-tests", action="store_true", help="timings only")
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds for pytest")
    parser.add_argument("--ipc-only", action="store_true", help="only the CUDA IPC case")
    parser.add_argument("--ipc-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ipc_child:
        return _ipc_child()
    if args.ipc_only:
        ipc = check_cuda_ipc()
        print(json.dumps({"bench": "gpu_check", "cuda_ipc": ipc}))
        return 0 if ipc.get("ok") or "skipped" in ipc else 1
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); "
              "nothing to check on this machine. Run it on a GPU host from the repo root.")
        return 0
    device = torch.device("cuda")
    t0 = time.perf_counter()
    result = {"bench": "gpu_check", "device": torch.cuda.get_device_name(device),
              "torch": torch.__version__, "model": MODEL, "dtype": "bfloat16"}
    result["tests"] = {"skipped": True} if args.skip_tests else run_tests(args.test_timeout)
    print(f"tests: {result['tests']}")
    bandwidth = copy_bandwidth(device)
    result["copy_bandwidth_gbps"] = round(bandwidth / 1e9, 1)
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s")
    result["decode"] = bench_decode(bandwidth, torch.bfloat16, device)
    print_table("decode (bf16)", result["decode"])
    result["extend"] = bench_extend(bandwidth, torch.bfloat16, device)
    print_table("extend (bf16)", result["extend"])
    result["cuda_ipc"] = check_cuda_ipc()
    print(f"\ncuda ipc: {result['cuda_ipc']}")
    key = [r for r in result["decode"] if (r["batch"], r["context"]) == (64, 4096)]
    if key:
        result["decode_b64_4k"] = key[0]
        print(f"\nbatch 64 x 4k: {key[0]['fraction_of_floor']:.0%} of the floor, "
              f"{key[0]['ratio_vs_sdpa']:.2f}x SDPA (targets: >= 75%, <= 1.2x)")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} in {result['seconds']} s")
    return 0 if result["tests"].get("ok", True) and result["cuda_ipc"].get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
