"""The KV data path and Attend sections of ``bench/rpc.py``, each against its floor, timed in
alternating repetitions so that the host's noise lands on both (the KV paths in a fresh random
order each repetition: the NOTE on order).

- KV: write then read of a 2k-token prefix's KV (``[num_layers, 2, 2048, num_kv_heads,
  head_dim]``) of a sequence whose blocks are all private, through the mapped pool
  (``connect(..., mapped=True)``) and through ``WriteKV``/``ReadKV`` (``mapped=False``).
  Floors: ``memcpy``: the bytes into a tensor that exists, then out of it into a new tensor
  (as ``write_kv`` / ``read_kv`` do; both tensors torch's, as the client's are), each copy one
  ``np.copyto`` over the tensors' memory (glibc's ``memcpy``, in this thread); ``grpc_bytes``: an upload of
  the WriteKV messages' byte sizes then a download of the ReadKV messages', chunked as the
  client and the daemon chunk them, through the bare echo server. GB/s count both directions
  (2 x the prefix's bytes per repetition).
- Attend: one decode step of 16 sequences of 2,048 cached tokens + 1 new token (its K/V sent
  along as ``new_k``/``new_v``, written into the sequence's last, private block first), layer
  0 of the layout, through ``Attend`` (``mapped=False``). Floor: the same
  ``prefixd.kernels.write_kv`` + ``paged_attention`` calls in this process over a pool of the
  same layout (blocks in random order), plus one bare echo of the Attend request's and reply's
  byte sizes; timed with torch's intra-op threads and with one, the faster median counting
  (``floor_by_threads`` holds both). Timed in blocks, not alternating call by call (the NOTE
  on blocks).
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np
import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.kernels import layer_kv, paged_attention, write_kv
from prefixd.tools.workloads import VOCAB

PREFIX_TOKENS = 2048
# NOTE (the memcpy floor is numpy's, not torch's): torch's ``copy_`` / ``clone`` split a copy
# this size over its OpenMP team, whose workers sleep between the repetitions and wait on each
# other at a barrier: on the 2-core dev host the same 4 MiB took 0.55 ms at best and 3.6-10 ms
# at the median, run to run (0.4 to 5.9 ms medians in three runs of this section), so the ratio
# measured the team's wake-ups. numpy's copies are one memcpy each in the calling thread
# (0.60-0.90 ms the pair at the median in three runs), as the mapped path's own copies are
# (``prefixd.kernels.token_io``).
# NOTE (order): each repetition times the four KV paths in a fresh random order. In a fixed
# rotation a path always ran right after the same other one and inherited what it left in the
# caches: the memcpy floor (timed after the mapped path) ran 0.1-0.2 ms slower once the mapped
# path stopped warming torch's code for it (``token_io``'s NOTE on the numpy path).
# NOTE (Attend in blocks): the section times ``ATTEND_BLOCK`` calls of one kind in a row (the
# rpc, the floor with torch's threads, the floor with one), each kind first in turn. Timed one
# after the other, each rpc ran while this process's OpenMP worker still spun after the floor's
# kernel (libgomp spins ~ms before it sleeps), on a 2-CPU host: traced in the daemon, the two
# halves of its kernel took 3.2-11 ms where they take 3.7 ms alone, and rpc_us was 9.7-11.3 ms
# against 5.9-6.2 ms in blocks (three runs each, alternating). The floor's own kernel is bimodal
# here: its two-thread team took 5.3-5.5 or 12 ms, run to run (slower than one thread's
# 5.8 ms when the scheduler puts both on one CPU), so the floor is the faster of the two
# thread counts: a floor never weaker than what one call in this process can do.
ATTEND_BLOCK = 6
ATTEND_SEQS = 16
Q_HEADS_PER_KV_HEAD = 4


def _tokens(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n, dtype=np.int32).astype("<i4").tobytes()


def _kv(layout, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=g).to(layout.torch_dtype())


def _median_us(ns: list[int]) -> float:
    return statistics.median(ns) / 1000


def _gbps(nbytes: int, ns: list[int]) -> float:
    return round(nbytes / statistics.median(ns), 3)  # bytes per ns = GB/s


def kv_section(mapped, remote, echo, reps: int) -> dict:
    """``mapped`` / ``remote``: client sessions of one layout with and without the mapping."""
    from prefixd.client.remote_kv import chunk_tokens
    from prefixd.daemon.kv_rpc import MESSAGE_OVERHEAD, token_bytes

    layout = mapped.layout
    if not mapped.mapped or remote.mapped:
        raise RuntimeError(f"need one mapped and one rpc session (got mapped={mapped.mapped}, "
                           f"{remote.mapped})")
    kv = _kv(layout, PREFIX_TOKENS, 1)
    nbytes = kv.numel() * kv.element_size()
    seqs = {name: s.open(_tokens(100 + i, PREFIX_TOKENS)) for i, (name, s) in
            enumerate((("mapped", mapped), ("rpc", remote)))}
    # The messages each way, as the client (WriteKV) and the daemon (ReadKV) chunk them.
    per_token = token_bytes(layout)
    up_tokens = chunk_tokens(per_token, layout.block_size, remote.max_message_bytes)
    down_tokens = (remote.max_message_bytes - MESSAGE_OVERHEAD) // per_token
    shape = [layout.num_layers, 2, 0, layout.num_kv_heads, layout.head_dim]

    def message_sizes(step: int, message) -> list[int]:
        sizes = []
        for lo in range(0, PREFIX_TOKENS, step):
            n = min(step, PREFIX_TOKENS - lo)
            chunk = pb.KVChunk(seq_id=1 << 40, start=lo, num_tokens=n, dtype=layout.dtype,
                               shape=shape[:2] + [n] + shape[3:], data=bytes(n * per_token))
            sizes.append(message(chunk).ByteSize())
        return sizes

    up = [bytes(n) for n in message_sizes(up_tokens, lambda c: pb.WriteKVRequest(session_id=1 << 62, chunk=c))]
    down = message_sizes(down_tokens, lambda c: pb.ReadKVReply(chunk=c))
    src = kv.numpy()
    dst = torch.empty_like(kv).numpy()
    clock = time.perf_counter_ns
    times = {"mapped": [], "rpc": [], "memcpy": [], "grpc_bytes": []}

    def mapped_rep():
        mapped.write_kv(seqs["mapped"], 0, kv)
        return mapped.read_kv(seqs["mapped"], 0, PREFIX_TOKENS)

    def rpc_rep():
        remote.write_kv(seqs["rpc"], 0, kv)
        return remote.read_kv(seqs["rpc"], 0, PREFIX_TOKENS)

    def memcpy_rep():
        np.copyto(dst, src)
        out = torch.empty_like(kv)
        np.copyto(out.numpy(), dst)
        return out

    def grpc_rep():
        echo.upload(up)
        return echo.download(down)

    runs = (("mapped", mapped_rep), ("memcpy", memcpy_rep), ("rpc", rpc_rep), ("grpc_bytes", grpc_rep))
    for name, fn in runs:  # warm-up, and the bytes must come back unchanged
        out = fn()
        if name in ("mapped", "rpc") and not torch.equal(out, kv):
            raise RuntimeError(f"the {name} path read back other bytes than it wrote")
    order = list(runs)
    shuffle = random.Random(11).shuffle
    for _ in range(reps):
        shuffle(order)  # the NOTE on order
        for name, fn in order:
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    for name, s in (("mapped", mapped), ("rpc", remote)):
        s.release(seqs[name])
    moved = 2 * nbytes
    return {
        "prefix_tokens": PREFIX_TOKENS, "bytes": nbytes, "reps": reps,
        "writekv_messages": len(up), "readkv_messages": len(down),
        "mapped_gbps": _gbps(moved, times["mapped"]), "rpc_gbps": _gbps(moved, times["rpc"]),
        "memcpy_gbps": _gbps(moved, times["memcpy"]), "grpc_bytes_gbps": _gbps(moved, times["grpc_bytes"]),
        "mapped_us": round(_median_us(times["mapped"]), 1), "rpc_us": round(_median_us(times["rpc"]), 1),
        "memcpy_us": round(_median_us(times["memcpy"]), 1),
        "grpc_bytes_us": round(_median_us(times["grpc_bytes"]), 1),
    }


def attend_section(remote, echo, reps: int) -> dict:
    """``remote``: a session of the layout with ``mapped=False`` (Attend runs in the daemon)."""
    layout = remote.layout
    if remote.mapped:
        raise RuntimeError("Attend is measured through the rpc: connect with mapped=False")
    n = PREFIX_TOKENS + 1
    dt = layout.torch_dtype()
    q_heads = layout.num_kv_heads * Q_HEADS_PER_KV_HEAD
    g = torch.Generator().manual_seed(7)
    seqs = []
    for i in range(ATTEND_SEQS):
        seq = remote.open(_tokens(1000 + i, n))
        remote.write_kv(seq, 0, _kv(layout, n, 1000 + i))
        seqs.append(seq)
    query = torch.randn((ATTEND_SEQS, q_heads, layout.head_dim), generator=g).to(dt)
    new_k = torch.randn((ATTEND_SEQS, layout.num_kv_heads, layout.head_dim), generator=g).to(dt)
    new_v = torch.randn((ATTEND_SEQS, layout.num_kv_heads, layout.head_dim), generator=g).to(dt)

    # The floor's pool: the same layout, each sequence's blocks scattered over it.
    bs = layout.block_size
    pages = -(-n // bs)
    num_blocks = ATTEND_SEQS * pages + 8
    pool = torch.randn((num_blocks, *layout.block_shape), generator=g).to(dt)
    k_cache, v_cache = layer_kv(pool, 0)
    tables = torch.randperm(num_blocks, generator=g)[:ATTEND_SEQS * pages].view(ATTEND_SEQS, pages)
    tables = tables.to(torch.int32)
    lens = torch.full((ATTEND_SEQS,), n, dtype=torch.int32)
    slots = (tables[:, (n - 1) // bs].long() * bs + (n - 1) % bs)
    request = pb.AttendRequest(session_id=1 << 62, seq_ids=[s.id for s in seqs], layer=0)
    for field, t in (("query", query), ("new_k", new_k), ("new_v", new_v)):
        getattr(request, field).CopyFrom(pb.Tensor(shape=list(t.shape), dtype=layout.dtype,
                                                   data=t.numpy().tobytes()))
    reply = pb.AttendReply(output=pb.Tensor(shape=list(query.shape), dtype=layout.dtype,
                                            data=query.numpy().tobytes()))
    echo_req = echo.request(request.ByteSize(), reply.ByteSize())

    def kernels():
        write_kv(new_k, new_v, k_cache, v_cache, slots)
        return paged_attention(query, k_cache, v_cache, tables, lens, max_seq_len=n, max_query_len=1)

    def rpc() -> None:
        remote.attend(seqs, query, layer=0, new_k=new_k, new_v=new_v)

    def floor() -> int:
        t0 = clock()
        kernels()
        t1 = clock()
        echo.call(echo_req)
        return t1 - t0

    clock = time.perf_counter_ns
    threads = torch.get_num_threads()
    modes = ("rpc", "floor", "floor_1t")  # the floor with torch's threads, and with one
    times = {m: [] for m in modes}
    kernel = {m: [] for m in modes[1:]}
    rounds = -(-reps // ATTEND_BLOCK)
    for r in range(1 + rounds):  # one warm-up round
        for m in modes[r % 3:] + modes[:r % 3]:  # each kind first in turn
            torch.set_num_threads(1 if m == "floor_1t" else threads)
            for _ in range(ATTEND_BLOCK):
                t0 = clock()
                k = rpc() if m == "rpc" else floor()
                t1 = clock()
                if r:
                    times[m].append(t1 - t0)
                    if m != "rpc":
                        kernel[m].append(k)
    torch.set_num_threads(threads)
    by_threads = {m: {"threads": 1 if m == "floor_1t" else threads,
                      "us": round(_median_us(times[m]), 1),
                      "kernel_us": round(_median_us(kernel[m]), 1)} for m in modes[1:]}
    best = min(by_threads.values(), key=lambda x: x["us"])
    for seq in seqs:
        remote.release(seq)
    return {
        "num_seqs": ATTEND_SEQS, "cached_tokens": PREFIX_TOKENS, "new_tokens": 1,
        "num_q_heads": q_heads, "reps": len(times["rpc"]), "block": ATTEND_BLOCK,
        "backend": "reference (CPU)" if pool.device.type == "cpu" else "auto",
        "request_bytes": request.ByteSize(), "reply_bytes": reply.ByteSize(),
        "rpc_us": round(_median_us(times["rpc"]), 1),
        "rpc_p99_us": round(sorted(times["rpc"])[min(len(times["rpc"]) - 1, int(0.99 * len(times["rpc"])))] / 1000, 1),
        "floor_us": best["us"],
        "floor_kernel_us": best["kernel_us"],
        "floor_by_threads": list(by_threads.values()),
    }
