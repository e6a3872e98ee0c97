"""``PrefixdCache`` against a real daemon: greedy ``generate`` gives transformers' own tokens.

A tiny seeded random-weight Llama built from a config (no download). Every test compares with
the same model under SDPA and ``DynamicCache`` (transformers' default), and counts the token
positions the model ran on with a forward pre-hook on the embeddings. One daemon for the module.
"""

import json
import os
import subprocess
import types
import sys

import pytest
import torch

import prefixd.client as pc
from tests.daemon.harness import ROOT, start_daemon

transformers = pytest.importorskip("transformers")
from prefixd.client.hf import PrefixdCache, generate_with_prefix, layout_for  # noqa: E402

LEASE_S = 4.0
NEW_TOKENS = 12


def tiny_llama():
    """The model every test (and the subprocess) builds: same seed, same weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every row generates NEW_TOKENS: counts are exact
    return model


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(lease_s=LEASE_S) as d:
        yield d


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture
def session(daemon, model):
    with pc.connect(daemon.socket, layout_for(model, "tiny-llama"), name="hf-test", mapped=True) as s:
        yield s
        s.check_invariants()
        assert not s.sequences  # every sequence released


class Counter:
    """Token positions the model's embeddings saw, over every forward."""

    def __init__(self, model):
        self.tokens = 0
        self._hook = model.get_input_embeddings().register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.tokens += args[0].numel()

    def remove(self):
        self._hook.remove()


def prompt(seed, n, first=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(first, 256, (n,), generator=g).tolist()


def reference(model, input_ids, attention_mask=None, **kw):
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              **kw)


def with_prefixd(model, session, input_ids, attention_mask=None, **kw):
    """Generated ids, the cache, forwarded token positions (greedy unless ``kw`` says)."""
    kw.setdefault("do_sample", False)
    counter = Counter(model)
    try:
        with torch.no_grad(), PrefixdCache(session, model, input_ids, attention_mask) as cache:
            out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
                                 max_new_tokens=NEW_TOKENS, **kw)
    finally:
        counter.remove()
    assert model.config._attn_implementation == "sdpa"  # given back
    cache.check_invariants()
    return out, cache, counter.tokens


def test_cold_then_warm_generate_matches_transformers_and_skips_the_cached_prefix(model, session):
    tokens = prompt(1, 45)
    ids = torch.tensor([tokens])
    want = reference(model, ids)
    cold, cache, ran = with_prefixd(model, session, ids)
    assert torch.equal(cold, want)
    assert cache.cached_tokens == [0] and ran == 45 + NEW_TOKENS - 1
    warm, cache, ran = with_prefixd(model, session, ids)
    assert torch.equal(warm, want)
    # 45 prompt tokens -> 2 committed blocks of 16; the rest and the decode steps run
    assert cache.cached_tokens == [32] and cache.reused_tokens == 32
    assert ran == 45 - 32 + NEW_TOKENS - 1


