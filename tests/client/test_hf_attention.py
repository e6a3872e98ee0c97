"""The transformers attention hook: a tiny random Llama gives the same logits through the pool.

The model is built from a ``LlamaConfig`` (no download). The reference run uses transformers'
own SDPA attention and ``DynamicCache``; the paged run keeps no cache of its own and reads all
K/V from a block-major pool through block tables with deliberately scattered slots.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from prefixd.client.hf_attention import ATTENTION_NAME, PagedKVContext, register_hf_attention

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4


@pytest.fixture
def triton_ready():
    """Fail loudly (not skip) if triton was imported compiled on a machine without CUDA."""
    if not torch.cuda.is_available() and "triton" in sys.modules:
        from prefixd.kernels.launch import interpreter_active

        if not interpreter_active():
            pytest.fail("triton was imported before TRITON_INTERPRET=1 could be set; run these "
                        "tests on their own")
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    register_hf_attention()
    return transformers.LlamaForCausalLM(config).eval()


def _hf_logits(model, prompt, steps):
    """Prefill then one decode step per column of ``steps``, with transformers' own cache."""
    model.set_attn_implementation("sdpa")
    cache = transformers.DynamicCache(config=model.config)
    logits = [model(prompt, past_key_values=cache, use_cache=True).logits]
    for t in range(steps.shape[1]):
        logits.append(model(steps[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return logits


def _paged_forward(model, pool, tables, tokens, seq_len, backend):
    batch, n = tokens.shape
    ctx = PagedKVContext.for_step(pool, tables, torch.full((batch,), seq_len), n, backend=backend)
    positions = torch.arange(seq_len - n, seq_len).expand(batch, -1)
    return model(tokens, paged_kv=ctx, use_cache=False, position_ids=positions).logits


def _pool(num_blocks=16):
    return torch.zeros(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, 2, 16)


TABLES = torch.tensor([[9, 2, 14, 5, 0, 11, 7], [3, 12, 1, 15, 8, 6, 10]], dtype=torch.int32)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_paged_llama_matches_transformers_for_prefill_and_decode(model, backend, triton_ready):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (2, 13), generator=g)
    steps = torch.randint(0, 128, (2, 3), generator=g)
    with torch.no_grad():
        want = _hf_logits(model, prompt, steps)
        model.set_attn_implementation(ATTENTION_NAME)
        pool = _pool()
        got = [_paged_forward(model, pool, TABLES, prompt, 13, backend)]
        for t in range(3):
            got.append(_paged_forward(model, pool, TABLES, steps[:, t : t + 1], 14 + t, backend))
    for step, (w, g_) in enumerate(zip(want, got)):
        torch.testing.assert_close(g_, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_paged_llama_extends_a_cached_prefix_like_a_full_prefill(model):
    """Prefill 8 tokens, then extend by 9 on top of them: logits as if all 17 came at once."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 128, (2, 17), generator=g)
    with torch.no_grad():
        want = _hf_logits(model, prompt, prompt[:, :0])[0]
        model.set_attn_implementation(ATTENTION_NAME)
        pool = _pool()
        head = _paged_forward(model, pool, TABLES, prompt[:, :8], 8, "auto")
        tail = _paged_forward(model, pool, TABLES, prompt[:, 8:], 17, "auto")
    torch.testing.assert_close(torch.cat([head, tail], dim=1), want, atol=1e-4, rtol=1e-4)


def test_paged_attention_without_a_context_says_what_to_pass(model):
    model.set_attn_implementation(ATTENTION_NAME)
    with pytest.raises(ValueError, match="paged_kv=PagedKVContext"), torch.no_grad():
        model(torch.zeros((1, 3), dtype=torch.long), use_cache=False)


def test_paged_attention_refuses_a_transformers_cache(model):
    model.set_attn_implementation(ATTENTION_NAME)
    pool = _pool()
    ctx = PagedKVContext.for_step(pool, TABLES[:1], torch.tensor([3]), 3)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.zeros((1, 3), dtype=torch.long), paged_kv=ctx, past_key_values=cache,
              use_cache=True, position_ids=torch.arange(3)[None])
        ctx = PagedKVContext.for_step(pool, TABLES[:1], torch.tensor([4]), 1)
        with pytest.raises(ValueError, match="use_cache=False"):
            model(torch.zeros((1, 1), dtype=torch.long), paged_kv=ctx, past_key_values=cache,
                  use_cache=True, position_ids=torch.tensor([[3]]))


@pytest.mark.parametrize(
    "lens,query_len,backend,error",
    [([2], 3, "auto", "seq_lens must be in \\[3, 28\\]"),
     ([29], 1, "auto", "seq_lens must be in \\[1, 28\\]"),
     ([5], 0, "auto", "query_len must be >= 1"),
     ([5], 1, "gpu", "backend must be one of")],
)
def test_paged_kv_context_rejects_bad_steps(lens, query_len, backend, error):
    with pytest.raises(ValueError, match=error):
        PagedKVContext.for_step(_pool(), TABLES[:1], torch.tensor(lens), query_len, backend)


def test_paged_kv_context_maps_new_tokens_to_their_slots():
    ctx = PagedKVContext.for_step(_pool(), TABLES, torch.tensor([6, 5]), 3)
    # sequence 0: positions 3, 4, 5 -> blocks 9, 2, 2; sequence 1: 2, 3, 4 -> 3, 3, 12
    assert ctx.slot_mapping.tolist() == [9 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3,
                                         12 * 4 + 0]
    assert ctx.query_start_loc.tolist() == [0, 3, 6] and ctx.max_seq_len == 6


def test_rows_of_different_lengths_attend_only_for_their_new_tokens(model):
    """for_rows: row 0 has 8 of its 13 tokens in the pool and brings 2 already-stored columns
    before its 5 new ones; row 1 brings all 7 of its tokens. Each row's new tokens get the
    logits of a full prefill, and stored columns are not written again (slot -1)."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 128, (13,), generator=g), torch.randint(0, 128, (7,), generator=g)
    with torch.no_grad():
        want_a = _hf_logits(model, a[None], a[None, :0])[0][0]
        want_b = _hf_logits(model, b[None], b[None, :0])[0][0]
        model.set_attn_implementation(ATTENTION_NAME)
        pool = _pool()
        _paged_forward(model, pool, TABLES[:1], a[None, :8], 8, "reference")
        ctx = PagedKVContext.for_rows(pool, TABLES, torch.tensor([13, 7]), [5, 7], 7, write_from=[8, 0],
                                      backend="reference")
        ids = torch.stack([a[6:], b])
        positions = torch.stack([torch.arange(6, 13), torch.arange(7)])
        got = model(ids, paged_kv=ctx, use_cache=False, position_ids=positions).logits
    assert ctx.query_index.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert ctx.slot_mapping.tolist()[:5] == [14 * 4 + 0, 14 * 4 + 1, 14 * 4 + 2, 14 * 4 + 3, 5 * 4 + 0]
    torch.testing.assert_close(got[0, 2:], want_a[8:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want_b, atol=1e-4, rtol=1e-4)
    ctx = PagedKVContext.for_rows(pool, TABLES, torch.tensor([13, 7]), [5, 7], 7, write_from=[11, 7])
    assert ctx.slot_mapping.tolist() == [-1, -1, -1, 14 * 4 + 3, 5 * 4 + 0] + [-1] * 7


def test_paged_kv_context_rejects_row_counts_out_of_range():
    with pytest.raises(ValueError, match="new_counts must be 2 counts in \\[1, 3\\]"):
        PagedKVContext.for_rows(_pool(), TABLES, torch.tensor([6, 5]), [3, 4], 3)
    with pytest.raises(ValueError, match="new_counts must be 2 counts"):
        PagedKVContext.for_rows(_pool(), TABLES, torch.tensor([6, 5]), [0, 1], 3)
