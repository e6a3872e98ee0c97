"""Run in the vLLM venv by tests/vllm/test_connector_vllm.py (the main venv has no vLLM).

    python connector_child.py roundtrip SOCKET            -> one JSON line on stdout

``roundtrip``: KV written into tensors shaped like CPU_ATTN's by vLLM's own cache write
(``cpu_attn_reshape_and_cache``) is saved through the connector's worker side into a real
daemon's pool and committed; a second worker side loads it into fresh tensors at other block
ids; vLLM's own attention kernel (``cpu_attention_with_kv_cache``) over the loaded blocks is
compared with attention computed from the original K/V. The same load read with the GPU
backends' K/V split is reported too (it must not match: the split is what the test checks).

(Generation through the connector is tested by tests/vllm/test_vllm_scenarios.py, with the
driver ``prefixd.tools.vllm_run``.)
"""

import json
import math
import sys

import torch


def roundtrip(socket: str) -> dict:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from prefixd.api.layout import KVLayout
    from prefixd.client import connect
    from prefixd.client.vllm.daemon_link import DaemonLink
    from prefixd.client.vllm.metadata import StepPlan, Transfer
    from prefixd.client.vllm.paged_layout import COLUMNS, find_layout
    from prefixd.client.vllm.worker import WorkerSide

    num_layers, num_kv_heads, num_heads, head_dim, bs, num_blocks = 2, 2, 4, 64, 32, 16
    dtype = torch.bfloat16
    layout = KVLayout("connector-roundtrip", num_layers, num_kv_heads, head_dim, "bfloat16", bs)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    isa = _get_attn_isa(dtype, bs, head_dim)
    if isa == "amx":
        # NOTE: Linux gives a process AMX's tile registers only once it asks
        # (arch_prctl XCOMP_PERM); without that the first tile instruction is SIGILL.
        # A vLLM engine has asked by the time its attention runs (oneDNN's matmuls ask
        # on first use); this child calls the kernels bare, so it asks as torch does.
        torch._C._cpu._init_amx()
    g = torch.Generator().manual_seed(0)
    n_tokens = 3 * bs + 5
    tokens = torch.randint(0, 50000, (n_tokens,), generator=g).tolist()
    keys = [torch.randn(n_tokens, num_kv_heads, head_dim, generator=g).to(dtype) for _ in names]
    values = [torch.randn(n_tokens, num_kv_heads, head_dim, generator=g).to(dtype) for _ in names]

    def vllm_tensors():
        # what vLLM 0.32 registers for CPU_ATTN: [num_blocks, num_kv_heads, block_size, 2 * head_dim]
        return {n: torch.zeros(num_blocks, num_kv_heads, bs, 2 * head_dim, dtype=dtype) for n in names}

    def vllm_write(tensors, table, start, end):
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(start, end)], dtype=torch.long)
        for i, n in enumerate(names):
            kc, vc = tensors[n].view(num_blocks, num_kv_heads, 2 * bs, head_dim).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(keys[i][start:end], values[i][start:end], kc, vc, slots, isa)

    def worker(tensors):
        link = DaemonLink(socket, layout, "roundtrip-worker", mapped=True, timeout_s=10, retry_s=1)
        w = WorkerSide(link, names, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=bs)
        assert w.register(tensors, {n: "CPU_ATTN" for n in names})
        return w

    out = {}
    # 1. vLLM computes the prompt into its blocks; the connector saves the full ones; commit.
    first = vllm_tensors()
    table1 = [5, 9, 2, 11]
    vllm_write(first, table1, 0, n_tokens)
    with connect(socket, layout, name="roundtrip-scheduler", mapped=False) as s1:
        seq = s1.open(tokens)
        w1 = worker(first)
        w1.save(StepPlan(epoch=s1.epoch, saves=[Transfer("a", tuple(table1[:3]), tuple(seq.block_table[:3]))]))
        out["report"] = w1.take_report().saved
        s1.release(seq, commit=True, durability="crash")
        w1.close()
    # 2. Another "vLLM": fresh tensors, other block ids; the connector loads the cached blocks,
    # vLLM computes the last 5 tokens itself, and its own attention reads everything.
    second = vllm_tensors()
    table2 = [7, 1, 12, 13]
    with connect(socket, layout, name="roundtrip-scheduler-2", mapped=False) as s2:
        seq2 = s2.open(tokens)
        out["cached_tokens"] = seq2.cached_tokens
        w2 = worker(second)
        plan = StepPlan(epoch=s2.epoch, loads=[Transfer("b", tuple(table2[:3]), tuple(seq2.block_table[:3]))])
        w2.load(plan)
        out["load_errors"] = sorted(w2.take_load_errors())
        out["stats_hit_tokens"] = s2.stats().get("prefixd_hit_tokens_total", -1)
        s2.release(seq2)
        w2.close()
    vllm_write(second, table2, 3 * bs, n_tokens)
    new = n_tokens - 3 * bs
    query = torch.randn(new, num_heads, head_dim, generator=g).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    errors, errors_columns = [], []
    for i, n in enumerate(names):
        got = vllm_attention(ops, isa, second[n], query, table2, n_tokens, num_kv_heads, scale)
        want = reference_attention(query, keys[i], values[i], scale)
        errors.append((got.float() - want).abs().max().item())
        # the same blocks read as the GPU backends split K/V: a different tensor
        view = find_layout(second[n].shape, second[n].stride(), num_kv_heads=num_kv_heads, head_dim=head_dim,
                           block_size=bs, fused_split=COLUMNS).view(second[n])
        k_cols = view[table2[:3], 0].reshape(3 * bs, num_kv_heads, head_dim)
        errors_columns.append((k_cols.float() - keys[i][:3 * bs].float()).abs().max().item())
    out["max_err"] = max(errors)
    out["max_err_columns"] = min(errors_columns)
    return out


def vllm_attention(ops, isa, kv, query, table, seq_len, num_kv_heads, scale):
    num_blocks, _, bs, two_d = kv.shape
    head_dim = two_d // 2
    kc, vc = kv.view(num_blocks, num_kv_heads, 2 * bs, head_dim).chunk(2, dim=2)
    new = query.shape[0]
    loc = torch.tensor([0, new], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=query.shape[1], num_kv_heads=num_kv_heads,
                                               head_dim=head_dim, seq_lens=lens, dtype=query.dtype,
                                               query_start_loc=loc, causal=True, sliding_window_size=-1,
                                               isa=isa, enable_kv_split=False)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(query=query, key_cache=kc, value_cache=vc, output=out, query_start_loc=loc,
                                    seq_lens=lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
                                    block_table=torch.tensor([table], dtype=torch.int32), softcap=0.0,
                                    scheduler_metadata=meta, s_aux=None)
    return out


def reference_attention(query, keys, values, scale):
    """Causal attention of the last ``len(query)`` tokens over all of ``keys``/``values`` (GQA)."""
    new, num_heads, _ = query.shape
    total, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.float().repeat_interleave(group, dim=1)    # [total, heads, d]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    pos = torch.arange(total - new, total)[:, None]
    scores = scores.masked_fill(torch.arange(total)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def main(argv) -> int:
    if argv[0] != "roundtrip":
        raise SystemExit(f"usage: connector_child.py roundtrip SOCKET (got {argv[0]!r})")
    result = roundtrip(argv[1])
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
