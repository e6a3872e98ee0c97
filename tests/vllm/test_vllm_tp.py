"""Real vLLM with tensor parallelism (TP=2: two worker processes, each holding half of the KV
heads) over one real daemon, beside TP=1 engines of the same model.

The model is ``prefixd.tools.tiny_llama`` (4 layers, 8 heads, 4 KV heads, hidden 256, seeded
random weights): SmolLM2 has 3 KV heads, which no TP size above 1 splits. Its random weights
make greedy tokens barely depend on the context, so each run also records the top-20
logprobs of every generated token, and a wrong head or layer slice would change them.
Prompts are 300 random token ids (two whole 128-token blocks below the last token).

Four vLLM processes; the fixtures build on each other:

1. ``baseline``: TP=2 without a connector (tokens and logprobs every run must give), started
   beside ``fill``.
2. ``fill``: TP=2 with prefixd on a fresh daemon (``dying_connector``): computes prompt A
   (cold) and commits it; then, on prompt C, its TP rank 1 writes its slice of one layer and
   SIGKILLs itself in the middle of the save. vLLM's executor then ends the engine.
3. ``tp1``: TP=1 with prefixd: hits on A (which TP=2 computed) and computes B.
4. The daemon is SIGKILLed and restarted; then ``warm``, a fresh TP=2 with prefixd: A (what
   TP=2 computed before the restart), B (what TP=1 computed), C (the save the dead rank left:
   must not be served).

NOTE: the restart comes before ``warm`` starts. A vLLM living through it (tried) answers its
first request after the restart as a miss: its session's breaker is open until the
background probe sees the new daemon, and its idle workers re-attach on their next copy
(test_vllm_scenarios.py's NOTE).

NOTE: vLLM 0.32's CPU backend does not run pipeline parallelism here (PP=2 starts, then its
second stage fails on its first step: ``assert self.intermediate_tensors is not None`` in
``gpu_model_runner``), so PP is tested at the connector's level
(tests/vllm/test_connector_shards.py).
"""

import os
import random

import pytest

from prefixd.tools import vllm_child
from tests.daemon.harness import start_daemon
from tests.vllm.real_vllm import full_blocks_below_last, held, released, smollm2_dir, stats, wait

pytestmark = pytest.mark.timeout(900)

NEW_TOKENS = 6
TOP = 20
PROMPT_TOKENS = 300
LOGPROB_TOLERANCE = 1e-4  # float32 rounding of the same sums in another order
LEASE_S = 3.0

# The tiny model's block: 128 tokens x 4 layers x 2 x 4 heads x 32 x 4 bytes = 512 KiB.
CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"
reclaim_grace_s = 2.0

[engine.blocks]
device = 64
host = 64
disk = 128

