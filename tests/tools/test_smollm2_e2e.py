"""SmolLM2 through a real daemon gives transformers' own greedy tokens: cold, warm, from another
client process, and after ``kill -9`` of the daemon and its restart (issue 13 item 2).

The one real-model test (``slow``: it loads SmolLM2-135M, converting the wheel's GGUF on the
first run; ``make test`` runs it). Prompts are short chat requests sharing a system prompt, so
that the forwards stay a few seconds on the 2-core host; the tiny-llama tests in
``tests/client/test_hf.py`` cover the cache's mechanics.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from prefixd.tools import chat_requests, smollm2  # noqa: E402
from tests.daemon.harness import ROOT, start_daemon  # noqa: E402

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
SYSTEM_TOKENS = 120
MODEL_ID = "smollm2-135m-instruct"

CHILD = """
import json, sys
import torch
import prefixd.client as pc
from prefixd.client.hf import layout_for
from prefixd.tools import chat_requests, smollm2
from prefixd.tools.e2e_run import set_threads
set_threads(None)
loaded = smollm2.load()
with pc.connect({socket!r}, layout_for(loaded.model, {model_id!r}), name="smollm2-child", mapped=True) as s:
    t = chat_requests.timed_generate(loaded.model, {ids!r}, {n}, session=s)
print(json.dumps({{"tokens": t.tokens, "cached": t.cached_tokens}}))
"""


@pytest.fixture(scope="module")
def loaded():
    try:
        smollm2.gguf_path()
    except smollm2.SmolLM2Missing as exc:
        pytest.skip(str(exc))
    import torch

    from prefixd.tools.e2e_run import set_threads

    before = torch.get_num_threads()
    set_threads(None)  # 1 thread on a loaded host (see set_threads)
    yield smollm2.load()
    torch.set_num_threads(before)


def test_smollm2_greedy_tokens_equal_transformers_cold_warm_other_process_and_after_kill_9(loaded):
    import prefixd.client as pc
    from prefixd.client.hf import layout_for

    model = loaded.model
    requests = chat_requests.build_requests(loaded.tokenizer, 1, 3, SYSTEM_TOKENS)
    ids = [r.input_ids for r in requests]
    want = [chat_requests.timed_generate(model, r.input_ids, NEW_TOKENS).tokens for r in requests]
    assert all(len(w) > 0 for w in want)
    with start_daemon(lease_s=10.0) as daemon:
        layout = layout_for(model, MODEL_ID)
        with pc.connect(daemon.socket, layout, name="smollm2-test", mapped=True) as session:
            cold = chat_requests.timed_generate(model, requests[0].input_ids, NEW_TOKENS, session=session)
            assert cold.cached_tokens == 0 and cold.tokens == want[0]
            warm = chat_requests.timed_generate(model, requests[1].input_ids, NEW_TOKENS, session=session)
            assert warm.cached_tokens == _blocks(_common(ids[1], ids[0])) and warm.tokens == want[1]

            code = CHILD.format(socket=daemon.socket, model_id=MODEL_ID, ids=requests[2].input_ids, n=NEW_TOKENS)
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                                  cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
            assert proc.returncode == 0, proc.stderr[-3000:]
            child = json.loads(proc.stdout.strip().splitlines()[-1])
            shared = max(_common(ids[2], ids[0]), _common(ids[2], ids[1]))
            assert child["cached"] == _blocks(shared) and child["tokens"] == want[2]

            daemon.kill()
            daemon.start()
            again = chat_requests.timed_generate(model, requests[1].input_ids, NEW_TOKENS, session=session)
            # The whole prompt of request 1 was committed (its full blocks) before the kill.
            assert again.cached_tokens == _blocks(len(ids[1]))
            assert again.tokens == want[1]
            session.check_invariants()
            assert not session.sequences


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _blocks(tokens: int) -> int:
    """Tokens in whole 16-token blocks: what the daemon can have cached of a prefix."""
    return tokens // 16 * 16


def test_the_converted_directory_is_a_plain_hf_model_with_the_tied_embedding(loaded):
    """Regression (issue 14): ``safetensors.torch.save_model`` keeps only ``lm_head.weight`` of
    the tied pair, and a loader that reads ``model.embed_tokens.weight`` (vLLM) then answers
    token 0 forever; and a ``quantization_config`` left in ``config.json`` makes loaders treat
    the bf16 copy as GGUF-quantized."""
    from safetensors import safe_open

    with safe_open(str(loaded.model_dir / smollm2.WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_dtype() == "BF16" and embed.get_shape() == [49152, 576]
    assert "lm_head.weight" not in keys and len(keys) == 272
    config = json.loads((loaded.model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"]
