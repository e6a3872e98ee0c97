"""Factories for kernel tests: pools, block tables, batches, and a dense float64 oracle."""

from __future__ import annotations

import torch

# Tolerances of a kernel (or the reference) against the float64 oracle / each other, by dtype.
# fp32: accumulation-order noise. fp16/bf16: one rounding of the output (bf16 has 8 bits).
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def make_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, *, num_layers=2,
              seed=0):
    """A random block-major pool ``[num_blocks, num_layers, 2, block_size, heads, head_dim]``."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def make_block_tables(seq_lens, block_size, num_blocks, device, *, seed=0, dtype=torch.int32):
    """Distinct random slots per sequence; columns past a sequence's pages hold -1 (never read)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    assert sum(pages) <= num_blocks, "pool too small for the batch"
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq_lens), max(pages) + 1), -1, dtype=torch.int64)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[used : used + n]
        used += n
    return table.to(dtype=dtype, device=device)


def gather_sequence(cache, table_row, length):
    """A sequence's K (or V) ``[length, heads, head_dim]``, one token at a time."""
    block_size = cache.shape[1]
    return torch.stack(
        [cache[int(table_row[t // block_size]), t % block_size] for t in range(length)]
    )


def dense_attention(q, k, v, first_pos):
    """Causal attention in float64: ``q [n, hq, d]`` at positions ``first_pos + i``."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) * d**-0.5
    pos = torch.arange(k.shape[0], device=q.device)
    future = pos[None, :] > (first_pos + torch.arange(n, device=q.device))[:, None]
    scores = scores.masked_fill(future[None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, -1), v)


def make_decode_batch(seq_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                      device, seed=0, layer=1):
    """(query, k_cache, v_cache, block_tables, seq_lens) for a decode step over a fresh pool."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    pool = make_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, seed=seed)
    tables = make_block_tables(seq_lens, block_size, num_blocks, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn((len(seq_lens), num_q_heads, head_dim), generator=g).to(dtype=dtype,
                                                                           device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, pool[:, layer, 0], pool[:, layer, 1], tables, lens


def make_extend_batch(seq_lens, new_lens, *, num_q_heads, num_kv_heads, head_dim, block_size,
                      dtype, device, seed=0):
    """(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc) for an extend step."""
    q_dec, k_cache, v_cache, tables, lens = make_decode_batch(
        seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device, seed=seed,
    )
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn((sum(new_lens), num_q_heads, head_dim), generator=g).to(dtype=dtype,
                                                                           device=device)
    starts = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)
    return q, k_cache, v_cache, tables, lens, starts


def decode_oracle(q, k_cache, v_cache, tables, lens):
    """Decode attention in float64, one sequence at a time, from token-by-token gathers."""
    out = []
    for b, n in enumerate(lens.tolist()):
        k = gather_sequence(k_cache, tables[b], n)
        v = gather_sequence(v_cache, tables[b], n)
        out.append(dense_attention(q[b : b + 1], k, v, n - 1)[0])
    return torch.stack(out)


def extend_oracle(q, k_cache, v_cache, tables, lens, starts):
    """Extend attention in float64, one sequence at a time."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    s = starts.tolist()
    for b, n in enumerate(lens.tolist()):
        new = s[b + 1] - s[b]
        if new == 0:
            continue
        k = gather_sequence(k_cache, tables[b], n)
        v = gather_sequence(v_cache, tables[b], n)
        out[s[b] : s[b + 1]] = dense_attention(q[s[b] : s[b + 1]], k, v, n - new)
    return out