[daemon]
lease_s = {lease_s}
"""


@pytest.fixture(scope="module")
def model_dir():
    smollm2_dir()  # the tokenizer's source, and the skip-or-fail when vLLM is missing
    from prefixd.tools import tiny_llama

    return tiny_llama.build()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(36)
    return {name: [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for name in "abc"}


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(CONFIG, lease_s=LEASE_S) as d:
        yield d


def _start(model_dir, prompts, workdir, **kw):
    return vllm_child.start_vllm(model_dir, prompts, max_tokens=NEW_TOKENS, logprobs=TOP, ignore_eos=True,
                                 workdir=str(workdir), **kw)


@pytest.fixture(scope="module")
def runs(model_dir, prompts, daemon, tmp_path_factory):
    """``{run: {prompt: result}}`` for the four runs of the module docstring, the dead rank's
    marker text, and the daemon's Stats once the killed engine's lease ran out."""
    a, b, c = prompts["a"], prompts["b"], prompts["c"]
    mark = str(tmp_path_factory.mktemp("mark") / "died")
    base = _start(model_dir, [a, b, c], tmp_path_factory.mktemp("baseline"), tp=2)
    fill = _start(model_dir, [a, c], tmp_path_factory.mktemp("fill"), tp=2, connector="prefixd",
                  socket=daemon.socket, gated=True, connector_class="tests.vllm.dying_connector:DyingConnector",
                  env={"PREFIXD_TEST_DIE_SHARD": "1", "PREFIXD_TEST_DIE_AT_SAVE": "2",  # dying_connector's
                       "PREFIXD_TEST_DIE_MARK": mark})
    children = [base, fill]
    try:
        fill.ready()
        fill.open_gate("0")
        fill.wait_for("done 0")
        fill.open_gate("1")
        wait(lambda: os.path.exists(mark), 300, "the TP rank did not die mid-save")
        fill.proc.wait(300)  # vLLM's executor ends the engine when a worker dies
        after_death = wait(lambda: released(stats(daemon)), LEASE_S + 30, "the dead engine's pins stayed")
        tp1 = _start(model_dir, [a, b], tmp_path_factory.mktemp("tp1"), connector="prefixd", socket=daemon.socket)
        children.append(tp1)
        tp1_done = tp1.wait().results
        daemon.kill()
        daemon.start()
        wait(lambda: held(stats(daemon)) == (0, 0, 0), 60, "recovered sequences were not released")
        warm = _start(model_dir, [a, b, c], tmp_path_factory.mktemp("warm"), tp=2, connector="prefixd",
                      socket=daemon.socket)
        children.append(warm)
        warm_done = warm.wait().results
        base_done = base.wait().results
        fill_done = fill.done()
    finally:
        for child in children:
            child.kill9()
    with open(mark) as f:
        died_in = f.read()
    return ({"base": dict(zip("abc", base_done)), "fill": dict(zip("ac", fill_done)),
             "tp1": dict(zip("ab", tp1_done)), "warm": dict(zip("abc", warm_done))},
            died_in, after_death)


def _logprob_diff(x: dict, y: dict) -> float:
    """The largest difference of the two runs' logprobs of one token at one step (over the
    top-20 tokens both list; ties at the tail may swap one in or out)."""
    assert len(x["logprobs"]) == len(y["logprobs"]) == NEW_TOKENS
    diff = 0.0
    for px, py in zip(x["logprobs"], y["logprobs"]):
        common = set(px) & set(py)
        assert len(common) >= TOP - 2, (px, py)
        diff = max(diff, *(abs(px[t] - py[t]) for t in common))
    return diff


def test_tp2_with_prefixd_gives_the_tokens_and_logprobs_of_tp2_without_it_cold_and_warm_after_a_restart(
        runs, prompts):
    results, _, _ = runs
    base, hit = results["base"], full_blocks_below_last(prompts["a"], 128)
    cases = [(results["fill"]["a"], "a", 0), (results["warm"]["a"], "a", hit)]
    for r, key, expect_hit in cases:
        assert r["external_hit_tokens"] == expect_hit, r
        assert r["tokens"] == base[key]["tokens"]
        assert _logprob_diff(r, base[key]) < LOGPROB_TOLERANCE


def test_tp2_hits_on_what_tp1_computed_and_tp1_on_what_tp2_computed(runs, prompts):
    results, _, _ = runs
    base, hit = results["base"], full_blocks_below_last(prompts["a"], 128)
    tp1_a, tp2_b = results["tp1"]["a"], results["warm"]["b"]
    assert tp1_a["external_hit_tokens"] == hit and tp1_a["tokens"] == base["a"]["tokens"]
    assert results["tp1"]["b"]["external_hit_tokens"] == 0
    assert tp2_b["external_hit_tokens"] == full_blocks_below_last(prompts["b"], 128) > 0
    assert tp2_b["tokens"] == base["b"]["tokens"]
    assert _logprob_diff(tp2_b, base["b"]) < LOGPROB_TOLERANCE


def test_a_tp_rank_killed_mid_save_leaves_nothing_served_and_no_pin(runs):
    results, died_in, after_death = runs
    assert died_in  # written by the rank inside its save, just before it killed itself
    r = results["warm"]["c"]
    assert r["external_hit_tokens"] == 0  # the half-written block was never committed
    assert r["tokens"] == results["base"]["c"]["tokens"]
    assert _logprob_diff(r, results["base"]["c"]) < LOGPROB_TOLERANCE
    assert after_death["prefixd_sessions"] == 0 and held(after_death) == (0, 0, 0)
