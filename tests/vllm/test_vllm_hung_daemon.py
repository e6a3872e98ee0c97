"""Real vLLM (the vLLM venv, ``prefixd.tools.vllm_run``) over a daemon that is SIGSTOPped: the
request that meets the hung daemon pays at most the request deadline per daemon call, and the
requests after it are not slowed at all (the session's breaker answers their calls at once).

A vLLM without a connector runs the same prompts beside it for the TTFT without prefixd. Each
vLLM start is 30-45 s of imports and model load on the 2-core dev host, two of them run here,
so this is ``slow`` (``make slow``).
"""

import os
import signal

import pytest

from prefixd.client.breaker import DEFAULT_REQUEST_TIMEOUT_MS
from prefixd.tools import vllm_child
from tests.daemon.harness import start_daemon
from tests.vllm.real_vllm import CONFIG, NEW_TOKENS, chat_prompts, smollm2_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

DEADLINE_S = DEFAULT_REQUEST_TIMEOUT_MS / 1000
# the scheduler half's daemon calls for one request: Open, then Release (with its commit);
# the worker half makes none while its lease stream is up (a SIGSTOP does not break it)
CALLS_PER_REQUEST = 2
# TTFTs of two vLLM processes on a loaded 2-core host wander by this much between requests
NOISE_S = 0.5


@pytest.fixture(scope="module")
def prompts():
    model_dir = smollm2_dir()
    by_key = chat_prompts(model_dir)
    return model_dir, [by_key[k] for k in sorted(by_key)]


def test_a_hung_daemon_costs_one_request_at_most_its_calls_deadlines_and_the_rest_nothing(prompts, tmp_path):
    model_dir, ids = prompts
    with start_daemon(CONFIG, lease_s=60.0) as d:
        base = vllm_child.start_vllm(model_dir, ids, max_tokens=NEW_TOKENS, gated=True,
                                     workdir=str(tmp_path / "base"))
        hung = vllm_child.start_vllm(model_dir, ids, max_tokens=NEW_TOKENS, connector="prefixd", socket=d.socket,
                                     gated=True, workdir=str(tmp_path / "hung"))
        stopped = False
        try:
            base.ready()
            hung.ready()
            for i in range(len(ids)):  # one request at a time on the host: TTFTs comparable
                base.open_gate(str(i))
                base.wait_for(f"done {i}")
                if i == 1:
                    os.kill(d.pid(), signal.SIGSTOP)
                    stopped = True
                hung.open_gate(str(i))
                hung.wait_for(f"done {i}")
            base.open_gate("end")
            hung.open_gate("end")
            base_done, hung_done = base.wait().results, hung.wait().results
        finally:
            if stopped:
                os.kill(d.pid(), signal.SIGCONT)
            base.kill9()
            hung.kill9()
        ttft = [(b["ttft_ms"] / 1000, h["ttft_ms"] / 1000) for b, h in zip(base_done, hung_done)]
        print("ttft (no connector, daemon SIGSTOPped from request 1):", ttft)
        assert [b["tokens"] for b in base_done] == [h["tokens"] for h in hung_done]
        first_b, first_h = ttft[1]
        assert first_h <= first_b + CALLS_PER_REQUEST * DEADLINE_S + NOISE_S, ttft
        for b, h in ttft[2:]:
            assert h <= b + NOISE_S, f"a request after the first paid for the hung daemon: {ttft}"
