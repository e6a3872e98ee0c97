"""``prefixd.tools.vllm_child`` without vLLM: how the main venv learns that the vLLM venv or the
vLLM child is not there (the scenario tests with real vLLM are ``tests/vllm/test_vllm_scenarios.py``)."""

import sys

import pytest

from prefixd.tools import vllm_child


def test_a_missing_vllm_venv_says_how_to_make_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXD_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(vllm_child.VllmMissing, match="make vllm-venv"):
        vllm_child.vllm_python()


def test_a_child_that_dies_before_its_prompts_fails_with_its_output(monkeypatch, tmp_path):
    """An interpreter without vLLM stands for a broken venv: waiting on the child must end with
    its error, not wait out the timeout or return an empty result."""
    monkeypatch.setenv("PREFIXD_VLLM_PYTHON", sys.executable)  # the main venv: no vllm there
    child = vllm_child.start_vllm(tmp_path / "model", [[1, 2, 3]], workdir=str(tmp_path / "run"),
                                  gated=True)
    with pytest.raises(vllm_child.VllmFailed, match=r"exited \(1\) before 'started 0'(.|\n)*No module named 'vllm'"):
        child.wait_for("started 0", timeout=120)
    assert child.done() == []
    with pytest.raises(vllm_child.VllmFailed, match="exited with 1"):
        child.wait(timeout=60)


def test_tp_workers_are_bound_to_the_allowed_cores_in_turn(monkeypatch):
    """vLLM's own binding refuses a host with fewer NUMA nodes than workers; the child shares
    out this process's cores instead (one each on the 2-core dev host)."""
    from prefixd.tools import vllm_run

    for cores, world, want in (({0, 1}, 2, "0|1"), ({0, 1, 2, 3}, 2, "0,1|2,3"), ({3}, 2, "3|3"),
                               ({0, 1}, 4, "0|1|0|1")):
        monkeypatch.setattr(vllm_run.os, "sched_getaffinity", lambda pid, c=cores: c)
        assert vllm_run.cpu_binding(world) == want


def test_a_tiny_llama_shape_whose_heads_do_not_divide_is_refused(tmp_path):
    from prefixd.tools import tiny_llama

    with pytest.raises(ValueError, match="num_kv_heads must divide"):
        tiny_llama.build(tmp_path, num_heads=8, num_kv_heads=3)
