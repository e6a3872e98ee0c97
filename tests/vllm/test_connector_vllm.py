"""The connector with real vLLM (run in the vLLM venv as a child process) and a real daemon.

Skipped with a reason where the vLLM venv is missing (``make vllm-venv`` makes it), failed
under ``.ci/run`` (``tests.requires``).
One ``import vllm`` (no model). A second vLLM process answered from prefixd is
tests/vllm/test_vllm_scenarios.py's (this module's own two-process test repeated it, at two
vLLM starts of 1-6 minutes on the loaded dev host; its Stats check moved there).
"""

import json
import os
import pathlib
import subprocess

import pytest

from tests.daemon.harness import start_daemon
from tests.requires import missing

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHILD = pathlib.Path(__file__).with_name("connector_child.py")
VLLM_PYTHON = os.environ.get("PREFIXD_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")



@pytest.fixture(autouse=True, scope="module")
def _vllm_venv():
    if not os.path.exists(VLLM_PYTHON):  # skips here, fails under .ci/run (tests.requires)
        missing(f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv, or set PREFIXD_VLLM_PYTHON)")


# SmolLM2's blocks are 2.8 MiB at vLLM's CPU block size (128 tokens x 30 layers): keep pools small.
CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"
reclaim_grace_s = 5.0

[engine.blocks]
device = 48
host = 48
disk = 48

[daemon]
lease_s = {lease_s}
"""


def _child(*args, timeout: float = 900.0) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([VLLM_PYTHON, str(CHILD), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(ROOT))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (f"child failed rc={proc.returncode}\n{proc.stdout[-3000:]}\n"
                                            f"{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):]), proc.stderr


@pytest.fixture
def daemon():
    with start_daemon(CONFIG, lease_s=5.0) as d:
        yield d


@pytest.mark.timeout(900)
def test_round_trip_through_the_connector_and_vllms_own_attention(daemon):
    """KV written by vLLM's cache write is saved by the worker side, committed, loaded by
    another worker side into other blocks, and vLLM's attention kernel over them matches
    attention over the original K/V (the GPU backends' K/V split would read other numbers)."""
    result, _ = _child("roundtrip", daemon.socket, timeout=300)
    assert result["report"] == {"a": {"0": 3}}  # JSON keys are strings
    assert result["cached_tokens"] == 96
    assert result["load_errors"] == []
    assert result["stats_hit_tokens"] >= 96  # the daemon's own Stats count the hit
    assert result["max_err"] < 0.02  # bf16 inputs
    assert result["max_err_columns"] > 0.5
