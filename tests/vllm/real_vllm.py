"""What the tests that run real vLLM processes (``prefixd.tools.vllm_child``) share: the daemon
config, the skip-or-fail on a missing vLLM venv or model, the models and prompts, and reading
the daemon's Stats.

A missing vLLM venv or model skips, except under CI, as root (as in CI) or under ``.ci/run``
(``tests.requires``), where it fails: ``make test`` makes them.
"""

from __future__ import annotations

import os
import time

import pytest

from prefixd.api import prefixd_pb2 as pb
from prefixd.tools import vllm_child
from tests.requires import missing

NEW_TOKENS = 8
SYSTEM_TOKENS = 200

# SmolLM2 at vLLM's CPU block size in float32: 128 tokens x 30 layers x 2 x 3 x 64 x 4 bytes =
# 5.6 MiB a block. Small pools; recovered sequences (a release is not durable by itself) are
# released soon after a restart, so a pin check sees only the vLLM it kills.
CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"
reclaim_grace_s = 2.0

[engine.blocks]
device = 32
host = 32
disk = 64

[daemon]
lease_s = {lease_s}
"""


def must_have(reason: str) -> None:
    """Skip, or fail where the environment promises the vLLM venv (``.ci/run``:
    ``tests.requires``; CI, or root as in CI)."""
    if os.environ.get("CI") or os.geteuid() == 0:
        pytest.fail(reason + " (CI and root runs must have it: make vllm-venv)")
    missing(reason + " (make vllm-venv)")


def smollm2_dir():
    """The converted SmolLM2 directory (skips or fails without the vLLM venv or the model)."""
    try:
        vllm_child.vllm_python()
    except vllm_child.VllmMissing as exc:
        must_have(str(exc))
    pytest.importorskip("transformers")
    from prefixd.tools import smollm2

    try:
        return smollm2.convert()  # made by `make vllm-venv`; at once when it is there
    except smollm2.SmolLM2Missing as exc:
        must_have(str(exc))


def chat_prompts(model_dir, systems: int = 2, questions: int = 2) -> dict:
    """``{(system, question): token ids}`` of gsp-shaped chat requests (``chat_requests``)."""
    from transformers import AutoTokenizer

    from prefixd.tools import chat_requests

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return {(r.system, r.question): r.input_ids
            for r in chat_requests.build_requests(tokenizer, systems, questions, SYSTEM_TOKENS)}


def stats(daemon) -> dict:
    """The daemon's Stats values."""
    return dict(daemon.stub().Stats(pb.StatsRequest(), timeout=30).values)


def held(values: dict) -> tuple:
    """(sequences, references, pinned device blocks) the daemon holds."""
    return (int(values.get("prefixd_sequences", 0)), int(values.get("prefixd_refcount", 0)),
            int(values.get("prefixd_pinned_device_blocks", 0)))


def released(values: dict) -> dict | None:
    """``values`` when no session, sequence or pin is left, else None."""
    return values if values.get("prefixd_sessions") == 0 and held(values) == (0, 0, 0) else None


def wait(probe, timeout: float, message: str):
    """``probe()``'s first true answer, polled; fails with ``message`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"{message} within {timeout} s")


def full_blocks_below_last(prompt: list[int], block_size: int) -> int:
    """Tokens of a prompt's whole blocks below its last token (what a full hit is)."""
    return (len(prompt) - 1) // block_size * block_size