def test_a_longer_prompt_extends_a_cached_one_and_generated_blocks_are_committed(model, session):
    """The first request commits its prompt and the blocks its generated tokens filled."""
    base = prompt(2, 30)
    first = torch.tensor([base])
    out, _, _ = with_prefixd(model, session, first)
    grown = out[0].tolist() + prompt(3, 5)  # the conversation goes on: prompt + answer + more
    ids = torch.tensor([grown])
    want = reference(model, ids)
    got, cache, ran = with_prefixd(model, session, ids)
    assert torch.equal(got, want)
    assert cache.cached_tokens == [((30 + NEW_TOKENS - 1) // 16) * 16]
    assert ran == len(grown) - cache.cached_tokens[0] + NEW_TOKENS - 1


def test_a_prompt_of_whole_cached_blocks_recomputes_its_last_block(model, session):
    """The daemon serves at most len - 1 tokens, in whole blocks: the last block is computed
    again (its logits start generation) and written into the sequence's own block."""
    tokens = prompt(4, 32)  # exactly two blocks
    ids = torch.tensor([tokens])
    want = reference(model, ids)
    with_prefixd(model, session, ids)
    got, cache, ran = with_prefixd(model, session, ids)
    assert torch.equal(got, want)
    assert cache.cached_tokens == [16] and cache.reused_tokens == 16 and ran == 16 + NEW_TOKENS - 1


def test_batched_left_padded_prompts_match_transformers(model, session):
    shared = prompt(5, 20)
    rows = [shared + prompt(6, 7), prompt(7, 40), shared + prompt(8, 1)]
    with_prefixd(model, session, torch.tensor([rows[0]]))  # row 0's prefix is cached, others not
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    want = reference(model, ids, mask)
    got, cache, _ = with_prefixd(model, session, ids, mask)
    assert torch.equal(got, want)
    assert cache.cached_tokens == [16, 0, 16]
    got, cache, ran = with_prefixd(model, session, ids, mask)  # now all three are warm
    assert torch.equal(got, want)
    assert cache.cached_tokens == [16, 32, 16]
    # the common skip is min(pad + cached) = min(13 + 16, 0 + 32, 19 + 16) = 29 columns
    assert ran == 3 * (width - 29) + 3 * (NEW_TOKENS - 1)


def test_num_return_sequences_forks_each_prompt(model, session):
    """Sampling with a fixed seed: 3 rows per prompt, each its own fork, as with DynamicCache."""
    tokens = prompt(9, 37)
    with_prefixd(model, session, torch.tensor([tokens]))  # prompt 0 warm, prompt 1 cold
    ids = torch.tensor([tokens, [0] * 17 + prompt(10, 20)])
    mask = torch.tensor([[1] * 37, [0] * 17 + [1] * 20])
    seeded = dict(do_sample=True, top_k=0, num_return_sequences=3)
    with torch.no_grad():
        torch.manual_seed(7)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **seeded)
        torch.manual_seed(7)
        got, cache, _ = with_prefixd(model, session, ids, mask, **seeded)
    assert got.shape[0] == 6 and torch.equal(got, want)
    assert len({tuple(r) for r in got.tolist()}) > 2  # really sampled: the forks diverged
    assert cache.copies == 3 and len(cache.rows) == 6 and cache.cached_tokens == [32, 0]
    assert len({s.id for s in cache.rows}) == 6 and all(s.released for s in cache.rows + cache.parents)
    # the forks wrote only blocks of their own: the shared prompt's blocks still give its answer
    again = torch.tensor([tokens])
    got, cache, _ = with_prefixd(model, session, again)
    assert torch.equal(got, reference(model, again)) and cache.cached_tokens == [32]


def test_generate_with_prefix_and_refusals(model, session, daemon):
    ids = torch.tensor([prompt(10, 20)])
    with torch.no_grad():
        got = generate_with_prefix(model, session, ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(got, reference(model, ids))
    with pytest.raises(pc.InvalidArgument, match="left-padded"):
        PrefixdCache(session, model, ids[:, :4], torch.tensor([[1, 1, 1, 0]]))
    other = pc.KVLayout("tiny-llama", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16)
    with pc.connect(daemon.socket, other, name="hf-wrong", mapped=True) as s:
        with pytest.raises(pc.InvalidArgument, match="does not match the model"):
            PrefixdCache(s, model, ids)
    assert model.config._attn_implementation == "sdpa"


CHILD = """
import json, sys, torch
sys.path.insert(0, {root!r})
import prefixd.client as pc
from prefixd.client.hf import PrefixdCache, layout_for
from tests.client.test_hf import tiny_llama, Counter
model = tiny_llama()
ids = torch.tensor({ids!r})
counter = Counter(model)
with pc.connect({socket!r}, layout_for(model, "tiny-llama"), name="hf-child", mapped=True) as s:
    with torch.no_grad(), PrefixdCache(s, model, ids) as cache:
        out = model.generate(ids, past_key_values=cache, max_new_tokens={n}, do_sample=False)
print(json.dumps({{"out": out.tolist(), "cached": cache.cached_tokens, "ran": counter.tokens}}))
"""


def test_another_process_gets_a_warm_hit_with_identical_output(model, session, daemon):
    tokens = prompt(11, 50)
    ids = torch.tensor([tokens])
    want = reference(model, ids)
    with_prefixd(model, session, ids)
    code = CHILD.format(root=ROOT, ids=[tokens], socket=daemon.socket, n=NEW_TOKENS)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["out"] == want.tolist()
    assert child["cached"] == [48] and child["ran"] == 50 - 48 + NEW_TOKENS - 1


def test_a_committed_prefix_survives_kill_9_of_the_daemon(model, daemon):
    tokens = prompt(12, 40)
    ids = torch.tensor([tokens])
    want = reference(model, ids)
    layout = layout_for(model, "tiny-llama")
    with pc.connect(daemon.socket, layout, name="hf-before", mapped=True) as s:
        with_prefixd(model, s, ids)
        daemon.kill()
        daemon.start()
        # at once: the session's recovery may run under this request (it is then rerun)
        with torch.no_grad():
            got = generate_with_prefix(model, s, ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(got, want)
        got, cache, ran = with_prefixd(model, s, ids)
        assert not s.sequences
    assert torch.equal(got, want)
    assert cache.cached_tokens == [32] and ran == 40 - 32 + NEW_TOKENS - 1


class RestartingSession:
    """A stub session whose first open meets a daemon restart: it re-attaches (a new mapping)
    and raises DaemonRestarted, as the client library does."""

    def __init__(self, layout):
        self.layout = layout
        self.pool = types.SimpleNamespace(tensor=torch.zeros(4, *layout.block_shape))
        self.opens = 0
        self.released = []

    def open(self, tokens):
        self.opens += 1
        if self.opens == 1:
            self.pool = types.SimpleNamespace(tensor=torch.zeros(4, *self.layout.block_shape))
            raise pc.DaemonRestarted("the daemon restarted during open", [])
        return types.SimpleNamespace(id=self.opens, cached_tokens=0, lost=False, released=False,
                                     block_table=[0], num_indexed=0)

    def release(self, seq, commit=False, durability="crash"):
        seq.released = True
        self.released.append((seq.id, commit))


def test_a_request_opened_again_after_a_restart_stores_into_the_new_mapping(model):
    """Bug: the cache took session.pool before opening; an open that met a restart was redone
    against the re-attached session, but K/V went to the previous mapping (wrong tokens)."""
    session = RestartingSession(layout_for(model, "tiny-llama"))
    with PrefixdCache(session, model, torch.tensor([prompt(13, 5)])) as cache:
        assert session.opens == 2 and cache.pool is session.pool
    assert session.released == [(2, False)]  # no forward ran: nothing to commit
